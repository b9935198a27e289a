"""Lethe's parameters and its pruning round (Algorithm 1) on plain tensors."""

import math

import pytest
import torch
from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.policies.lethe import Lethe


@pytest.mark.parametrize(
    "field,value",
    [("evict_threshold", 0), ("sparse_ratio", 1.0), ("sparse_ratio", float("inf")),
     ("recent_ratio", 1.0), ("recent_ratio", -0.1), ("sink_tokens", -1), ("segments", 1),
     ("decay", 0.0), ("decay", 1.5), ("round_interval", -1), ("shared_ratio", 1.5),
     ("window_size", 0), ("window_pool", 4)],
)  # fmt: skip
def test_out_of_range_parameters_name_the_field(field, value):
    with pytest.raises(PolicyConfigError) as error:
        build_policy("lethe", {field: value})
    assert error.value.field == f"lethe.{field}"


def test_defaults_are_per_layer_lists_with_a_core_and_one_set_under_a_selection():
    policy = build_policy("lethe")
    assert policy.per_layer_lists() and policy.sparse_ratio is None  # no breakpoints
    assert (policy.recent(), policy.decay, policy.interval(), policy.core()) == (0.5, 0.99, 64, 0.5)
    one = policy.one_set()  # what a selection composed over it reads
    assert not one.per_layer_lists() and (one.recent(), one.interval(), one.core()) == (0.3, None, 0)
    # a parameter set holds in either layout; round_interval 0 asks for the threshold cadence
    assert build_policy("lethe", {"recent_ratio": 0.2}).one_set().recent() == 0.2
    assert build_policy("lethe", {"round_interval": 0}).interval() is None
    heads = build_policy("lethe", {"per_kv_head": True})  # lists per KV head: less recent
    assert (heads.recent(), heads.interval(), heads.core()) == (0.1, 64, 0.5)
    assert build_policy("lethe", {"per_layer": False, "round_interval": 32}).interval() == 32
    with pytest.raises(PolicyConfigError, match="per_layer"):
        build_policy("lethe", {"per_layer": False, "sparse_ratio": 400})
    with pytest.raises(PolicyConfigError, match="per_layer"):
        build_policy("lethe", {"shared_ratio": 0.25}).one_set()  # a core needs per-layer lists


def test_without_a_sparse_ratio_no_layer_finds_a_breakpoint_and_only_the_cap_evicts():
    policy = Lethe(sink_tokens=2, max_kv_ratio=0.3)
    counts = [100, 60]
    positions = torch.arange(100, dtype=torch.int32).repeat(2, 1)
    scores = torch.rand(2, 100, generator=torch.Generator().manual_seed(0)) ** 12  # peaked
    keep, found, _ = policy.shrink_layers(positions, scores, counts)
    assert not found.any() and keep[0].all() and keep[1, :60].all() and not keep[1, 60:].any()
    assert policy.shrink_layer(positions[0], scores[0]).salient_plus_recent is None
    (union,) = policy.cap_union_layers(positions[None], scores[None], keep[None], [100])
    assert int(union.sum()) == policy.round_cap(100) and union[:2].all() and union[-1]
    with_rule = Lethe(sparse_ratio=400.0, sink_tokens=2, max_kv_ratio=0.3)
    assert with_rule.shrink_layers(positions, scores, counts)[1].all()  # the paper's rule cuts


def test_sparse_scores_keep_salient_sink_and_recent_tokens():
    policy = Lethe(sparse_ratio=400.0, recent_ratio=0.1, sink_tokens=2, segments=10)
    n = 100
    positions = torch.arange(n, dtype=torch.int32)
    scores = torch.full((n,), 1e-6)
    salient = [10, 40, 41, 77]
    scores[salient] = torch.tensor([1.0, 0.8, 0.5, 0.9])
    shrink = policy.shrink_layer(positions, scores)
    kept = positions[shrink.keep].tolist()
    # the first cut (10 tokens) is where scores dropped by more than 400x: the top 10 stay, which
    # are the 4 salient tokens and 6 of the flat rest in stable order (the lowest positions)
    recent = list(range(90, 100))
    assert set(salient) <= set(kept) and set(recent) <= set(kept) and {0, 1} <= set(kept)
    assert kept == sorted({*range(6), *salient, *recent})
    assert shrink.salient_plus_recent == 10 + 10


