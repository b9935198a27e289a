"""DELTA's parameters, layer roles and decode functions, on a small synthetic KV cache (CPU)."""

import json

import pytest
import torch
from policy_cases import DEVICES, Cache, ThreadRanks
from sglang_ext.policies import PolicyConfigError, RankGroup, build_policy
from sglang_ext.policies.calibration import CALIBRATION_DIR_ENV, FORMAT, _load_all
from sglang_ext.policies.delta import LayerRole

FULL, SELECT, SPARSE = LayerRole.FULL, LayerRole.SELECT, LayerRole.SPARSE


def test_defaults_are_the_papers_for_a_28_layer_model_and_scale_with_depth():
    policy = build_policy("delta")
    assert policy.describe() == {
        "name": "delta",
        "full_layers": None,
        "delta_layers": None,
        "budget_pages": 64,
        "recent_pages": 8,
        "sink_pages": 0,
    }
    assert policy.for_model(Cache(num_layers=28).context()).describe() == {
        **policy.describe(), "full_layers": [0, 1], "delta_layers": [2, 14, 22]
    }
    assert policy.for_model(Cache(num_layers=32).context()).delta_layers == [2, 16, 25]


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))
    _load_all.cache_clear()
    yield tmp_path
    _load_all.cache_clear()


def test_a_matching_calibration_file_sets_unset_layers(calibration_dir):
    ctx = Cache(num_layers=20).context()
    layers = {"full_layers": [0, 1], "delta_layers": [2, 7, 11]}
    calibration = {"format": FORMAT, "model": ctx.model_fingerprint, "delta": layers}
    (calibration_dir / "tiny.json").write_text(json.dumps(calibration))
    assert build_policy("delta").for_model(ctx).delta_layers == [2, 7, 11]
    assert build_policy("delta", {"delta_layers": [2, 9]}).for_model(ctx).delta_layers == [2, 9]
    other_model = Cache(num_layers=20).context(fingerprint={"architecture": "Other"})
    assert build_policy("delta").for_model(other_model).delta_layers == [2, 10, 16]


@pytest.mark.parametrize(
    "params, field, fragment",
    [
        ({"budget_pages": 0}, "budget_pages", "must be >= 1"),
        ({"recent_pages": -1}, "recent_pages", "must be in [0, budget_pages=64]"),
        ({"budget_pages": 4, "recent_pages": 5}, "recent_pages", "must be in [0, budget_pages=4]"),
        ({"full_layers": [0, -1]}, "full_layers", "must be >= 0"),
        ({"full_layers": [0, 1, 1]}, "full_layers", "lists a layer twice"),
        ({"delta_layers": [2, -3]}, "delta_layers", "must be >= 0"),
        ({"delta_layers": []}, "delta_layers", "at least one"),
        ({"delta_layers": [2, 2]}, "delta_layers", "lists a layer twice"),
        ({"delta_layers": [2, 22, 14]}, "delta_layers", "ascending"),
        ({"full_layers": [0, 1, 14], "delta_layers": [2, 14]}, "full_layers", "[14] are delta_la"),
        ({"full_layers": [0], "delta_layers": [2]}, "full_layers", "[1] come before the first"),
        ({"delta_layers": ["2"]}, "delta_layers", "expected list[int]"),
        ({"sink_pages": -2}, "sink_pages", "must be >= 0"),
    ],
)
def test_bad_parameters_name_the_field(params, field, fragment):
    with pytest.raises(PolicyConfigError) as err:
        build_policy("delta", params)
    assert err.value.field == f"delta.{field}"
    assert fragment in str(err.value)


def test_roles_of_a_30_layer_model():
    roles = build_policy("delta", {"full_layers": [0, 1], "delta_layers": [2, 14, 22]}).layer_roles(30)
    assert roles[:3] == [FULL, FULL, SELECT]
    assert [i for i, role in enumerate(roles) if role is SELECT] == [2, 14, 22]
    assert roles.count(SPARSE) == 25 and roles[29] is SPARSE


def test_full_layers_may_follow_a_delta_layer():
    roles = build_policy("delta", {"full_layers": [0, 1, 5], "delta_layers": [2]}).layer_roles(6)
    assert roles == [FULL, FULL, SELECT, SPARSE, SPARSE, FULL]


@pytest.mark.parametrize(
    "params, field",
    [({"delta_layers": [2, 14, 22]}, "delta_layers"),
     ({"full_layers": [0, 1, 20], "delta_layers": [2]}, "full_layers")],  # fmt: skip
)
def test_layers_beyond_the_models_depth_are_refused_at_bind(params, field):
    policy = build_policy("delta", params)
    with pytest.raises(PolicyConfigError) as err:
        Cache(num_layers=20).decode_fns(policy)
    assert err.value.field == f"delta.{field}"
    assert "beyond the model's 20 layers" in str(err.value)


def delta_decode_fns(cache, **params):
    policy = build_policy("delta", {"full_layers": [0, 1], "delta_layers": [2], **params})
    fns = cache.decode_fns(policy, base_decode="engine decode")
    return fns, fns[2].__self__  # the DeltaDecoder holding the selection


