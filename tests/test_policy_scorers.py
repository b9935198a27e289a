"""SnapKV, TOVA and H2O on Lethe's eviction runtime, on small CPU tensors: their parameters, what a
round keeps under each rule, the freed slots and the packed per-layer lists, how the decode-time
scores decay or reset, and the round cadence (the engine run is in test_engine_mix)."""

from types import SimpleNamespace

import pytest
import torch
from policy_cases import DEVICES, Cache, ThreadRanks
from sglang_ext.kernels import rasr
from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.policies.lethe.runtime import LetheRuntime
from sglang_ext.policies.runtime import EngineOps, StepPlan, StepRequest
from sglang_ext.request_policy import request_policy

SCORERS = ("snapkv", "tova", "h2o")
HOLE = 0


@pytest.mark.parametrize(
    "name,field,value",
    [(name, "compression_ratio", value) for name in SCORERS for value in (1.0, -0.1)]
    + [(name, "compression_interval", 0) for name in SCORERS]
    + [("snapkv", "window_size", 0), ("snapkv", "kernel_size", 4), ("snapkv", "kernel_size", 0),
       ("h2o", "observation_window", -1), ("tova", "window_size", 8)],
)  # fmt: skip
def test_out_of_range_parameters_name_the_field(name, field, value):
    with pytest.raises(PolicyConfigError) as error:
        build_policy(name, {field: value})
    assert error.value.field == f"{name}.{field}"


def test_a_request_may_set_the_ratio_and_interval_not_the_window():
    served = build_policy("lethe,snapkv,tova,h2o")
    own = request_policy(served, {"kv_policy": {"name": "tova", "compression_ratio": 0.75}})
    assert own.name == "tova" and own.round_cap(100) == 25
    for name in ("snapkv", "lethe"):  # the window shapes every request's device-side scores
        with pytest.raises(PolicyConfigError) as error:
            request_policy(served, {"kv_policy": {"name": name, "window_size": 8}})
        assert error.value.field == "kv_policy.window_size"
    with pytest.raises(PolicyConfigError) as error:
        request_policy(served, {"kv_policy": {"name": "h2o", "compression_interval": 0}})
    assert error.value.field == "kv_policy.compression_interval"


class Pool:
    def __init__(self):
        self.freed: list[int] = []

    def ops(self) -> EngineOps:
        return EngineOps(
            free_slots=lambda slots: self.freed.extend(slots.tolist()),
            available_slots=lambda: len(self.freed),
            rerun_extend=None,
        )


def scorer_runtime(cache, name, prefilled, ranks=None, **params):
    runtime = LetheRuntime(build_policy(name, params), cache.context(ranks=ranks))
    prefilled = torch.as_tensor(prefilled, device=cache.device)
    runtime.reset_rows(cache.batch.req_pool_indices, prefilled)
    return runtime


def step_request(runtime, row, seq_len, state=None):
    state = state or runtime.new_request(runtime.policy, None)
    return StepRequest(state, f"r{row}", row, seq_len, prompt_len=seq_len, output_ids=[],
                       protected_len=0)  # fmt: skip


