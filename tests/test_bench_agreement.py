"""The teacher-forced agreement benchmark, a small run on SmolLM2's real weights: its one-step path
reproduces full attention, a budget covering the context is exact, small budgets and a window
are not, and bf16 sits between."""

import json

import pytest
import torch

from benchmarks import agreement, harness
from row_schema import assert_rows_schema
from sglang_ext.tools import agreement as ag


@pytest.fixture(scope="module")
def rows(model_path, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("agreement")
    agreement.main([
        "--model-path", str(model_path), "--lengths", "384", "--prompts-per-length", "1",
        "--positions-from", "256", "--stride", "32", "--budgets", "128,512", "--window", "64",
        "--lethe-ratios", "0.3", "--lethe-threshold", "64", "--variants",
        "tidal:sink_tokens=0;lethe:max_kv_ratio=1.0;lethe:sparse_ratio=2.0,max_kv_ratio=1.0;"
        "lethe:sparse_ratio=2.0,max_kv_ratio=1.0,pack_layers=false", "--per-kv-head",
        "--out-dir", str(out), "--results-md", str(out / "RESULTS.md"),
    ])  # fmt: skip
    (rows_path,) = out.glob("agreement-*.json")
    return json.loads(rows_path.read_text())


@pytest.fixture(scope="module")
def values(rows) -> dict:
    return {(row["policy"], row["metric"]): row["value"] for row in rows}


def test_rows_name_the_kv_the_backend_and_each_reads_budget(rows):
    # teacher-forced on the real prefill's KV, in torch; no vanilla run to compare with
    assert_rows_schema(rows, "agreement", kv_sources={"real"})
    assert {row["attention_backend"] for row in rows} == {"torch"}
    assert all(row["ratio"] is None for row in rows)
    # every read but full attention's (and bf16's, which is full attention too) has a budget
    assert all(bool(row["budget"]) == (row["policy"] not in ("full", "bf16")) for row in rows)
    budgets = {row["policy"]: row["budget"] for row in rows}
    assert budgets["delta-128"] == "8 pages"  # 128 tokens as DELTA's pages of 16
    assert budgets["tidal-128"] == "128 tokens" and budgets["window-64"] == "64 tokens"


def test_the_one_step_path_and_covering_budgets_reproduce_full_attention(values):
    # 512 tokens cover the 384-token passage
    for label in ("full", "delta-512", "tidal-512", "tidal-per-kv-head-512"):
        assert values[label, "top1_agreement"] == 1.0
        assert values[label, "kl_nats"] < 1e-6, label


def test_lethe_rows_say_how_much_kv_it_kept(values):
    assert 0 < values["lethe-0.3", "kv_kept_fraction"] < 0.5
    assert values["lethe-0.3", "kl_nats"] > 1e-4
    assert ("delta-128", "kv_kept_fraction") not in values  # it evicts nothing


def test_small_budgets_and_the_window_move_the_distribution(values):
    kl = {label: values[label, "kl_nats"] for label in ("delta-128", "tidal-128", "window-64")}
    assert all(value > 1e-4 for value in kl.values()), kl
    # the selections keep what matters far better than the last 64 tokens do
    assert kl["window-64"] > 10 * max(kl["delta-128"], kl["tidal-128"]), kl


def test_bf16_is_a_noise_floor_above_the_paths_own_error(values):
    assert values["full", "kl_nats"] * 100 < values["bf16", "kl_nats"] < 0.05


def test_agreement_of_equal_and_of_different_distributions():
    reference = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    top1, kl = ag.agreement(reference, reference)
    assert top1.tolist() == [1.0, 1.0] and kl.abs().max() < 1e-7
    top1, kl = ag.agreement(reference, reference.flip(-1))
    assert top1.tolist() == [0.0, 1.0] and bool((kl > 0).all())


def test_variants_are_measured_beside_the_defaults(values):
    assert values["tidal[sink_tokens=0]-512", "kl_nats"] < 1e-6  # still covering
    assert values["tidal[sink_tokens=0]-128", "kl_nats"] != values["tidal-128", "kl_nats"]
    # Lethe without a cap (and, by default, without per-layer breakpoints): full attention
    union = "lethe[max_kv_ratio=1.0]"
    assert values[union, "kv_kept_fraction"] == 1.0 and values[union, "kl_nats"] < 1e-6


def test_per_layer_memory_holds_less_than_the_union_under_the_same_rule(values):
    """The paper's per-layer rule uncapped, its lists packed into shared slots or freed by the
    union: packed, a request holds the sum of the lists, so it holds less and its rounds (due by
    what it holds) come later; what the layers read is as close to full attention."""
    packed = "lethe[sparse_ratio=2.0,max_kv_ratio=1.0]"
    union = "lethe[sparse_ratio=2.0,max_kv_ratio=1.0,pack_layers=false]"
    assert values[packed, "kv_kept_fraction"] < 0.9 * values[union, "kv_kept_fraction"]
    assert 1e-4 < values[packed, "kl_nats"] < 1.5 * values[union, "kl_nats"]


def test_a_selection_per_kv_head_reads_what_its_own_query_group_chose(values):
    from sglang_ext.tools import attention_trace as at
    from sglang_ext.policies import build_policy

    assert values["tidal-per-kv-head-128", "kl_nats"] != values["tidal-128", "kl_nats"]
    policy = build_policy("tidal", {"budget_tokens": 4, "recent_tokens": 1, "sink_tokens": 0})
    policy = policy.for_model(at.cpu_context(8))
    roles = policy.layer_roles(8)
    select, sparse = roles.index(ag.LayerRole.SELECT), roles.index(ag.LayerRole.SPARSE)
    logits = torch.full((6, 16), -5.0)  # 6 query heads over 2 KV heads, 16 tokens
    logits[0, 3] = logits[1, 5] = logits[4, 9] = 5.0  # group 0 attends to 3 and 5, group 1 to 9
    reads = ag.PerKVHeadSelectionReads(policy, 8, kv_heads=2)
    assert reads.tokens(select, logits) is None  # the selection layer reads everything
    mask = reads.tokens(sparse, logits)
    assert mask.shape == (6, 16) and bool((mask.sum(-1) == 4).all())
    assert torch.equal(mask[0], mask[2]) and torch.equal(mask[3], mask[5])  # one per group
    assert mask[0, [3, 5, 15]].all() and not mask[0, 9]  # its peaks and the recent token
    assert mask[3, [9, 15]].all() and not mask[3, [3, 5]].any()
    # one KV head: every query head reads the shared selection
    shared = ag.SelectionReads(policy, 8)
    shared.tokens(select, logits)
    one = ag.PerKVHeadSelectionReads(policy, 8, kv_heads=1)
    one.tokens(select, logits)
    assert one.tokens(sparse, logits)[0].nonzero().flatten().tolist() == sorted(
        shared.tokens(sparse, logits).tolist()
    )


def test_a_variant_may_set_a_list_beside_other_parameters():
    name, params = harness.policy_variant("tidal:selection_layers=[2, 9, 17],sink_tokens=0")
    assert name == "tidal" and params == {"selection_layers": [2, 9, 17], "sink_tokens": 0}


@pytest.mark.parametrize(
    "text, message",
    [("tidal:sink_tokens", "expected KEY=VALUE"), ("art:tau=1", "expected delta:"),
     ("tidal:sink_tokenz=1", "sink_tokenz"), ("delta:sink_pages=x", "not a JSON value")],
)  # fmt: skip
def test_bad_variants_are_refused_naming_the_flag(text, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        agreement.main(["--variants", text, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--variants" in err and message in err, err


def test_positions_outside_the_passage_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        agreement.main(
            ["--lengths", "4096,128", "--positions-from", "128", "--out-dir", str(tmp_path)]
        )
    assert exit.value.code == 2 and "--positions-from 128" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def passage(model_path):
    from sglang_ext.tools import attention_trace as at
    from transformers import AutoTokenizer

    model = ag.load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    (ids,), _ = at.natural_text_prompts(tokenizer, [384])
    return model, ag.Passage.prefill(model, ids, list(range(256, 384, 32)))


def test_lethe_before_its_first_round_reads_everything_and_matches_full(passage):
    from sglang_ext.policies import build_policy

    model, text = passage
    lethe = build_policy("lethe", {"evict_threshold": 1000})  # beyond the passage: no round
    reads = ag.LetheReads(lethe, model.config.num_hidden_layers, prompt_len=200)
    top1, kl = text.measure(model, reads)
    assert bool((top1 == 1).all()) and float(kl.max()) < 1e-6
    assert reads.take_kept() == [1.0] * 4 and reads.take_kept() == []


def test_lethe_after_rounds_reads_its_retained_sets_and_holds_its_budget(passage):
    from sglang_ext.policies import build_policy

    model, text = passage
    lethe = build_policy("lethe", {"evict_threshold": 64, "max_kv_ratio": 0.3})
    reads = ag.LetheReads(lethe, model.config.num_hidden_layers, prompt_len=200)
    top1, kl = text.measure(model, reads)
    kept = reads.take_kept()
    # rounds ran (KV freed), each leaving at most 30 % and a recent window growing until the next
    assert all(share < 0.5 for share in kept), kept
    assert float(kl.mean()) > 1e-4  # it reads less than full attention, and it shows
    # the measure is repeatable: a passage measured again replays the same decode from its prompt
    again, kl_again = text.measure(model, reads)
    assert torch.equal(kl, kl_again) and reads.take_kept() == kept


def test_lists_per_kv_head_read_each_query_group_its_heads_list(passage):
    """Before a round every head reads everything (full attention's step); after rounds each
    query group reads its KV head's own retained tokens, and the heads of a layer differ."""
    from sglang_ext.policies import build_policy

    model, text = passage
    layers = model.config.num_hidden_layers
    untouched = build_policy("lethe", {"evict_threshold": 1000, "per_kv_head": True})
    top1, kl = text.measure(model, ag.LetheReads(untouched, layers, prompt_len=256))
    assert bool((top1 == 1).all()) and float(kl.max()) < 1e-6
    lethe = build_policy("lethe", {"evict_threshold": 64, "max_kv_ratio": 0.3, "per_kv_head": True})
    reads = ag.LetheReads(lethe, layers, prompt_len=256)
    _, kl = text.measure(model, reads)
    assert all(share < 0.5 for share in reads.take_kept()) and float(kl.mean()) > 1e-4
    runtime, heads = reads._runtime, model.config.num_key_value_heads
    q_heads = model.config.num_attention_heads
    mask = reads.tokens(3, torch.zeros(q_heads, 384))
    group = q_heads // heads
    lists = [runtime.positions[3 * heads + h, reads.ROW, : runtime.count[3 * heads + h, reads.ROW]]
             for h in range(heads)]  # fmt: skip
    for h, kept in enumerate(lists):
        assert torch.equal(mask[h * group].nonzero().squeeze(1), kept.long().sort().values)
        assert bool((mask[h * group : (h + 1) * group] == mask[h * group]).all())
    assert any(not torch.equal(lists[0].sort().values, other.sort().values) for other in lists[1:])
