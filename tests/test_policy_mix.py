"""A server of several policies: requests choose among them, and a batch mixing them gives each
row what its own policy's runtime gives it alone (on a small synthetic KV cache)."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from policy_cases import DEVICES, Cache
from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.policies.mix import PolicyMix
from sglang_ext.policies.runtime import EngineOps, StepRequest
from sglang_ext.request_policy import request_policy

MEMBERS = {
    "delta": {"full_layers": [0], "delta_layers": [1], "budget_pages": 4, "recent_pages": 1},
    "tidal": {"full_layers": [0, 1], "selection_layers": [2], "budget_tokens": 24},
    "lethe": {"observation_window": 0},
    "full": {},
}
NAME = ",".join(MEMBERS)
ROWS = ("delta", "tidal", "lethe", "full", "delta")  # each batch entry's policy
SEQ_LENS = (300, 120, 40, 60, 17)
OPS = EngineOps(free_slots=lambda slots: None, available_slots=lambda: 0, rerun_extend=None)


def test_a_mixed_batch_attends_to_its_members_tokens_on_average():
    # the benchmarks' batches name the members in turn: a decode step's floor counts them so
    mix, lethe = build_policy("lethe,full"), build_policy("lethe")
    assert mix.attended_tokens(32768, 28) == (lethe.attended_tokens(32768, 28) + 32768) / 2


def test_a_mix_is_built_from_each_members_parameters_and_described_by_them():
    mix = build_policy(NAME, MEMBERS)
    assert isinstance(mix, PolicyMix) and mix.name == NAME
    assert [m.name for m in mix.members] == list(MEMBERS)
    assert mix.members[1].budget_tokens == 24 and mix.evicts()
    described = mix.describe()
    assert described["delta"]["budget_pages"] == 4
    assert build_policy(NAME, {k: v for k, v in described.items() if k != "name"}) == mix
    assert mix.server_defaults() == build_policy("lethe").server_defaults()


@pytest.mark.parametrize(
    "name, params, field, fragment",
    [
        ("delta,delta", {}, "policy", "lists delta twice"),
        ("delta,bogus", {}, "policy", "unknown policy 'bogus'"),
        ("delta,tidal", {"lethe": {}}, "lethe", "not a policy of delta,tidal"),
        ("delta,tidal", {"tidal": {"budget_tokens": 0}}, "tidal.budget_tokens", ">= 1"),
        ("delta,tidal", {"tidal": 3}, "tidal", "expected an object"),
    ],
)
def test_bad_mixes_name_the_field(name, params, field, fragment):
    with pytest.raises(PolicyConfigError) as err:
        build_policy(name, params)
    assert err.value.field == field and fragment in str(err.value)


def test_a_request_chooses_a_member_with_its_own_parameters_the_first_by_default():
    mix = build_policy(NAME, MEMBERS)
    assert request_policy(mix, None) is mix.members[0]
    tidal = request_policy(mix, {"kv_policy": {"name": "tidal", "budget_tokens": 16}})
    assert tidal.name == "tidal" and tidal.budget_tokens == 16
    assert request_policy(mix, {"kv_policy": {"name": "full"}}).name == "full"
    for spec, field, fragment in [
        ({"name": "art"}, "kv_policy.name", "(valid: delta, tidal, lethe, full)"),
        ({"name": "tidal", "budget_tokens": 64}, "kv_policy.budget_tokens", "the server's 24"),
        ({"name": "full", "budget_tokens": 8}, "kv_policy.budget_tokens", "takes no parameters"),
        ({"name": "delta", "delta_layers": [2]}, "kv_policy.delta_layers", "--policy-config"),
    ]:
        with pytest.raises(PolicyConfigError) as err:
            request_policy(mix, {"kv_policy": spec})
        assert err.value.field == field and fragment in str(err.value), spec


def engine_full(cache):
    """The engine's own decode: it stores the new token's K/V, then attends to everything."""

    def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if save_kv_cache:
            cache.write_kv(layer, forward_batch, k, v)
        return cache.full_attention(layer.layer_id)

    return decode


def engine_rows(cache, asked: list):
    """The engine's decode of the rows a mask marks (fa3's ``decode_rows``): the other rows'
    output is NaN here, which the mix must never keep. Records each mask it is built with."""

    def rows_decode(rows):
        asked.append(rows)
        full = engine_full(cache)

        def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            out = full(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            return torch.where(rows[: out.shape[0], None], out, out.new_full((), float("nan")))

        return decode

    return rows_decode


def decode_step(policy, rows_policy, device, rows_decode=None):
    """A prefill then one decode step of the batch under ``policy``'s runtime, each entry
    choosing ``rows_policy[i]``; every layer's output [layers, batch, ...] and the runtime."""
    cache = Cache(num_layers=4, seq_lens=SEQ_LENS, device=device)
    policy = policy.for_model(cache.context())
    ctx = cache.context(base_decode=engine_full(cache))
    if rows_decode is not None:
        ctx = dataclasses.replace(ctx, base_decode_rows=rows_decode(cache))
    runtime = policy.runtime(ctx)
    batch = cache.batch
    requests = []
    for i, name in enumerate(rows_policy):
        own = request_policy(policy, {"kv_policy": {"name": name}})
        state = runtime.new_request(own, None)
        row, seq_len = int(batch.req_pool_indices[i]), int(batch.seq_lens[i])
        requests.append(StepRequest(state, f"r{i}", row, seq_len, seq_len - 1, [], 0, index=i))
    prefill = SimpleNamespace(
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens - 1,
        extend_seq_lens_cpu=(batch.seq_lens - 1).tolist(),
    )  # fmt: skip
    runtime.run_plan(runtime.plan_step(requests, False), prefill, OPS)
    runtime.run_plan(runtime.plan_step(requests, True), batch, OPS)
    runtime.prepare_decode(batch)
    outs = [
        runtime.decode_fns[layer](cache.q, cache.new_k, cache.new_v, cache.layer(layer), batch)
        for layer in range(cache.num_layers)
    ]
    return torch.stack(outs), runtime, cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [ROWS, ("full", "tidal", "full", "tidal", "full")])
