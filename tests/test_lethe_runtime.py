"""Lethe's runtime on small CPU tensors: appending at each decode step, a pruning round's slot
accounting, admission sizes and the plan (the engine runs are in test_engine_lethe)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from policy_cases import Cache, ThreadRanks
from sglang_ext.policies.lethe import runtime as lethe_runtime
from sglang_ext.policies.lethe.runtime import LetheRuntime
from sglang_ext.policies import RankGroup, build_policy
from sglang_ext.policies.runtime import EngineOps, StepPlan, StepRequest

HOLE = 0


class Pool:
    """The allocator's side of a round: what was freed, in how many calls."""

    def __init__(self):
        self.freed: list[int] = []
        self.calls = 0

    def free(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())
        self.calls += 1

    def ops(self) -> EngineOps:
        return EngineOps(
            free_slots=self.free,
            available_slots=lambda: len(self.freed),
            rerun_extend=None,
        )


def runtime_for(cache, ranks=None, **params):
    """Lethe's runtime under the rule these tests were written for: rounds on Algorithm 1's
    threshold, a recent window of 0.3, and one retained set unless a ``sparse_ratio`` asks for
    per-layer lists (test_layer_memory covers those)."""
    rule = {
        "max_kv_ratio": 0.5, "evict_threshold": 8, "round_interval": None, "recent_ratio": 0.3,
        "decay": 0.95, "per_layer": "sparse_ratio" in params,
    }  # fmt: skip
    policy = build_policy("lethe", {**rule, **params})
    runtime = LetheRuntime(policy, cache.context(ranks=ranks))
    batch = cache.batch
    runtime.reset_rows(batch.req_pool_indices, batch.seq_lens - 1)  # prefilled, before the token
    return runtime


def step(cache, runtime, row_index, own="served"):
    state = runtime.new_request(runtime.policy if own == "served" else own, None)
    return StepRequest(
        state=state, rid=f"r{row_index}", row=int(cache.batch.req_pool_indices[row_index]),
        seq_len=int(cache.batch.seq_lens[row_index]), prompt_len=8, output_ids=[],
        protected_len=0, index=row_index,
    )  # fmt: skip


def test_each_decode_step_appends_the_token_to_every_layers_list_once():
    cache = Cache(num_layers=3, seq_lens=(30, 12))
    runtime = runtime_for(cache)
    rows, lens = cache.batch.req_pool_indices, cache.batch.seq_lens
    runtime.prepare_decode(cache.batch)
    for layer in range(3):
        assert runtime.count[layer, rows].tolist() == lens.tolist()
        for row, n in zip(rows.tolist(), lens.tolist(), strict=True):
            assert runtime.positions[layer, row, n - 1] == n - 1
            assert runtime.scores[layer, row, n - 1] == 0


def test_cuda_graph_padding_appends_to_the_trash_row_only():
    cache = Cache(num_layers=2, seq_lens=(30, 12))
    runtime = runtime_for(cache)
    before = runtime.count.clone()
    padded = SimpleNamespace(
        req_pool_indices=torch.tensor([1, 0, 0]), seq_lens=torch.tensor([30, 1, 1])
    )  # a graph of batch 3 replaying one request; padding has seq_len 1
    runtime.prepare_decode(padded)
    assert runtime.state_rows[:3].tolist() == [1, runtime.trash_row, runtime.trash_row]
    assert runtime.count[:, 1].tolist() == [30, 30]
    assert torch.equal(runtime.count[:, 2:runtime.trash_row], before[:, 2:runtime.trash_row])
    assert runtime.count[:, 0].tolist() == before[:, 0].tolist()


def test_a_round_frees_exactly_what_no_layer_keeps_and_leaves_holes():
    cache = Cache(num_layers=3, seq_lens=(200, 12))
    runtime = runtime_for(cache)
    request = step(cache, runtime, 0)
    row, length = request.row, request.seq_len - 1
    gen = torch.Generator().manual_seed(1)
    runtime.scores[:, row, :length] = torch.rand(3, length, generator=gen) ** 8  # a few salient
    slots_before = cache.req_to_token[row, :length].clone()
    pool = Pool()

    runtime.prune([request], [length], pool.ops())

    kept = torch.zeros(length, dtype=torch.bool)
    for layer in range(3):
        n = int(runtime.count[layer, row])
        positions = runtime.positions[layer, row, :n]
        assert torch.all(positions[1:] > positions[:-1])  # still ascending, no repeats
        kept[positions.long()] = True
    now = cache.req_to_token[row, :length]
    assert torch.equal(now == HOLE, ~kept)  # a hole exactly where no layer keeps the position
    assert sorted(pool.freed) == sorted(slots_before[~kept].tolist())
    assert request.state.evicted == len(pool.freed) > 0
    assert int(kept.sum()) <= runtime.policy.round_cap(length)  # max_kv_ratio's cap
    assert kept[:4].all() and kept[-1]  # sink tokens and the most recent stay
    assert runtime.stats.rounds == 1 and runtime.stats.freed_slots == len(pool.freed)
    assert cache.req_to_token[2, :12].ne(HOLE).all()  # the other request is untouched


