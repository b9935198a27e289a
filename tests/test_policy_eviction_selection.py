"""``EVICTION+SELECTION`` (``lethe+tidal``, ``lethe+delta``, ``snapkv+tidal``) on small CPU
tensors: the selection reads only what the eviction keeps, and every layer keeps the eviction's
scores from what it attended (the engine runs are in test_engine_composition)."""

from types import SimpleNamespace

import pytest
import torch
from policy_cases import Cache
from test_lethe_runtime import Pool
from sglang_ext.policies import build_policy
from sglang_ext.policies.lethe.runtime import LetheRuntime, _Extending
from sglang_ext.policies.runtime import StepRequest

EVICTION = {"max_kv_ratio": 0.3, "evict_threshold": 8, "decay": 0.95}
ONE_SET = {**EVICTION, "per_layer": False}  # Lethe alone as a selection composed over it reads
SCORER = {"compression_ratio": 0.7, "compression_interval": 8}
LAYERS = {"full_layers": [0], "selection_layers": [1]}  # then two sparse layers


def _request(cache, runtime, index) -> StepRequest:
    state = runtime.new_request(runtime.policy, None)
    return StepRequest(
        state=state, rid=f"r{index}", row=int(cache.batch.req_pool_indices[index]),
        seq_len=int(cache.batch.seq_lens[index]), prompt_len=8, output_ids=[], protected_len=0,
        index=index,
    )  # fmt: skip


def _after_a_round(runtime, cache):
    """Both requests prefilled, the first pruned by a round on the same scores."""
    batch = cache.batch
    runtime.reset_rows(batch.req_pool_indices, batch.seq_lens - 1)
    request = _request(cache, runtime, 0)
    length = request.seq_len - 1
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(runtime.ctx.num_layers, length, generator=gen) ** 8
    runtime.scores[:, request.row, :length] = scores
    runtime.prune([request], [length], Pool().ops())
    return request


def _decode_all(runtime, cache):
    runtime.prepare_decode(cache.batch)
    layer = cache.layer
    return [
        fn(cache.q, cache.new_k, cache.new_v, layer(i), cache.batch, True)
        for i, fn in enumerate(runtime.decode_fns)
    ]


@pytest.mark.parametrize(
    "eviction, params", [("lethe", EVICTION), ("snapkv", SCORER), ("h2o", SCORER)]
)
@pytest.mark.parametrize("selection", ["tidal", "delta"])
def test_a_selection_that_covers_the_retained_set_decodes_as_the_eviction_alone(
    selection, eviction, params
):
    budget = {"tidal": {"budget_tokens": 512}, "delta": {"budget_pages": 32}}[selection]
    layers = {"tidal": LAYERS, "delta": {"full_layers": [0], "delta_layers": [1]}}[selection]
    alone_cache, composed_cache = Cache(seq_lens=(300, 40, 17)), Cache(seq_lens=(300, 40, 17))
    one_set = build_policy(eviction, {**params, "per_layer": False})
    alone = LetheRuntime(one_set, alone_cache.context())
    composed_policy = build_policy(
        f"{eviction}+{selection}", {**params, selection: {**budget, **layers}}
    )
    assert composed_policy.eviction == one_set
    composed = composed_policy.runtime(composed_cache.context())
    _after_a_round(alone, alone_cache)
    request = _after_a_round(composed, composed_cache)
    assert request.state.evicted > 0  # the selection reads a set with holes
    assert torch.equal(alone_cache.req_to_token, composed_cache.req_to_token)

    for layer, (ours, theirs) in enumerate(
        zip(_decode_all(composed, composed_cache), _decode_all(alone, alone_cache), strict=True)
    ):
        torch.testing.assert_close(ours, theirs, msg=f"layer {layer}")
    # the sparse layers read every retained entry too: every layer's scores are the eviction's
    torch.testing.assert_close(composed.scores, alone.scores)


