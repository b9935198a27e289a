"""The decode attention trace, the calibration's measurements and choices, and its CLI, on a tiny
randomly initialised Llama (the real model's calibration is committed, not recomputed here)."""

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.tools import agreement as ag
from sglang_ext.tools import attention_trace as at
from sglang_ext.tools import calibrate
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.policies import build_policy
from sglang_ext.policies.calibration import find_calibration, model_fingerprint
from sglang_ext.policies.selection import LayerRole

LAYERS, PROMPT_LEN, STEPS = 6, 200, 3


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, model_path):
    """A 6-layer Llama with random weights and SmolLM2's tokenizer, saved as an HF folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trace(tiny_model_dir):
    model = at.load_model(tiny_model_dir)
    ids = torch.randint(0, 49152, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    return at.trace_decode(model, ids.tolist(), STEPS)


def test_trace_shapes_and_probabilities(trace):
    assert trace.queries.shape == (STEPS, LAYERS, 4, 16)
    assert trace.keys.shape == (LAYERS, PROMPT_LEN + STEPS, 2, 16)
    assert trace.seq_lens == [PROMPT_LEN + 1, PROMPT_LEN + 2, PROMPT_LEN + 3]
    assert len(trace.generated) == STEPS
    for step in range(STEPS):
        probs = trace.probs(step, LAYERS - 1)
        assert probs.shape == (4, trace.seq_lens[step])
        torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_trace_matches_eager_attention(tiny_model_dir, trace):
    """The recorded queries and keys give exactly the probabilities eager attention returns."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.randint(0, 49152, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    full = torch.cat([ids, torch.tensor(trace.generated)])[None]
    with torch.inference_mode():
        attentions = eager(input_ids=full, output_attentions=True).attentions
    for step in range(STEPS):
        query_pos = trace.seq_lens[step] - 1
        for layer in (0, LAYERS - 1):
            expected = attentions[layer][0, :, query_pos, : query_pos + 1]
            torch.testing.assert_close(trace.probs(step, layer), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "name, field, params",
    [
        ("delta", "delta_layers", {}),
        ("tidal", "selection_layers", {}),
        ("tidal", "selection_layers", {"score": "qk"}),
    ],
)
def test_token_scores_are_those_of_the_engines_selection_layers(trace, name, field, params):
    """The replay's token scores equal what the policy's selection attention (the torch reference
    the engine runs on the CPU) computes from the same cache (scores do not read V: K stands in)."""
    policy = build_policy(name, {"full_layers": [0, 1], field: [2], **params})
    rule = at.selection_rule(policy, LAYERS)
    slots = trace.keys.shape[1]
    for step, layer in ((0, 2), (STEPS - 1, LAYERS - 1)):
        seq_len = trace.seq_lens[step]
        kv = KVView(
            trace.keys[layer], trace.keys[layer], torch.arange(slots, dtype=torch.int32)[None],
            torch.zeros(1, dtype=torch.int64), torch.tensor([seq_len]),
        )  # fmt: skip
        q = trace.queries[step, layer][None]
        _, token_scores, _ = rule.attend_and_score(q, kv, sm_scale=trace.sm_scale)
        replayed = at.TOKEN_SCORES[policy.score](trace.logits(step, layer))
        torch.testing.assert_close(replayed, token_scores[0, :seq_len])


def test_shift_is_zero_for_identical_layers_and_grows_with_difference():
    a = torch.softmax(torch.randn(4, 50), dim=-1)
    assert calibrate.layer_shift(a, a.clone()) == pytest.approx(0.0, abs=1e-6)
    disjoint = torch.zeros(2, 10)
    other = disjoint.clone()
    disjoint[:, :5], other[:, 5:] = 0.2, 0.2
    assert calibrate.layer_shift(disjoint, other) == pytest.approx(1.0)
    assert 0 < calibrate.layer_shift(a, torch.softmax(torch.randn(4, 50), dim=-1)) < 1


def test_recall_of_the_true_top_k_is_one_and_partial_otherwise():
    probs = torch.softmax(torch.randn(3, 100), dim=-1)
    assert at.attention_recall(probs, torch.arange(100)) == pytest.approx(1.0)
    half = torch.arange(50)
    assert at.attention_recall(probs, half) == pytest.approx(float(probs[:, :50].sum(-1).mean()))
    top = torch.tensor([3, 17, 42])
    assert calibrate.topk_overlap(top, top) == 1.0
    assert calibrate.topk_overlap(torch.tensor([3, 5, 6]), top) == pytest.approx(1 / 3)


def test_tidal_replay_at_full_budget_reads_every_token_and_top_k_recall_is_one(trace):
    policy = calibrate.tidal_policy(4, budget_tokens=PROMPT_LEN + STEPS)
    steps = at.replay(trace, policy)
    assert set(steps[0]) == {3, 5}  # the sparse layers
    for step, by_layer in enumerate(steps):
        assert torch.equal(by_layer[3].sort().values, torch.arange(trace.seq_lens[step]))
        assert at.attention_recall(trace.probs(step, 3), by_layer[3]) == pytest.approx(1.0)
    measured = calibrate.measure(trace, budget_tokens=PROMPT_LEN + STEPS)
    assert measured["tidal_topk_recall"][3:] == pytest.approx([1.0] * (LAYERS - 3))