def test_a_steps_rounds_free_in_one_call_per_batch_sized_by_the_lists_not_the_length(monkeypatch):
    """SGLang's free reads its slots on the host: requests pruned together give theirs back in
    one call. A round's tensors span the longest list, so two requests whose lists a round cut
    to half their length share a batch that their lengths alone would not fit."""
    cache = Cache(num_layers=2, seq_lens=(200, 200))
    runtime = runtime_for(cache)
    requests = [step(cache, runtime, i) for i in range(2)]
    pool = Pool()
    runtime.prune(requests, [199, 199], pool.ops())
    assert pool.calls == 1 and len(pool.freed) == sum(r.state.evicted for r in requests) > 0
    assert runtime.count[:, [r.row for r in requests]].max() <= 100  # max_kv_ratio 0.5
    monkeypatch.setattr(lethe_runtime, "ROUND_ENTRIES", 2 * 120 * 2)  # two lists, not lengths
    runtime.prune(requests, [199, 199], pool.ops())
    assert pool.calls == 2


def test_radix_owned_positions_are_never_freed():
    cache = Cache(num_layers=2, seq_lens=(200, 12))
    runtime = runtime_for(cache)
    request = step(cache, runtime, 0)
    protected = dataclasses.replace(request, protected_len=64)
    runtime.scores[:, protected.row, :199] = torch.linspace(1, 0, 199) ** 20
    pool = Pool()
    runtime.prune([protected], [199], pool.ops())
    assert cache.req_to_token[protected.row, :64].ne(HOLE).all()
    assert pool.freed and not set(pool.freed) & set(cache.req_to_token[protected.row, :64].tolist())


def test_a_round_is_planned_once_retained_kv_passes_the_threshold():
    cache = Cache(num_layers=2, seq_lens=(200, 9))
    runtime = runtime_for(cache, evict_threshold=16)
    long, short = step(cache, runtime, 0), step(cache, runtime, 1)
    opted_out = dataclasses.replace(long, state=runtime.new_request(None, None))
    plan = runtime.plan_step([long, short, opted_out], decode=True)
    assert plan.rounds == [long]
    long.state.evicted = 190  # what the threshold counts is what it still holds
    assert runtime.plan_step([long], decode=True).rounds == []


def test_admission_counts_a_request_at_its_expected_retained_kv():
    cache = Cache(num_layers=2)
    runtime = runtime_for(cache, evict_threshold=256)
    lethe = runtime.new_request(runtime.policy, None)
    assert runtime.admission_tokens(lethe, 10_000) == runtime.policy.expected_kv(10_000) < 10_000
    assert runtime.admission_tokens(lethe, 100) == 100  # under the threshold: all of it
    opted_out = runtime.new_request(None, None)
    assert not opted_out.evicts and runtime.admission_tokens(opted_out, 10_000) == 10_000


def test_relieving_memory_prunes_requests_over_a_rounds_cap_now():
    cache = Cache(num_layers=2, seq_lens=(200, 5))
    runtime = runtime_for(cache, evict_threshold=10_000)  # no round would be due
    runtime.prepare_decode(cache.batch)  # the last step's token is in the lists
    big, small = step(cache, runtime, 0), step(cache, runtime, 1)
    pool = Pool()
    freed = runtime.relieve_memory([big, small], pool.ops())
    assert freed == len(pool.freed) == big.state.evicted > 0
    assert big.seq_len - big.state.evicted <= runtime.policy.round_cap(big.seq_len)
    assert small.state.evicted == 0  # 5 tokens: a round keeps sink + 1 at least


