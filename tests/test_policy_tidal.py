"""TidalDecode's parameters, layer defaults and decode functions, on a small synthetic KV cache."""

import pytest
import torch
from policy_cases import DEVICES, Cache
from sglang_ext.kernels.split_kv_decode import attend_positions_ref
from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.policies.selection import LayerRole


def test_defaults_reselect_at_the_papers_relative_depth():
    policy = build_policy("tidal")
    assert (policy.budget_tokens, policy.recent_tokens, policy.sink_tokens) == (1024, 1, 4)
    assert policy.score == "probability"
    assert policy.for_model(Cache(num_layers=32).context()).selection_layers == [2, 13]
    resolved = policy.for_model(Cache(num_layers=28).context())
    assert (resolved.full_layers, resolved.selection_layers) == ([0, 1], [2, 11])
    roles = resolved.layer_roles(28)
    assert [i for i, role in enumerate(roles) if role is LayerRole.SELECT] == [2, 11]
    assert roles.count(LayerRole.SPARSE) == 24


@pytest.mark.parametrize(
    "params, field, fragment",
    [
        ({"budget_tokens": 0}, "budget_tokens", "must be >= 1"),
        ({"budget_tokens": 8, "recent_tokens": 9}, "recent_tokens", "[0, budget_tokens=8]"),
        ({"selection_layers": []}, "selection_layers", "at least one"),
        ({"selection_layers": [13, 2]}, "selection_layers", "ascending"),
        ({"full_layers": [0], "selection_layers": [2]}, "full_layers", "[1] come before"),
        ({"budget_tokens": 1.5}, "budget_tokens", "expected int"),
        ({"correction_interval": -1}, "correction_interval", "must be >= 0"),
        ({"sink_tokens": -1}, "sink_tokens", "must be >= 0"),
        ({"score": "logit"}, "score", "unknown token score 'logit' (valid: probability, qk)"),
    ],
)
def test_bad_parameters_name_the_field(params, field, fragment):
    with pytest.raises(PolicyConfigError) as err:
        build_policy("tidal", params)
    assert err.value.field == f"tidal.{field}"
    assert fragment in str(err.value)


def tidal_decode_fns(cache, **params):
    policy = build_policy("tidal", {"full_layers": [0, 1], "selection_layers": [2], **params})
    fns = cache.decode_fns(policy, base_decode="engine decode")
    return fns, fns[2].__self__


@pytest.mark.parametrize("device", DEVICES)
def test_a_budget_covering_the_context_gives_full_attention(device):
    cache = Cache(device=device)
    fns, decoder = tidal_decode_fns(cache, budget_tokens=300)
    for layer_id in (2, 3):
        torch.testing.assert_close(
            cache.decode(fns[layer_id], layer_id), cache.full_attention(layer_id), **cache.tol
        )
    assert decoder.num_selected[:3].tolist() == [300, 40, 17]


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_budget_keeps_the_sinks_the_top_tokens_by_qk_and_the_last(device):
    cache = Cache(device=device)
    fns, decoder = tidal_decode_fns(cache, budget_tokens=24, score="qk")
    cache.decode(fns[2], 2)  # writes the new token's K/V, then selects
    assert decoder.num_selected[:3].tolist() == [24, 24, 17]

    chosen = decoder.selected[0].tolist()
    assert set(chosen) == expected_selection(cache, "qk", 24) and chosen == sorted(chosen)

    sparse = cache.decode(fns[3], 3)
    row, seq_len = cache.batch.req_pool_indices[0], int(cache.batch.seq_lens[0])
    slots = cache.req_to_token[row, :seq_len].long()
    positions = slots[torch.tensor(chosen, device=cache.device)]
    q3 = cache.q.view(-1, Cache.Q_HEADS, Cache.DIM)[0]
    attended, _ = attend_positions_ref(q3, cache.keys[3], cache.values[3], positions, 0.125)
    torch.testing.assert_close(sparse[0], attended.flatten().to(sparse.dtype), **cache.tol)
    torch.testing.assert_close(sparse[2], cache.full_attention(3)[2], **cache.tol)  # 17 <= 24


def expected_selection(cache, score: str, budget: int) -> set[int]:
    """The first request's selection at layer 2: its sinks, its last token, and the rest of the
    budget by the max over query heads of q·k or of the attention probability."""
    q = cache.q.view(-1, Cache.Q_HEADS, Cache.DIM).float()
    row, seq_len = cache.batch.req_pool_indices[0], int(cache.batch.seq_lens[0])
    slots = cache.req_to_token[row, :seq_len].long()
    kv_head_of = torch.arange(Cache.Q_HEADS) // (Cache.Q_HEADS // Cache.KV_HEADS)
    keys = cache.keys[2][slots][:, kv_head_of.to(cache.device)].float()  # [tokens, q_heads, dim]
    logits = torch.einsum("hd,thd->ht", q[0], keys) * 0.125
    scores = (logits if score == "qk" else torch.softmax(logits, dim=-1)).amax(0)
    sinks = build_policy("tidal").sink_tokens
    scores[:sinks] = scores.min() - 1  # the first tokens are kept however they score
    top = scores[:-1].topk(budget - 1 - sinks).indices.tolist()
    return set(top) | set(range(sinks)) | {seq_len - 1}


@pytest.mark.parametrize("device", DEVICES)
def test_scored_by_probability_it_keeps_the_tokens_some_head_attends_to_most(device):
    cache = Cache(device=device)
    fns, decoder = tidal_decode_fns(cache, budget_tokens=24)  # the default score
    cache.decode(fns[2], 2)
    chosen = set(decoder.selected[0].tolist())
    assert chosen == expected_selection(cache, "probability", 24)
    assert chosen != expected_selection(cache, "qk", 24)  # heads' logit scales differ here
