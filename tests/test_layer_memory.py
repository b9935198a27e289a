"""Lethe's per-layer memory on small tensors (CUDA where there is one: its compiled decode): a
round packs each layer's kept entries into as few of the request's slots as hold them, every
entry's row still holds its token's K/V, and the request's memory is the sum of its layers'
lists (the engine runs are in test_engine_lethe)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from kernel_cases import DEVICE
from policy_cases import Cache
from sglang_ext.policies.lethe import runtime as eviction
from sglang_ext.policies.lethe.layer_memory import PoolLayoutError, pooled_buffers
from test_lethe_runtime import HOLE, Pool, runtime_for, step

PER_LAYER = {"sparse_ratio": 1.5, "max_kv_ratio": 0.3}
PER_KV_HEAD = {**PER_LAYER, "per_kv_head": True}


def rounded(cache, runtime, request, protected_len=0):
    """Scores with a few salient tokens, different in every layer, then one round over all the
    request holds. Returns the K/V each layer's kept positions had before it, and the pool."""
    row, length = request.row, request.seq_len - 1
    gen = torch.Generator().manual_seed(3)
    runtime.scores[:, row, :length] = torch.rand(runtime.num_lists, length, generator=gen) ** 8
    slots = cache.req_to_token[row, :length].long().clone()
    before = [(cache.keys[layer][slots].clone(), cache.values[layer][slots].clone())
              for layer in range(cache.num_layers)]  # fmt: skip
    pool = Pool()
    runtime.prune([dataclasses.replace(request, protected_len=protected_len)], [length], pool.ops())
    return before, pool


def entries(runtime, row):
    """Each list's (positions, rows): a list per layer, or per (layer, KV head)."""
    counts = runtime.count[:, row].tolist()
    return [
        (runtime.positions[i, row, :n].long(), runtime.layer_rows[i, row, :n].long())
        for i, n in enumerate(counts)
    ]


def test_the_pool_must_hold_its_layers_in_one_buffer():
    cache = Cache(num_layers=3, device=DEVICE)
    pooled = pooled_buffers(cache.context().kv_pool, 3)
    assert pooled.slots == cache.SLOTS and pooled.keys.shape[0] == 3 * cache.SLOTS
    assert torch.equal(pooled.values[2 * cache.SLOTS + 7], cache.values[2][7])
    separate = SimpleNamespace(
        get_key_buffer=[k.clone() for k in cache.keys].__getitem__,
        get_value_buffer=cache.values.__getitem__,
    )
    with pytest.raises(PoolLayoutError, match="layers in one buffer"):
        pooled_buffers(separate, 3)