def ranked_by(name, scores, window=16, kernel=5):
    """What the rule ranks one layer's ``scores`` [n] (every position listed) by."""
    if name != "snapkv":
        return scores
    before = torch.where(torch.arange(scores.numel()) < scores.numel() - window, scores, 0.0)
    return torch.nn.functional.avg_pool1d(before[None, None], kernel, 1, kernel // 2)[0, 0]


def expected_keep(name, scores, cap, window=16):
    """What the rule keeps of one layer's ``scores`` [n] (every position listed) under ``cap``."""
    n = scores.numel()
    if name == "snapkv":
        recent = min(window, cap)
    else:  # tova: the last token; h2o: a recent half
        recent = min(1, cap) if name == "tova" else cap // 2
    ranked = ranked_by(name, scores, window)
    keep = set(range(n - recent, n))
    others = [int(i) for i in torch.argsort(ranked, descending=True) if int(i) < n - recent]
    return keep | set(others[: cap - recent])


@pytest.mark.parametrize("name", SCORERS)
def test_a_round_keeps_what_the_rule_says_per_layer_and_frees_the_rest(name):
    cache = Cache(num_layers=3, seq_lens=(200, 12))
    params = {"compression_ratio": 0.7, **({"window_size": 16} if name == "snapkv" else {})}
    runtime = scorer_runtime(cache, name, cache.batch.seq_lens - 1, **params)
    row, length = int(cache.batch.req_pool_indices[0]), 199
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(3, length, generator=gen) ** 4  # distinct, a different order per layer
    runtime.scores[:, row, :length] = scores
    slots = cache.req_to_token[row, :length].clone()
    keys = [k.clone() for k in cache.keys]
    request, pool = step_request(runtime, row, length + 1), Pool()

    runtime.prune([request], [length], pool.ops())

    cap = int(length * (1 - 0.7))  # kvpress's count: rounded down
    for layer in range(3):
        n = int(runtime.count[layer, row])
        kept = runtime.positions[layer, row, :n].long()
        assert set(kept.tolist()) == expected_keep(name, scores[layer], cap), layer
        assert n == cap and len(set(kept.tolist())) == n  # the cap, no repeats
        if name == "snapkv":  # kvpress's order after its top-k: the window, then the best first
            window = list(range(length - 16, length))
            ranked = ranked_by(name, scores[layer])
            rest = sorted(set(kept.tolist()) - set(window), key=lambda p: -float(ranked[p]))
            assert kept.tolist() == window + rest
        else:  # by ascending position, as they were
            assert torch.all(kept[1:] > kept[:-1])
        # every kept entry still reads its own layer's K of its position, wherever it was packed
        pooled = runtime.pooled.keys[runtime.layer_rows[layer, row, :n].long()]
        torch.testing.assert_close(pooled, keys[layer][slots[kept].long()])
    # the request holds its layers' entries packed: one slot per layer-wide row of entries
    held = cache.req_to_token[row, :length]
    assert int((held != HOLE).sum()) == cap and len(pool.freed) == length - cap
    assert sorted(pool.freed) == sorted(slots[held == HOLE].tolist())
    assert request.state.evicted == len(pool.freed) and request.state.rounds == 1
    assert cache.req_to_token[2, :12].ne(HOLE).all()  # the other request is untouched
    if name == "snapkv":  # its next round sees only the queries after this one
        assert runtime.scores[:, row].eq(0).all()
    else:
        assert runtime.scores[:, row, :cap].gt(0).all()


@pytest.mark.parametrize("name,window", [("snapkv", 16), ("tova", 1), ("h2o", 64)])
def test_a_prefill_seeds_the_scores_from_its_last_queries(name, window):
    cache = Cache(num_layers=2, seq_lens=(90,))
    runtime = scorer_runtime(cache, name, torch.tensor([90]), **(
        {"window_size": window} if name == "snapkv" else {}
    ))  # fmt: skip
    prefill = SimpleNamespace(
        req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([90]), extend_seq_lens_cpu=[90]
    )
    runtime.run_plan(StepPlan(False, [step_request(runtime, 1, 90)]), prefill, Pool().ops())
    q = torch.randn(90, cache.Q_HEADS * cache.DIM, generator=torch.Generator().manual_seed(4))
    for layer in range(2):
        runtime.after_extend(q, cache.layer(layer), prefill)
        keys = cache.keys[layer][cache.req_to_token[1, :90].long()]
        queries = q[-window:].view(window, cache.Q_HEADS, cache.DIM)
        expected = rasr.window_scores(queries, keys, 90, 0.125)  # summed; snapkv pools in rounds
        torch.testing.assert_close(runtime.scores[layer, 1, :90], expected)


def seeded_round(cache, q, ranks, name="snapkv", length=119):
    """A prefill of the cache's one request (its scores seeded), then a round over all it holds:
    what each layer keeps and the slots freed."""
    runtime = scorer_runtime(cache, name, torch.tensor([length]), ranks, compression_ratio=0.6)
    prefill = SimpleNamespace(
        req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([length]),
        extend_seq_lens_cpu=[length],
    )  # fmt: skip
    request, pool = step_request(runtime, 1, length + 1), Pool()
    runtime.run_plan(StepPlan(False, [request]), prefill, pool.ops())
    for layer in range(cache.num_layers):
        runtime.after_extend(q, cache.layer(layer), prefill)
    runtime.prune([request], [length], pool.ops())
    counts = runtime.count[:, 1].tolist()
    return [runtime.positions[layer, 1, :n].tolist() for layer, n in enumerate(counts)], sorted(
        pool.freed
    )


@pytest.mark.parametrize("name", SCORERS)
def test_tensor_parallel_ranks_keep_and_free_what_one_rank_with_every_head_does(name):
    whole = Cache(num_layers=2, seq_lens=(120,))
    views = [whole.rank_view(rank, num_ranks=2) for rank in range(2)]  # before the round's holes
    q = torch.randn(119, whole.Q_HEADS, whole.DIM, generator=torch.Generator().manual_seed(5))
    expected = seeded_round(whole, q.flatten(1), None, name)
    assert expected[1]

    def on_rank(rank, group):
        heads = q.chunk(2, dim=1)[rank].flatten(1)
        return seeded_round(views[rank], heads, group, name)

    assert ThreadRanks(2).run(on_rank) == [expected, expected]


def decode_step(cache, runtime, seq_len):
    """One decode step of the cache's first request at ``seq_len`` tokens: the token joins every
    layer's list, every layer attends and scores. The scores' change, [layers, positions]."""
    row = cache.batch.req_pool_indices[:1]
    cache.batch = SimpleNamespace(
        req_pool_indices=row, seq_lens=torch.tensor([seq_len], device=cache.device),
        out_cache_loc=cache.req_to_token[row, seq_len - 1].long(),
    )  # fmt: skip
    cache.q, cache.new_k, cache.new_v = cache.q[:1], cache.new_k[:1], cache.new_v[:1]
    runtime.prepare_decode(cache.batch)
    before = runtime.scores[:, int(row)].clone()
    for layer in range(cache.num_layers):
        cache.decode(runtime.decode_fns[layer], layer)
    return runtime.scores[:, int(row)] - before


@pytest.mark.parametrize("device", DEVICES)
def test_tova_scores_the_last_query_only_and_h2o_accumulates(device):
    caches = {name: Cache(num_layers=2, seq_lens=(60,), device=device) for name in ("tova", "h2o")}
    runtimes = {n: scorer_runtime(c, n, torch.tensor([50])) for n, c in caches.items()}
    first = {n: decode_step(caches[n], runtimes[n], 51) for n in runtimes}
    torch.testing.assert_close(first["tova"], first["h2o"])  # both the step's attention
    assert first["tova"][:, :51].sum(1).gt(0).all()
    tova_first = runtimes["tova"].scores[:, 1].clone()
    for name in runtimes:
        decode_step(caches[name], runtimes[name], 52)
    h2o, tova = runtimes["h2o"].scores[:, 1], runtimes["tova"].scores[:, 1]
    torch.testing.assert_close(h2o - tova, tova_first)  # h2o: both steps; tova: the last one


INTERVAL, WINDOW, PROMPT = 8, 3, 40
OBSERVING = {
    "snapkv": {"compression_interval": INTERVAL, "window_size": WINDOW, "compression_ratio": 0.5},
    # Lethe with a window: its first round at the first decode step, as a press's
    "lethe": {"evict_threshold": PROMPT - 1, "round_interval": INTERVAL, "window_size": WINDOW,
              "decay": 1.0, "max_kv_ratio": 0.5},
}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OBSERVING)
def test_rounds_come_at_the_first_decode_step_then_every_interval_and_observe_their_window(
    device, name
):
    cache = Cache(num_layers=2, seq_lens=(120,), device=device)
    interval, window, prompt = INTERVAL, WINDOW, PROMPT
    runtime = scorer_runtime(cache, name, torch.tensor([prompt]), **OBSERVING[name])
    row, pool, state = 1, Pool(), None
    rounds_at, attention = [], []  # each step's change of the scores, since the last round
    for seq_len in range(prompt + 1, prompt + 1 + 4 * interval):
        request = step_request(runtime, row, seq_len, state)
        state = request.state
        plan = runtime.plan_step([request], decode=True)
        scores = runtime.scores[:, row].clone()
        runtime.run_plan(plan, None, pool.ops())
        if plan.rounds:
            rounds_at.append(seq_len)
            if len(rounds_at) > 1:  # what the round ranked: its window's queries only
                torch.testing.assert_close(scores, sum(attention[-window:]))
                assert len(attention) == interval
            attention = []
        attention.append(decode_step(cache, runtime, seq_len))
    assert rounds_at == [prompt + 1 + k * interval for k in range(4)]
    assert state.rounds == 4 and state.evicted == 64 - int(64 * 0.5)  # the last at 64 tokens