def test_flat_scores_have_no_breakpoint_and_keep_everything():
    policy = Lethe(sparse_ratio=400.0)
    positions = torch.arange(50, dtype=torch.int32)
    shrink = policy.shrink_layer(positions, torch.rand(50) + 1.0)
    assert bool(shrink.keep.all()) and shrink.salient_plus_recent is None


def test_threshold_follows_algorithm_1_and_never_refires_at_once():
    policy = Lethe(evict_threshold=100, recent_ratio=0.3, max_kv_ratio=1.0, round_interval=0)
    paper = Lethe(sparse_ratio=400.0)
    found = paper.shrink_layer(torch.arange(4), torch.tensor([1.0, 1e-5, 1e-5, 1e-5]))
    none = paper.shrink_layer(torch.arange(4), torch.ones(4))
    assert policy.next_threshold(100, [none.salient_plus_recent, none.salient_plus_recent], retained=20, length=101) == 200  # doubled
    assert policy.next_threshold(100, [found.salient_plus_recent, none.salient_plus_recent], retained=20, length=101) == 100  # max(L, bp + r)
    # what the round left (150) plus its recent window (45)
    assert policy.next_threshold(100, [found.salient_plus_recent], retained=150, length=300) == 195


def test_threshold_under_a_kv_budget_stops_doubling_where_expected_kv_is():
    policy = Lethe(evict_threshold=1024, recent_ratio=0.3, max_kv_ratio=0.3, round_interval=0)
    none = Lethe().shrink_layer(torch.arange(4), torch.ones(4))  # flat: no breakpoint
    # Algorithm 1 alone doubles 1024 to 2048, then 4096 to 8192
    assert policy.next_threshold(1024, [none.salient_plus_recent], retained=308, length=1025) == 1024
    budget = math.ceil(policy.round_cap(8192) * 1.3)
    assert policy.next_threshold(4096, [none.salient_plus_recent], retained=2458, length=8192) == budget
    assert budget == policy.expected_kv(8192) < 4096


def test_a_round_interval_sets_the_cadence_and_expected_kv_grows_by_it():
    policy = Lethe(evict_threshold=1024, max_kv_ratio=0.3, round_interval=64)
    none = Lethe().shrink_layer(torch.arange(4), torch.ones(4)).salient_plus_recent
    # due 64 decoded tokens after the round, whatever Algorithm 1 or the budget would say
    assert policy.next_threshold(1024, [none], retained=308, length=1025) == 308 + 63
    assert policy.next_threshold(4096, [none], retained=2458, length=8192) == 2458 + 63
    assert policy.expected_kv(8192) == policy.round_cap(8192) + 64
    assert policy.expected_kv(2048) == 1024  # below the first round's threshold


def test_union_is_capped_by_best_score_with_sink_and_recent_kept():
    policy = Lethe(max_kv_ratio=0.3, recent_ratio=0.3, sink_tokens=2)
    length = 40
    everything = torch.arange(length)
    flat = torch.ones(length)  # a layer that kept everything
    peaked = torch.full((length,), 1e-3)
    peaked[[7, 19]] = 1.0
    keep = policy.cap_union([everything, everything], [flat, peaked], length)
    cap = 12  # 0.3 x 40
    recent = list(range(40 - 4, 40))  # 0.3 x 12, rounded up
    kept = everything[keep].tolist()
    assert len(kept) == cap and {0, 1, 7, 19, *recent} <= set(kept)


def test_union_under_the_cap_is_left_alone():
    policy = Lethe(max_kv_ratio=1.0)
    keep = policy.cap_union([torch.tensor([0, 5]), torch.tensor([5, 9])], [torch.ones(2)] * 2, 10)
    assert torch.nonzero(keep).flatten().tolist() == [0, 5, 9]