def test_delta_replay_keeps_budget_pages_with_the_recent_ones(trace):
    policy = build_policy(
        "delta",
        {"full_layers": [0, 1], "delta_layers": [2, 4], "budget_pages": 4, "recent_pages": 1},
    )
    for step, by_layer in enumerate(at.replay(trace, policy)):
        tokens = by_layer[5]
        assert len(tokens) <= 4 * 16
        assert trace.seq_lens[step] - 1 in tokens  # the last page is always kept
        assert torch.equal(by_layer[3], by_layer[3].sort().values)
        assert 0 < at.attention_recall(trace.probs(step, 5), tokens) < 1


def _selecting(reads) -> tuple[int, ...]:
    return tuple(layer for layer, role in enumerate(reads.roles) if role is LayerRole.SELECT)


def test_layers_are_added_one_at_a_time_each_of_lowest_kl(monkeypatch):
    kl = {(2, 3): 0.5, (2, 4): 0.2, (2, 5): 0.2, (2, 3, 4): 0.3, (2, 4, 5): 0.1}
    monkeypatch.setattr(
        ag, "mean_kl", lambda model, passages, reads: kl.get(_selecting(reads), 1.0)
    )
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=6))

    def make(layers):
        return build_policy(
            "tidal", {"full_layers": [0, 1], "selection_layers": layers, "budget_tokens": 8}
        )

    layers, tried = ag.greedy_layers(model, [], make, [2], 3)
    assert layers == [2, 4, 5]  # 4 before 5 on their tie, then 5 is the better third
    assert tried["[2, 4]"] == 0.2 and tried["[2, 3, 4]"] == 0.3 and len(tried) == 5
    with pytest.raises(ValueError, match="do not fit"):
        ag.greedy_layers(model, [], make, [2], 5)


def test_natural_text_prompts_have_exact_lengths_and_fall_back_to_stdlib(tmp_path, model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts, source = at.natural_text_prompts(tokenizer, [300, 500], tmp_path / "missing")
    assert [len(p) for p in prompts] == [300, 500]
    assert prompts[0][:50] != prompts[1][:50]  # each starts from a different file
    assert "standard-library" in source


def test_cli_writes_a_calibration_the_policies_find_and_accept(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("SGLANG_EXT_CALIBRATION_DIR", str(tmp_path / "calibrations"))
    out = calibrate.main([
        "--model-path", str(tiny_model_dir), "--prompts", "150,220", "--decode-steps", "2",
        "--budget-tokens", "32", "--plot", str(tmp_path / "plot.png"),
        "--agreement-prompts", "120,120", "--agreement-stride", "16",
        "--agreement-budget-tokens", "32",
    ])  # fmt: skip
    assert out == tmp_path / "calibrations" / f"{tiny_model_dir.name}.json"
    assert (tmp_path / "plot.png").stat().st_size > 0
    from transformers import AutoConfig

    fingerprint = model_fingerprint(AutoConfig.from_pretrained(str(tiny_model_dir)))
    found = find_calibration(fingerprint)
    assert found is not None and found["path"] == str(out)
    assert found == {**json.loads(out.read_text()), "path": str(out)}
    delta = build_policy("delta", found["delta"])
    tidal = build_policy("tidal", found["tidal"])
    assert len(delta.layer_roles(LAYERS)) == len(tidal.layer_roles(LAYERS)) == LAYERS
    # from layer 2 after full layers [0, 1], or from layer 1 after [0] with one more: 5 layers
    # read the whole cache either way
    assert (delta.full_layers, delta.delta_layers[0]) in (([0, 1], 2), ([0], 1))
    assert len(delta.full_layers) + len(delta.delta_layers) == 5
    measured = found["measurements"]
    assert measured["attention_shift"][0] is None
    assert all(0 <= v <= 1 for v in measured["attention_shift"][1:])
    tried = measured["agreement_kl"]["tidal"]
    # each start's best full list: [2, R] after [0, 1], [1, R, R'] after [0]; the papers' start
    # unless the other's KL is START_MARGIN lower
    lists = {key: json.loads(key) for key in tried}
    papers = min(kl for key, kl in tried.items() if lists[key][0] == 2 and len(lists[key]) == 2)
    other = min(kl for key, kl in tried.items() if lists[key][0] == 1 and len(lists[key]) == 3)
    expected = other if other < papers * (1 - calibrate.START_MARGIN) else papers
    assert tried[str(tidal.selection_layers)] == expected
    assert str(delta.delta_layers) in measured["agreement_kl"]["delta"]
    assert found["source"]["decode_steps"] == 2
    # the replays (agreement, recall) resolve unset layers through the same file
    replay = at.cpu_context(LAYERS, fingerprint)
    assert build_policy("delta").for_model(replay).delta_layers == delta.delta_layers
    assert build_policy("tidal").for_model(replay).selection_layers == tidal.selection_layers