def test_expected_kv_and_attended_tokens_follow_the_cap_and_the_interval():
    policy = build_policy("h2o", {"compression_ratio": 0.75, "compression_interval": 64})
    assert policy.round_cap(1000) == 250 and policy.expected_kv(10_000) == 2500 + 64
    assert policy.expected_kv(80) == 80 and policy.attended_tokens(1000, 30) == 250.0
    assert policy.budget() == "compression_ratio 0.75, compression_interval 64"
    # kvpress's count, rounded down: 307 of 1,024 tokens at 0.7 (1 - 0.7 is 0.30000000000000004)
    assert build_policy("snapkv", {"compression_ratio": 0.7}).round_cap(1024) == 307


@pytest.mark.parametrize("name,recent", [("snapkv", 16), ("h2o", 12)])
def test_the_recent_window_is_the_latest_positions_in_any_list_order(name, recent):
    """A list after a rank-ordered round is not by position: the cap still keeps the latest."""
    policy = build_policy(name, {"compression_ratio": 0.75, "window_size": 16}
                          if name == "snapkv" else {"compression_ratio": 0.75})  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    positions = torch.randperm(100, generator=gen)[None]
    scores = torch.rand(1, 100, generator=gen)
    keep = torch.ones(1, 100, dtype=torch.bool)

    stays = policy.cap_layers(positions, scores, keep, [100])

    cap = policy.round_cap(100)
    latest = positions >= 100 - recent
    assert int(stays.sum()) == cap and bool(stays[latest].all())
    others = torch.where(latest, float("-inf"), scores)
    best = torch.topk(others, cap - recent).indices
    assert bool(stays[0, best[0]].all())


@pytest.mark.parametrize("name,params", [("snapkv", {}), ("lethe", {"window_size": 2})])
def test_one_retained_set_keeps_its_lists_by_position(name, params):
    """Every layer of one set reads the same list (one slot table): a window's rank order is for
    per-layer lists only."""
    policy = build_policy(name, {"per_layer": False, **params})
    stays = torch.tensor([[[True, False, True, True], [True, False, True, True]]])
    ranked = torch.tensor([[[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 0.1, 0.4]]])
    order = policy.list_order(stays, ranked, [[4, 4]])
    assert order[0, :, :3].tolist() == [[0, 2, 3], [0, 2, 3]]