def test_each_row_of_a_mixed_batch_decodes_as_under_its_own_policy_alone(device, rows):
    mix = build_policy(NAME, MEMBERS)
    mixed, runtime, cache = decode_step(mix, rows, device)
    for member in mix.members:
        alone, _, _ = decode_step(member, [member.name] * len(rows), device)
        own = [i for i, name in enumerate(rows) if name == member.name]
        torch.testing.assert_close(mixed[:, own], alone[:, own], **cache.tol, msg=member.name)
    if rows != ROWS:  # members without a request read (almost) nothing
        return
    full = torch.stack([cache.full_attention(layer) for layer in range(cache.num_layers)])
    assert not torch.allclose(mixed[2:, 0], full[2:, 0], **cache.tol)  # DELTA's selection holds
    delta, tidal, lethe, _ = runtime.members
    # a member's own selection and lists hold its rows only; the others read one token
    assert delta.decode_fns[1].__self__.num_selected[: len(ROWS)].tolist() == [4, 1, 1, 1, 2]
    assert tidal.decode_fns[2].__self__.num_selected[: len(ROWS)].tolist() == [1, 24, 1, 1, 1]
    row = int(cache.batch.req_pool_indices[2])
    assert lethe.count[:, row].tolist() == [SEQ_LENS[2]] * cache.num_layers
    assert lethe.scores[:, row, : SEQ_LENS[2]].sum(1).gt(0).all()
    others = cache.batch.req_pool_indices[[0, 1, 3, 4]]
    assert lethe.count[:, others].eq(0).all()  # never reset nor appended to


def test_a_member_judges_its_first_selection_by_its_own_rows(caplog):
    # DELTA's 300-token row passes Tidal's 24-token budget, Tidal's own 17-token row does not:
    # Tidal selects nothing fewer and says nothing of it
    rows = ("delta", "full", "full", "full", "tidal")
    with caplog.at_level(logging.INFO, logger="sglang_ext.policies.selection"):
        decode_step(build_policy(NAME, MEMBERS), rows, "cpu")
    assert "delta layer 1 first selected fewer pages than a request has: [4, 1, 1, 1, 1]" in (
        caplog.text
    )
    assert "tidal layer" not in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="slot tables are read on CUDA")
def test_members_that_read_their_slot_tables_at_a_layer_are_read_in_one_call():
    # Lethe with one retained set reads the step's slot table at every layer (with its default
    # per-layer lists each layer reads its own list of rows, never a shared table)
    mix = build_policy(NAME, {**MEMBERS, "lethe": {**MEMBERS["lethe"], "per_layer": False}})
    _, runtime, _ = decode_step(mix, ROWS, "cuda")
    one_call = [[g.members for g in groups if g.tables] for groups in runtime.layers]
    # DELTA's sparse layers are 2 and 3, Tidal's 3, Lethe's every layer; alone (layers 0 and 1)
    # it reads its own
    assert one_call == [[], [], [(0, 2)], [(0, 1, 2)]]
    assert [len(groups) for groups in runtime.layers] == [2, 3, 3, 2]


def test_engine_attention_shared_by_some_members_reads_only_their_rows():
    mix = build_policy(NAME, MEMBERS)
    asked: list = []
    mixed, _, cache = decode_step(mix, ROWS, "cpu", lambda c: engine_rows(c, asked))
    plain, _, _ = decode_step(mix, ROWS, "cpu")
    torch.testing.assert_close(mixed, plain, **cache.tol)  # no unread row's output kept
    # one engine call of the members attending fully at a layer: delta, tidal and full at layer
    # 0, tidal and full at 1, full alone at 2 and 3; Lethe's rows never read there
    marked = sorted(sorted({ROWS[b] for b in range(len(ROWS)) if mask[b]}) for mask in asked)
    assert marked == [["delta", "full", "tidal"], ["full"], ["full", "tidal"]]


def test_requests_are_counted_and_reported_under_their_own_policy():
    mix = build_policy(NAME, MEMBERS)
    _, runtime, cache = decode_step(mix, ROWS, "cpu")
    lethe = next(m for m in mix.members if m.name == "lethe")
    for name, total in (("lethe", 20_000), ("delta", 20_000), ("full", 500)):
        own = request_policy(mix, {"kv_policy": {"name": name}})
        state = runtime.new_request(own, None)
        expected = lethe.expected_kv(total) if name == "lethe" else total
        assert runtime.admission_tokens(state, total) == expected
        assert state.evicts == (name == "lethe")
    request = StepRequest(runtime.new_request(mix.members[1], None), "r", 1, 120, 100, [], 0)
    assert runtime.report(request, extend=False).policy == "tidal"


@pytest.mark.parametrize("device", DEVICES)
def test_art_and_a_base_under_art_mix_like_any_members(device):
    delta = MEMBERS["delta"]
    mix = build_policy("art,delta+art", {"art": {"tau": 0.5}, "delta+art": delta})
    rows = ("art", "delta+art", "art", "delta+art", "art")
    mixed, runtime, cache = decode_step(mix, rows, device)
    assert mix.reads_tiles() and not mix.evicts()
    for member in mix.members:
        alone, _, _ = decode_step(member, [member.name] * len(rows), device)
        own = [i for i, name in enumerate(rows) if name == member.name]
        torch.testing.assert_close(mixed[:, own], alone[:, own], **cache.tol, msg=member.name)