@pytest.mark.parametrize("seed", range(6))
def test_a_round_over_all_layers_at_once_equals_layer_by_layer(seed):
    """shrink_layers and cap_union_layers (one device pass, the engine's) against shrink_layer and
    cap_union (per layer, the reference): peaked, flat, short and empty layers of one request."""
    gen = torch.Generator().manual_seed(seed)
    policy = Lethe(sparse_ratio=50.0, recent_ratio=0.2, sink_tokens=3, segments=8, max_kv_ratio=0.3)
    length, width = 300, 300
    counts = [300, 300, 120, 7, 0, 250]
    positions = torch.zeros(len(counts), width, dtype=torch.int32)
    scores = torch.rand(len(counts), width, generator=gen)  # past a count: stale entries
    for layer, n in enumerate(counts):
        kept = torch.sort(torch.randperm(length, generator=gen)[:n]).values
        positions[layer, :n] = kept.int()
    scores[0] = scores[0] ** 12  # peaked: a breakpoint
    scores[1, :300] = 1.0 + 0.01 * scores[1, :300]  # flat: none
    keep, found, salient_plus_recent = policy.shrink_layers(positions, scores, counts)
    kept, kept_scores = [], []
    for layer, n in enumerate(counts):
        one = policy.shrink_layer(positions[layer, :n], scores[layer, :n])
        assert torch.equal(keep[layer, :n], one.keep), layer
        assert not keep[layer, n:].any()
        assert bool(found[layer]) == (one.salient_plus_recent is not None)
        if one.salient_plus_recent is not None:
            assert int(salient_plus_recent[layer]) == one.salient_plus_recent
        kept.append(positions[layer, :n][one.keep])
        kept_scores.append(scores[layer, :n][one.keep])
    assert bool(found[0]) and not bool(found[1])
    expected = policy.cap_union(kept, kept_scores, length)
    batched = policy.cap_union_layers(positions[None], scores[None], keep[None], [length])
    assert torch.equal(batched[0], expected)


def test_the_batched_union_under_the_cap_is_left_alone():
    policy = Lethe(max_kv_ratio=1.0)
    positions = torch.tensor([[0, 5], [5, 9]], dtype=torch.int32)
    keep = torch.ones(2, 2, dtype=torch.bool)
    union = policy.cap_union_layers(positions[None], torch.ones(1, 2, 2), keep[None], [10])
    assert torch.nonzero(union[0]).flatten().tolist() == [0, 5, 9]


def test_each_layer_is_capped_alone_by_its_own_scores_with_sink_and_recent_kept():
    """Per-layer memory: a layer over the cap keeps its sinks, its most recent kept entries and
    then its best; a layer under it is left alone."""
    policy = Lethe(max_kv_ratio=0.3, recent_ratio=0.3, sink_tokens=2)
    length = 40
    positions = torch.arange(length).repeat(3, 1)
    scores = torch.full((3, length), 1e-3)
    scores[0, [7, 19, 25]] = 1.0
    scores[1, [8, 9]] = 1.0
    keep = torch.ones(3, length, dtype=torch.bool)
    keep[1, 30:] = False  # its last kept entry is position 29
    keep[2, 5:] = False  # 5 entries: under the cap
    capped = policy.cap_layers(positions, scores, keep, [length] * 3)
    cap, recent = 12, 4  # 0.3 x 40; 0.3 x 12 rounded up
    first, second = positions[0][capped[0]].tolist(), positions[1][capped[1]].tolist()
    assert len(first) == len(second) == cap
    assert {0, 1, 7, 19, 25, *range(length - recent, length)} <= set(first)
    assert {0, 1, 8, 9, *range(30 - recent, 30)} <= set(second) and max(second) == 29
    assert torch.equal(capped[2], keep[2])


def test_a_shared_core_keeps_what_one_layer_ranks_first_in_every_layer_at_the_first_round():
    """Per-layer lists with ``shared_ratio``: at a request's first round a token that only layer 0
    attends to (a needle a retrieval layer reads) stays in layer 1 too, taking room from layer
    1's own choice; without the core, or at a later round, layer 1 drops it."""
    length, layers = 40, 2
    positions = torch.arange(length).repeat(1, layers, 1)
    scores = torch.full((1, layers, length), 1e-3)
    scores[0, 0, 17] = 1.0  # layer 0's needle
    scores[0, 1, 5:30] = 0.5  # layer 1 spreads its attention over many tokens
    keep = torch.ones(1, layers, length, dtype=torch.bool)
    flat = [t.flatten(0, 1) for t in (positions, scores, keep)]
    alone = Lethe(per_layer=True, max_kv_ratio=0.3, sink_tokens=2, shared_ratio=0.0)
    assert alone.shared_entries(positions, scores, keep, [length], [True]) is None
    assert not alone.cap_layers(*flat, [length] * layers)[1, 17]
    with_core = Lethe(per_layer=True, max_kv_ratio=0.3, sink_tokens=2, shared_ratio=0.5)
    shared = with_core.shared_entries(positions, scores, keep, [length], [True])
    assert shared[0, 0, 17] and shared[0, 1, 17]
    capped = with_core.cap_layers(*flat, [length] * layers, shared.flatten(0, 1))
    assert capped[1, 17] and int(capped[1].sum()) == with_core.round_cap(length)
    # only at a request's first round: later ones cut each layer by its own scores
    assert with_core.shared_entries(positions, scores, keep, [length], [False]) is None
    two = [t.expand(2, -1, -1) for t in (positions, scores, keep)]
    later, first = with_core.shared_entries(*two, [length] * 2, [False, True])
    assert not later.any() and torch.equal(first, shared[0])
    with pytest.raises(PolicyConfigError, match="shared_ratio"):
        Lethe(per_layer=False, shared_ratio=0.5)  # one set: every layer keeps the core already