@pytest.mark.parametrize("device", DEVICES)
def test_a_budget_covering_the_context_gives_full_attention(device):
    cache = Cache(device=device)
    fns, decoder = delta_decode_fns(cache, budget_pages=32, recent_pages=8)
    assert fns[:2] == ["engine decode", "engine decode"]
    for layer_id in (2, 3):
        out = cache.decode(fns[layer_id], layer_id)
        # the new token's K/V was written before attending
        slot = cache.batch.out_cache_loc[0]
        assert torch.equal(cache.keys[layer_id][slot], cache.new_k[0])
        torch.testing.assert_close(out, cache.full_attention(layer_id), **cache.tol)
    assert decoder.num_selected[:3].tolist() == [19, 3, 2]  # every page of each request


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_budget_selects_budget_pages_into_fixed_state_rows(device, caplog):
    cache = Cache(device=device)
    fns, decoder = delta_decode_fns(cache, budget_pages=4, recent_pages=1)
    assert decoder.selected.shape == (Cache.MAX_BATCH, 4) and decoder.selected.dtype == torch.int32
    assert decoder.num_selected.shape == (Cache.MAX_BATCH,)

    with caplog.at_level("INFO", logger="sglang_ext.policies.selection"):
        cache.decode(fns[2], 2)
        cache.decode(fns[2], 2)
    assert decoder.num_selected.tolist() == [4, 3, 2, 0, 0, 0]  # rows past the batch untouched
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["sglang_ext: delta layer 2 first selected fewer pages than a request has: "
                      "[4, 3, 2] of [19, 3, 2]"]  # fmt: skip
    long_request = decoder.selected[0].tolist()
    assert long_request == sorted(long_request) and long_request[-1] == 18  # the recent page
    assert decoder.selected[1].tolist() == [0, 1, 2, 0]

    sparse = cache.decode(fns[3], 3)
    full = cache.full_attention(3)
    torch.testing.assert_close(sparse[1:], full[1:], **cache.tol)  # short: all pages
    assert not torch.allclose(sparse[0], full[0], atol=1e-2)  # long: 4 of 19 pages only


@pytest.mark.parametrize("device", DEVICES)
def test_sink_pages_are_kept_ahead_of_the_scored_ones(device):
    cache = Cache(device=device)
    fns, decoder = delta_decode_fns(cache, budget_pages=4, recent_pages=1, sink_pages=2)
    cache.decode(fns[2], 2)
    chosen = decoder.selected[0].tolist()
    # the sinks, one scored page, the recent one
    assert chosen[:2] == [0, 1] and 1 < chosen[2] < 18 and chosen[3] == 18
    assert decoder.selected[1].tolist() == [0, 1, 2, 0]  # a short request keeps all it has


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_decode_replays_in_a_cuda_graph_with_new_inputs():
    cache = Cache(device="cuda")
    fns, decoder = delta_decode_fns(cache, budget_pages=4, recent_pages=1)

    def step():
        return torch.cat([cache.decode(fns[2], 2), cache.decode(fns[3], 3)], dim=1)

    side = torch.cuda.Stream()  # warm up (compile the kernels) off the capturing stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    # the next step: another query, and each request a page longer (cache rows stay valid)
    cache.q.copy_(torch.randn_like(cache.q))
    cache.batch.seq_lens.add_(16)
    cache.batch.seq_lens_cpu.add_(16)
    graph.replay()
    replayed = captured.clone()
    torch.testing.assert_close(replayed, step(), **cache.tol)
    assert decoder.num_selected[:3].tolist() == [4, 4, 3]
    assert decoder.selected[0, -1].item() == 19  # the new last page, kept as recent


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_tensor_parallel_ranks_select_what_one_rank_with_every_head_selects(policy):
    """Two attention-TP ranks, each holding one KV head and its query heads, combine their scores
    (max over ranks) and so select alike, and as one rank with all the heads would."""
    params = {"full_layers": [0, 1], "budget_pages": 4, "recent_pages": 1}
    if policy == "tidal":
        params = {"full_layers": [0, 1], "budget_tokens": 24}
    layers = {"delta_layers" if policy == "delta" else "selection_layers": [2]}
    whole = Cache()
    whole_fns = whole.decode_fns(build_policy(policy, {**params, **layers}))
    whole.decode(whole_fns[2], 2)
    expected = whole_fns[2].__self__.selected[:3].clone()

    ranks = [whole.rank_view(rank, num_ranks=2) for rank in range(2)]
    local_scores, local_selections = [], []
    for rank in ranks:  # alone: each rank's scores and its own choice
        alone = RankGroup(0, 1, lambda x: local_scores.append(x.clone()) or x[None])
        fns = rank.decode_fns(build_policy(policy, {**params, **layers}), ranks=alone)
        rank.decode(fns[2], 2)
        local_selections.append(fns[2].__self__.selected[:3].clone())
    assert any(not torch.equal(selection, expected) for selection in local_selections)

    def select(rank, group):
        policy_of_rank = build_policy(policy, {**params, **layers})
        fns = ranks[rank].decode_fns(policy_of_rank, ranks=group)
        ranks[rank].decode(fns[2], 2)
        return fns[2].__self__.selected[:3]

    assert all(torch.equal(selected, expected) for selected in ThreadRanks(2).run(select))


def test_attended_tokens_average_full_and_sparse_layers():
    policy = build_policy("delta", {"full_layers": [0, 1], "delta_layers": [2, 14, 22], "budget_pages": 4, "recent_pages": 1})
    sparse = policy.layer_roles(30).count(LayerRole.SPARSE)
    assert sparse == 25
    assert policy.attended_tokens(1000, 30) == (1000 * 5 + 64 * sparse) / 30
    assert policy.attended_tokens(50, 30) == 50  # a budget over the context reads it all
    with pytest.raises(ValueError):
        build_policy("delta", {}).attended_tokens(1000, 30)  # layer lists not resolved yet