@pytest.mark.parametrize("cap", [0.3, 1.0])  # capped: equally many per layer; 1.0: the rule's own
def test_a_round_packs_each_layers_entries_and_every_row_keeps_its_tokens_kv(cap):
    cache = Cache(num_layers=4, seq_lens=(300, 12), device=DEVICE)
    runtime = runtime_for(cache, **{**PER_LAYER, "max_kv_ratio": cap})
    request = step(cache, runtime, 0)
    row, length = request.row, request.seq_len - 1
    before, pool = rounded(cache, runtime, request)
    pooled = runtime.pooled

    lists = entries(runtime, row)
    cap = runtime.policy.round_cap(length)
    rows_used = torch.cat([rows for _, rows in lists])
    assert rows_used.unique().numel() == rows_used.numel()  # no two entries share a row
    held = cache.req_to_token[row, :length]
    held = held[held != HOLE].long()
    assert held.numel() == math.ceil(rows_used.numel() / cache.num_layers)  # the sum, packed
    assert set((rows_used % pooled.slots).tolist()) <= set(held.tolist())
    for layer, (positions, rows) in enumerate(lists):
        assert 0 < positions.numel() <= cap and torch.all(positions[1:] > positions[:-1])
        keys, values = before[layer]
        assert torch.equal(pooled.keys[rows], keys[positions])
        assert torch.equal(pooled.values[rows], values[positions])
    if len({positions.numel() for positions, _ in lists}) == 1:  # equally many in every layer
        for layer, (_, rows) in enumerate(lists):  # so every layer reads its own buffer still
            assert bool((rows // pooled.slots == layer).all()), layer
    union = torch.cat([positions for positions, _ in lists]).unique().numel()
    assert held.numel() < union  # the layers keep different tokens: less than their union
    assert request.state.evicted == len(pool.freed) == length - held.numel()
    assert not set(pool.freed) & set(held.tolist())
    assert cache.req_to_token[2, :12].ne(HOLE).all()  # the other request is untouched


def test_decode_after_a_round_attends_to_each_layers_kept_tokens():
    cache = Cache(num_layers=3, seq_lens=(200, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_LAYER)
    request = step(cache, runtime, 0)
    before, _ = rounded(cache, runtime, request)
    runtime.prepare_decode(cache.batch)  # the next token, at the slot SGLang gave it
    from sglang_ext.kernels.split_kv_decode import attend_positions_ref

    for layer in range(cache.num_layers):
        out = cache.decode(runtime.decode_fns[layer], layer).view(2, cache.Q_HEADS, cache.DIM)
        positions, _ = entries(runtime, request.row)[layer]
        past = positions[:-1]  # the last entry is the token just decoded
        keys, values = before[layer]
        k = torch.cat([keys[past], cache.new_k[:1]])
        v = torch.cat([values[past], cache.new_v[:1]])
        q = cache.q.view(2, cache.Q_HEADS, cache.DIM)[0]
        expected, _ = attend_positions_ref(q, k, v, torch.arange(len(k)), 0.125)
        torch.testing.assert_close(out[0], expected.to(out.dtype), **cache.tol)


def test_radix_owned_slots_are_never_packed_into_moved_or_freed():
    cache = Cache(num_layers=3, seq_lens=(200, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_LAYER)
    request = step(cache, runtime, 0)
    protected = cache.req_to_token[request.row, :64].long().clone()
    rows_before = [cache.keys[layer][protected].clone() for layer in range(3)]
    _, pool = rounded(cache, runtime, request, protected_len=64)
    assert torch.equal(cache.req_to_token[request.row, :64].long(), protected)
    assert not set(pool.freed) & set(protected.tolist())
    for layer in range(3):
        assert torch.equal(cache.keys[layer][protected], rows_before[layer])
        positions, rows = entries(runtime, request.row)[layer]
        prefix = positions < 64
        natural = layer * runtime.pooled.slots + protected[positions[prefix]]
        assert torch.equal(rows[prefix], natural)


def test_later_rounds_keep_the_accounting_exact():
    cache = Cache(num_layers=3, seq_lens=(300, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_LAYER)
    request = step(cache, runtime, 0)
    rounded(cache, runtime, request)
    freed_first = request.state.evicted
    _, pool = rounded(cache, runtime, request)  # new scores: layers drop more
    rows_used = sum(n for n in runtime.count[:, request.row].tolist())
    held = int(cache.req_to_token[request.row, : request.seq_len - 1].ne(HOLE).sum())
    assert held == math.ceil(rows_used / 3)
    assert request.state.evicted == freed_first + len(pool.freed) == request.seq_len - 1 - held


def test_each_layers_entries_are_counted_and_a_step_attends_their_mean():
    cache = Cache(num_layers=3, seq_lens=(300, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_LAYER)
    request = step(cache, runtime, 0)
    assert runtime.held_per_layer(request) == (300, 300, 300)  # no round yet: every layer all
    rounded(cache, runtime, request)  # over the 299 positions before the token being decoded
    runtime.prepare_decode(cache.batch)
    counts = runtime.count[:, request.row].tolist()
    assert runtime.held_per_layer(request) == tuple(counts)
    report = runtime.report(request, extend=False)
    assert report.attended == sum(counts) / 3 and report.held == 300 - request.state.evicted
    default = runtime_for(Cache(num_layers=3, device=DEVICE))  # one list for every layer
    assert default.held_per_layer(step(cache, default, 0)) is None


@pytest.mark.parametrize(
    "params",
    [{}, PER_LAYER, {**PER_LAYER, "pack_layers": False}, PER_KV_HEAD],
    ids=["one-set", "per-layer-packed", "per-layer-union", "per-kv-head"],
)
@pytest.mark.parametrize("round_entries", [None, 1000], ids=["one-batch", "two-batches"])
def test_a_batched_round_ends_as_each_requests_round_alone(params, round_entries, monkeypatch):
    """Requests of different lengths, one with a radix prefix, pruned in one call: the same
    slots freed, lists, rows, K/V and thresholds as each pruned alone, in one batch or (a
    smaller ``ROUND_ENTRIES``: 3 layers x 299 positions fit once) in two."""
    if round_entries is not None:
        monkeypatch.setattr(eviction, "ROUND_ENTRIES", round_entries)
    outcomes = []
    for batched in (True, False):
        cache = Cache(num_layers=3, seq_lens=(300, 140, 60), device=DEVICE)
        runtime = runtime_for(cache, **params)
        requests = [step(cache, runtime, i) for i in range(3)]
        requests[1] = dataclasses.replace(requests[1], protected_len=32)
        gen = torch.Generator().manual_seed(5)
        for request in requests:
            scores = torch.rand(runtime.num_lists, request.seq_len - 1, generator=gen) ** 8
            runtime.scores[:, request.row, : request.seq_len - 1] = scores.to(DEVICE)
        lengths = [request.seq_len - 1 for request in requests]
        pool = Pool()
        if batched:
            runtime.prune(requests, lengths, pool.ops())
        else:
            for request, length in zip(requests, lengths):
                runtime.prune([request], [length], pool.ops())
        state = [runtime.count, runtime.positions, runtime.scores, cache.req_to_token]
        if runtime.layer_rows is not None:
            state += [runtime.layer_rows, runtime.pooled.keys, runtime.pooled.values]
        hosts = [(r.state.evicted, r.state.policy_state.threshold) for r in requests]
        outcomes.append((pool.freed, hosts, [t.clone() for t in state]))
    (freed, hosts, state), (freed_alone, hosts_alone, state_alone) = outcomes
    assert freed == freed_alone and len(freed) > 0 and hosts == hosts_alone
    for tensor, alone in zip(state, state_alone, strict=True):
        assert torch.equal(tensor, alone)


def test_a_cap_below_the_sinks_and_recent_window_still_packs_every_row_right():
    """Each layer keeps its sinks and recent window past a tiny cap (more entries than the cap):
    the rows the request keeps still hold every entry's K/V, one entry a row."""
    cache = Cache(num_layers=3, seq_lens=(20, 12), device=DEVICE)
    params = {"sparse_ratio": 1.5, "max_kv_ratio": 0.1, "recent_ratio": 0.9, "sink_tokens": 4}
    runtime = runtime_for(cache, **params)
    request = step(cache, runtime, 0)
    before, _ = rounded(cache, runtime, request)
    lists = entries(runtime, request.row)
    assert min(positions.numel() for positions, _ in lists) > runtime.policy.round_cap(19)
    rows_used = torch.cat([rows for _, rows in lists])
    assert rows_used.unique().numel() == rows_used.numel()
    for layer, (positions, rows) in enumerate(lists):
        keys, values = before[layer]
        assert torch.equal(runtime.pooled.keys[rows], keys[positions])
        assert torch.equal(runtime.pooled.values[rows], values[positions])


@pytest.mark.parametrize(
    "params", [{}, PER_LAYER, PER_KV_HEAD], ids=["one-set", "per-layer", "per-kv-head"]
)
def test_the_state_the_engine_pays_for_per_request_slot_is_what_the_runtime_allocates(params):
    cache = Cache(num_layers=3, seq_lens=(40, 12), device=DEVICE)
    runtime = runtime_for(cache, **params)
    rows, width = runtime.positions.shape[1], runtime.positions.shape[2]
    per_row = [runtime.positions, runtime.scores, runtime.layer_rows]
    if runtime._slot_table is not None:
        per_row.append(runtime._slot_table[:, :width])
    if runtime._logits is not None:
        per_row.append(runtime._logits)
    allocated = sum(t.nbytes for t in per_row if t is not None)
    # the decode scratch is per batch row (as many as the request slots in the engine)
    heads = cache.Q_HEADS if runtime._logits is not None else 0
    paid = runtime.request_slot_bytes(
        runtime.policy, cache.num_layers, heads, cache.KV_HEADS, width
    )
    assert allocated <= rows * paid
    assert allocated >= 0.9 * (rows - 1) * paid  # the bound is not loose either


@pytest.mark.parametrize("rounds_before", [0, 1])
def test_the_shared_core_holds_at_a_requests_first_round_only(rounds_before):
    """Layer 0 alone reads position 17 (a needle) and layer 1 spreads its attention: at a
    request's first round layer 1 keeps the needle too (the shared core); at a later one it cuts
    by its own scores and drops it."""
    cache = Cache(num_layers=2, seq_lens=(120, 12), device=DEVICE)
    runtime = runtime_for(cache, per_layer=True, shared_ratio=0.5, max_kv_ratio=0.3)
    request = step(cache, runtime, 0)
    request.state.rounds = rounds_before
    row, length = request.row, request.seq_len - 1
    runtime.scores[:, row, :length] = 1e-3
    runtime.scores[0, row, 17] = 1.0
    runtime.scores[1, row, 20:75] = 0.5
    runtime.prune([request], [length], Pool().ops())
    kept = [set(positions.tolist()) for positions, _ in entries(runtime, row)]
    assert 17 in kept[0]
    assert (17 in kept[1]) == (rounds_before == 0)


def test_lists_per_kv_head_pack_each_heads_entries_into_that_head_of_the_rows():
    """Each (layer, KV head) keeps its own list; a round packs a head's entries into that head
    of the request's rows, so the slots held are the most any head's lists need, every list's
    rows still hold its head's K/V of its tokens, and the heads of a layer keep different
    tokens."""
    cache = Cache(num_layers=3, seq_lens=(300, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_KV_HEAD)
    heads = cache.KV_HEADS
    assert runtime.lists_per_layer == heads and runtime.num_lists == 3 * heads
    request = step(cache, runtime, 0)
    row, length = request.row, request.seq_len - 1
    before, pool = rounded(cache, runtime, request)
    pooled, lists = runtime.pooled, entries(runtime, row)
    for head in range(heads):
        used = torch.cat([rows for i, (_, rows) in enumerate(lists) if i % heads == head])
        assert used.unique().numel() == used.numel()  # no two of a head's entries share a row
    held = cache.req_to_token[row, :length]
    held = held[held != HOLE].long()
    per_head = [sum(lists[i][0].numel() for i in range(h, len(lists), heads)) for h in range(heads)]
    assert held.numel() == max(math.ceil(n / 3) for n in per_head)
    for i, (positions, rows) in enumerate(lists):
        layer, head = divmod(i, heads)
        assert set((rows % pooled.slots).tolist()) <= set(held.tolist())
        keys, values = before[layer]
        assert torch.equal(pooled.keys[rows, head], keys[positions, head])
        assert torch.equal(pooled.values[rows, head], values[positions, head])
    assert any(
        not torch.equal(lists[layer * heads][0], lists[layer * heads + 1][0]) for layer in range(3)
    )
    assert request.state.evicted == len(pool.freed) == length - held.numel()
    assert runtime.held_per_layer(request) == tuple(
        max(lists[i][0].numel() for i in range(layer * heads, (layer + 1) * heads)) + 1
        for layer in range(3)
    )


def test_decode_over_lists_per_kv_head_reads_each_heads_own_tokens():
    cache = Cache(num_layers=2, seq_lens=(200, 12), device=DEVICE)
    runtime = runtime_for(cache, **PER_KV_HEAD)
    request = step(cache, runtime, 0)
    before, _ = rounded(cache, runtime, request)
    runtime.prepare_decode(cache.batch)
    from sglang_ext.kernels.split_kv_decode import attend_positions_ref

    heads, group = cache.KV_HEADS, cache.Q_HEADS // cache.KV_HEADS
    for layer in range(cache.num_layers):
        out = cache.decode(runtime.decode_fns[layer], layer).view(2, cache.Q_HEADS, cache.DIM)
        q = cache.q.view(2, cache.Q_HEADS, cache.DIM)[0]
        for head in range(heads):
            positions, _ = entries(runtime, request.row)[layer * heads + head]
            past = positions[:-1]  # the last entry is the token just decoded
            keys, values = before[layer]
            k = torch.cat([keys[past, head : head + 1], cache.new_k[:1, head : head + 1]])
            v = torch.cat([values[past, head : head + 1], cache.new_v[:1, head : head + 1]])
            q_heads = slice(head * group, (head + 1) * group)
            expected, _ = attend_positions_ref(q[q_heads], k, v, torch.arange(len(k)), 0.125)
            torch.testing.assert_close(out[0, q_heads], expected.to(out.dtype), **cache.tol)


def test_lists_per_kv_head_need_per_layer_memory():
    from sglang_ext.policies import build_policy
    from sglang_ext.policies.base import PolicyConfigError

    for params in ({"per_layer": False}, {"pack_layers": False}):
        with pytest.raises(PolicyConfigError, match="per_kv_head"):
            build_policy("lethe", {"per_kv_head": True, **params})
    with pytest.raises(PolicyConfigError, match="per_kv_head"):
        build_policy("lethe", {"per_kv_head": True}).one_set()
