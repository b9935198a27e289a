"""ART as a policy: its parameters, its composition over other policies, and the decode functions
it gives them on a synthetic cache (CPU: the torch reference; CUDA: the kernel)."""

import pytest
import torch
from policy_cases import DEVICES, Cache
from sglang_ext.config import active_policy, export_policy
from sglang_ext.kernels.page_select import select_pages
from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.policies.art import Art, ArtOver


@pytest.mark.parametrize(
    "name,params,field",
    [("art", {"tau": 0.0}, "art.tau"), ("art", {"patience": -1}, "art.patience"),
     ("art", {"probe_stride": 0}, "art.probe_stride"), ("delta+art", {"art": {"phi": -1.0}}, "art.phi"),
     ("delta+art", {"art": 5}, "delta+art.art"), ("lethe+art", {}, "policy"),
     ("delta+spin", {}, "policy"), ("delta+art", {"budget_pages": 0}, "delta.budget_pages"),
     ("art", {"tile_tokens": 48}, "art.tile_tokens"),
     # eviction under selection (policies/eviction_selection.py)
     ("lethe+tidal", {"per_layer": True}, "lethe.per_layer"),
     ("lethe+tidal", {"sparse_ratio": 10.0}, "lethe.per_layer"),
     ("lethe+tidal", {"tidal": {"correction_interval": 8}}, "lethe+tidal.tidal.correction_interval"),
     ("lethe+tidal", {"tidal": 3}, "lethe+tidal.tidal"), ("delta+tidal", {}, "policy"),
     ("tidal+lethe", {}, "policy"), ("snapkv+tidal", {"per_layer": True}, "snapkv.per_layer"),
     ("lethe+tidal", {"tidal": {"budget_tokens": 0}}, "tidal.budget_tokens")],
)  # fmt: skip
def test_bad_parameters_name_the_field(name, params, field):
    with pytest.raises(PolicyConfigError) as err:
        build_policy(name, params)
    assert err.value.field == field


def test_a_composition_carries_both_configs_to_the_engine_processes():
    policy = build_policy("tidal+art", {"budget_tokens": 256, "art": {"patience": 3}})
    assert isinstance(policy, ArtOver) and policy.name == "tidal+art"
    assert policy.base.budget_tokens == 256 and policy.art == Art(patience=3)
    export_policy(policy)
    try:
        assert active_policy() == policy
    finally:
        export_policy(build_policy("full"))


@pytest.mark.parametrize("device", DEVICES)
def test_art_without_termination_is_full_attention_and_writes_the_new_token(device):
    cache = Cache(device=device)
    fns = cache.decode_fns(build_policy("art", {"patience": 0}))
    out = cache.decode(fns[1], 1)
    slot = cache.batch.out_cache_loc[0]
    assert torch.equal(cache.keys[1][slot], cache.new_k[0])
    torch.testing.assert_close(out, cache.full_attention(1), **cache.tol)


@pytest.mark.parametrize("device", DEVICES)
def test_delta_with_art_reads_its_selection_most_important_first(device):
    cache = Cache(device=device)
    policy = build_policy("delta+art", {"full_layers": [0], "delta_layers": [1], "budget_pages": 4,
                                        "recent_pages": 1, "art": {"patience": 0}})  # fmt: skip
    plain = build_policy("delta", {"full_layers": [0], "delta_layers": [1], "budget_pages": 4,
                                   "recent_pages": 1})  # fmt: skip
    fns = cache.decode_fns(policy, base_decode="engine decode")
    plain_fns = cache.decode_fns(plain, base_decode="engine decode")
    assert fns[0] != "engine decode"  # full layers read through ART too
    cache.decode(fns[1], 1), cache.decode(plain_fns[1], 1)
    decoder, plain_decoder = fns[2].__self__, plain_fns[2].__self__
    # the same pages; under ART the recent page first, then by score
    assert decoder.selected[0, 0] == 18
    assert sorted(decoder.selected[0].tolist()) == plain_decoder.selected[0].tolist()
    torch.testing.assert_close(cache.decode(fns[2], 2), cache.decode(plain_fns[2], 2), **cache.tol)


def test_importance_order_puts_recent_pages_first_then_scores_descending():
    scores = torch.tensor([[5.0, 1.0, 9.0, 3.0, 7.0, 0.0, 2.0, 8.0]])
    seq_lens = torch.tensor([8 * 16 - 3])
    by_index, n = select_pages(scores, seq_lens, budget=5, num_recent=2)
    by_importance, n_imp = select_pages(scores, seq_lens, 5, 2, by_importance=True)
    assert by_index.tolist() == [[0, 2, 4, 6, 7]] and n.tolist() == n_imp.tolist() == [5]
    assert by_importance.tolist() == [[7, 6, 2, 4, 0]]
    short, n_short = select_pages(scores, torch.tensor([40]), 5, 2, by_importance=True)
    assert n_short.tolist() == [3] and short[0, :3].tolist() == [2, 1, 0]