def test_the_prompts_seeds_keep_a_six_digit_value_beside_the_key_the_question_attends():
    """A lookup's question attends to a record's key; the answer is the value's digits after it,
    which the question barely attends. The default's seeds raise each to the key's score, so a
    first round at the cap keeps the whole value (with 9 neighbours its last two digits fell out
    and the answer came out truncated, RESULTS.md#eviction-fidelity)."""
    policy = Lethe(max_kv_ratio=0.3, recent_ratio=0.1, sink_tokens=0)
    length, key = 100, 40
    received = torch.linspace(0.2, 0.1, length)  # attention spread over the filler
    received[key] = 5.0
    scores = policy.seed(received)[None]
    keep = torch.ones(1, length, dtype=torch.bool)
    kept = policy.cap_layers(torch.arange(length)[None], scores, keep, [length])[0]
    assert kept[key : key + 7].all()
    narrow = Lethe(max_kv_ratio=0.3, recent_ratio=0.1, sink_tokens=0, observation_pool=9)
    kept = narrow.cap_layers(torch.arange(length)[None], narrow.seed(received)[None], keep, [length])
    assert not kept[0, key + 5 : key + 7].any()


def test_a_step_attends_to_all_until_the_threshold_then_to_what_a_round_leaves():
    policy = Lethe(evict_threshold=1024, max_kv_ratio=0.3)
    assert policy.attended_tokens(1000, num_layers=28) == 1000
    assert policy.attended_tokens(32768, num_layers=28) == math.ceil(0.3 * 32768)
    assert Lethe(max_kv_ratio=1.0).attended_tokens(32768, num_layers=28) == 32768


def test_an_evicting_servers_request_slots_are_sized_by_memory_not_a_fixed_cap():
    from sglang_ext.engine.memory import FLOOR_SLOTS, STATE_SHARE, state_slots

    # llama-8B-like: 32 layers, 32 query heads, a 10k context, ~110 GiB of KV pool; per-layer
    # lists keep each entry's K/V row beside its position and score, one set a slot table
    per_slot = build_policy("lethe", {"per_layer": True}).request_state_bytes(32, 32, 8, 10240)
    assert per_slot == 10240 * (32 * 12 + 32 * 4)
    one_set = build_policy("lethe", {"per_layer": False}).request_state_bytes(32, 32, 8, 10240)
    assert one_set == 10240 * (32 * 8 + 4 + 32 * 4)
    pool = 110 * 2**30
    slots = state_slots(per_slot, pool, pool, sglang_slots=4096, requested=None)
    assert slots > 1000 and slots * per_slot <= STATE_SHARE * pool
    # SGLang's own count bounds it; a small pool still gets the floor, unless the floor's state
    # would take most of the memory; the user's flag wins
    assert state_slots(per_slot, pool, pool, sglang_slots=200, requested=None) == 200
    assert state_slots(per_slot, 2**30, 2**30, sglang_slots=4096, requested=None) == FLOOR_SLOTS
    assert state_slots(per_slot, 2**27, 2**27, sglang_slots=4096, requested=None) == 11
    assert state_slots(per_slot, pool, pool, sglang_slots=4096, requested=8) == 8
    # a mix pays for each evicting member's runtime; selection keeps no per-slot state
    mix = build_policy("lethe,snapkv,delta")
    assert mix.request_state_bytes(32, 32, 8, 10240) == 2 * per_slot
    assert build_policy("delta").request_state_bytes(32, 32, 8, 10240) == 0