def prefill_then_round(cache, prefill_q, ranks=None, **params):
    """A prefill of the cache's requests (observation windows seed the scores), one decode step,
    then a round of the first request over all it holds. What each layer keeps, and the slots
    freed."""
    runtime = runtime_for(cache, ranks, observation_window=16, **params)
    requests = [step(cache, runtime, i) for i in range(2)]
    lens = cache.batch.seq_lens - 1
    prefill = SimpleNamespace(
        req_pool_indices=cache.batch.req_pool_indices, seq_lens=lens,
        extend_seq_lens_cpu=lens.tolist(),
    )  # fmt: skip
    pool = Pool()
    runtime.run_plan(StepPlan(False, requests), prefill, pool.ops())
    for layer in range(cache.num_layers):
        runtime.after_extend(prefill_q, cache.layer(layer), prefill)
    runtime.prepare_decode(cache.batch)
    for layer in range(cache.num_layers):
        cache.decode(runtime.decode_fns[layer], layer)
    first = requests[0]
    runtime.prune([first], [first.seq_len], pool.ops())
    row = first.row
    counts = runtime.count[:, row].tolist()
    kept = [runtime.positions[lst, row, :n].tolist() for lst, n in enumerate(counts)]
    keys = []  # with per-layer memory, what each list's entries read: its head of their rows
    for lst, n in enumerate(counts if runtime.layer_rows is not None else []):
        rows = runtime.layer_rows[lst, row, :n].long()
        head = slice(None) if runtime.lists_per_layer == 1 else lst % runtime.lists_per_layer
        keys.append(runtime.pooled.keys[rows][:, head])
    return kept, sorted(pool.freed), runtime.scores[:, row].clone(), keys


@pytest.mark.parametrize("sparse_ratio", [None, 1.5])
def test_tensor_parallel_ranks_free_what_one_rank_with_every_head_frees(sparse_ratio):
    whole = Cache(num_layers=2, seq_lens=(200, 12))
    views = [whole.rank_view(rank, num_ranks=2) for rank in range(2)]  # before the round's holes
    tokens = 199 + 11
    gen = torch.Generator().manual_seed(2)
    prefill_q = torch.randn(tokens, whole.Q_HEADS * whole.DIM, generator=gen)
    expected_kept, expected_freed, whole_scores, _ = prefill_then_round(
        whole, prefill_q, sparse_ratio=sparse_ratio
    )
    assert expected_freed

    def on_rank(rank, group):
        heads = prefill_q.view(tokens, whole.Q_HEADS, whole.DIM).chunk(2, dim=1)[rank]
        q = heads.reshape(tokens, -1)
        return prefill_then_round(views[rank], q, group, sparse_ratio=sparse_ratio)

    results = ThreadRanks(2).run(on_rank)
    for kept, freed, _, _ in results:
        assert kept == expected_kept and freed == expected_freed
    # each rank holds its own heads' share of the scores; the shares add up to all heads'
    assert not torch.allclose(results[0][2], results[1][2])
    torch.testing.assert_close(results[0][2] + results[1][2], whole_scores)


class FourKVHeads(Cache):
    Q_HEADS, KV_HEADS = 8, 4


@pytest.mark.parametrize("kv_heads", [2, 4])  # one or two heads on each of the two ranks
@pytest.mark.parametrize("params", [{}, {"sparse_ratio": 1.5}, {"shared_ratio": 0.0}])
def test_tensor_parallel_ranks_with_lists_per_kv_head_keep_what_one_rank_keeps(kv_heads, params):
    whole = (Cache if kv_heads == 2 else FourKVHeads)(num_layers=2, seq_lens=(200, 12))
    views = [whole.rank_view(rank, num_ranks=2) for rank in range(2)]
    tokens = 199 + 11
    gen = torch.Generator().manual_seed(3)
    prefill_q = torch.randn(tokens, whole.Q_HEADS * whole.DIM, generator=gen)
    params = {"per_layer": True, "per_kv_head": True, "max_kv_ratio": 0.3, **params}
    expected = prefill_then_round(whole, prefill_q, **params)
    expected_kept, expected_freed, whole_scores, whole_keys = expected
    assert expected_freed

    def on_rank(rank, group):
        heads = prefill_q.view(tokens, whole.Q_HEADS, whole.DIM).chunk(2, dim=1)[rank]
        return prefill_then_round(views[rank], heads.reshape(tokens, -1), group, **params)

    results = ThreadRanks(2).run(on_rank)
    local = kv_heads // 2
    for rank, (kept, freed, scores, keys) in enumerate(results):
        assert freed == expected_freed  # the same slots go back on every rank
        for lst, positions in enumerate(kept):  # a rank's lists: its heads' lists, whole
            layer, head = divmod(lst, local)
            whole_list = layer * kv_heads + rank * local + head
            assert positions == expected_kept[whole_list]
            expected_keys = whole_keys[whole_list]
            torch.testing.assert_close(keys[lst].view_as(expected_keys), expected_keys)
            # its own heads' scores: nothing summed over the ranks
            torch.testing.assert_close(scores[lst], whole_scores[whole_list])


def test_ranks_that_would_keep_different_tokens_stop_loudly():
    def keep(rank, group):
        group.agree(torch.tensor([1, rank]), "the tokens r0 keeps")

    with pytest.raises(RuntimeError, match="ranks disagree on the tokens r0 keeps"):
        ThreadRanks(2).run(keep)
    RankGroup(0, 1, lambda x: x[None]).agree(torch.tensor([1, 0]), "one rank")  # agrees with itself