def test_sparse_layers_read_only_the_selection_from_the_retained_set():
    cache = Cache(seq_lens=(300, 40, 17))
    policy = build_policy("lethe+tidal", {**EVICTION, "tidal": {"budget_tokens": 16, **LAYERS}})
    runtime = policy.runtime(cache.context())
    _after_a_round(runtime, cache)
    outputs = _decode_all(runtime, cache)
    decoder_selected = runtime.decode_fns[2].args[0].selected  # the sparse layers' decoder
    count = runtime._entry_count
    table = runtime._slot_table
    for b in range(3):
        n = int(count[b])
        chosen = decoder_selected[b, : min(16, n)].long()
        assert int(chosen.max()) < n  # entries of the retained list, not positions
        slots = table[b, chosen]
        assert not set(slots.tolist()) - set(table[b, :n].tolist())
    # a sparse layer's scores: every entry decayed, the selected ones given what they received
    before = runtime.scores.clone()
    _decode_all(runtime, cache)
    decay, heads = EVICTION["decay"], Cache.Q_HEADS
    for b in range(3):
        row, n = int(cache.batch.req_pool_indices[b]), int(count[b])
        chosen = set(decoder_selected[b, : min(16, n)].tolist())
        for layer in (2, 3):
            now, then = runtime.scores[layer, row, :n], before[layer, row, :n]
            assert now.sum().item() == pytest.approx(heads + decay * then.sum().item(), rel=1e-4)
            left_out = [j for j in range(n) if j not in chosen]
            torch.testing.assert_close(now[left_out], decay * then[left_out])
    held = runtime.report(_request(cache, runtime, 0), extend=False)
    assert held.attended < held.held  # the sparse layers read 16 of what it holds
    assert all(torch.isfinite(out).all() for out in outputs)


def test_a_step_reserves_score_rows_for_what_its_requests_hold():
    cache = Cache(seq_lens=(300, 40, 17))
    policy = build_policy("lethe+tidal", {**EVICTION, "tidal": LAYERS})
    runtime = policy.runtime(cache.context())
    request = _after_a_round(runtime, cache)
    others = [_request(cache, runtime, i) for i in (1, 2)]
    plan = runtime.plan_step([request, *others], decode=True)
    assert plan.batch_tokens == 300 - request.state.evicted + 40 + 17  # not 357 positions


def test_prefill_seeds_every_layer():
    cache = Cache(num_layers=4, seq_lens=(40,))
    policy = build_policy("lethe+tidal", {**EVICTION, "tidal": LAYERS})
    runtime = policy.runtime(cache.context())
    row, n = int(cache.batch.req_pool_indices[0]), 40
    runtime.reset_rows(cache.batch.req_pool_indices, cache.batch.seq_lens)
    runtime._extending = _Extending([row], [n], [0])  # what run_plan keeps of a prefill plan
    prefill = SimpleNamespace(extend_seq_lens_cpu=[n])
    q = torch.randn(n, Cache.Q_HEADS * Cache.DIM)
    for layer in range(4):
        runtime.after_extend(q, cache.layer(layer), prefill)
    assert runtime.scores[:, row, :n].all()


def test_a_composition_reports_as_one_policy_and_admits_as_its_eviction():
    tidal = {"budget_tokens": 64, **LAYERS}
    policy = build_policy("lethe+tidal", {"max_kv_ratio": 0.2, "tidal": tidal})
    assert policy.name == "lethe+tidal" and policy.evicts()
    assert set(policy.request_choices()) == {"lethe+tidal", "full"}
    described = policy.describe()
    assert described["tidal"]["budget_tokens"] == 64 and described["max_kv_ratio"] == 0.2
    params = {k: v for k, v in described.items() if k != "name"}
    assert build_policy(described["name"], params) == policy  # how the engine rebuilds it
    alone = build_policy("lethe", {"max_kv_ratio": 0.2, "per_layer": False})
    assert policy.request_state_bytes(30, 9, 3, 4096) == alone.request_state_bytes(30, 9, 3, 4096)
    assert policy.attended_tokens(8192, 30) < alone.attended_tokens(8192, 30)
