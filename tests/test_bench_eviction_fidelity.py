"""The eviction-fidelity benchmark, small, on SmolLM2's real weights: kvpress's presses driven over
a passage keep what kvpress's own hooks keep, StreamingLLM its sinks and window by kvpress's
definition, a press asked to keep everything reads as full attention does, the kept fraction is
the ratio asked right after a compression, and the rows have the schema."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from benchmarks import eviction_fidelity
from row_schema import assert_rows_schema
from sglang_ext.tools import agreement as ag
from sglang_ext.tools import attention_trace as at

PROMPT, LENGTH, STRIDE, INTERVAL = 128, 256, 32, 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: the steps are small, and on a busy 2-core machine a second thread
    makes every op wait for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tidal over Lethe, its sparse layers reading 16 of what Lethe keeps
COMPOSED = 'lethe+tidal:{"tidal": {"budget_tokens": 16}}'
COMPOSED_LABEL = 'lethe+tidal[tidal={"budget_tokens": 16}]'


@pytest.fixture(scope="module")
def run_dir(model_path, tmp_path_factory):
    pytest.importorskip("kvpress")
    out = tmp_path_factory.mktemp("eviction_fidelity")
    eviction_fidelity.main([
        "--model-path", str(model_path), "--lengths", str(LENGTH), "--prompts-per-length", "1",
        "--positions-from", str(PROMPT), "--stride", str(STRIDE), "--kv-ratios", "0.3,1.0",
        "--compression-interval", str(INTERVAL), "--window", "64", "--evict-threshold", "64",
        "--policies", f'lethe;lethe:{{"max_kv_ratio": 0.5}};{COMPOSED}', "--threads", "1",
        "--out-dir", str(out), "--results-md", str(out / "RESULTS.md"),
        "--per-position", str(out / "per-position.json"),
        "--missed-attention", str(out / "missed.json"),
    ])  # fmt: skip
    assert "| context | kv ratio asked | method |" in (out / "RESULTS.md").read_text()
    return out


@pytest.fixture(scope="module")
def rows(run_dir) -> list[dict]:
    (rows_path,) = run_dir.glob("eviction_fidelity-*.json")
    return json.loads(rows_path.read_text())


@pytest.fixture(scope="module")
def values(rows) -> dict:
    return {(row["policy"], row["budget"], row["metric"]): row["value"] for row in rows}


def test_rows_have_the_schema_and_name_the_ratio_asked(rows):
    assert_rows_schema(rows, "eviction_fidelity", kv_sources={"real"})
    budgets = {(row["policy"], row["budget"]) for row in rows}
    for press in eviction_fidelity.KVPRESS_PRESSES:
        assert {(f"kvpress-{press}", "0.3"), (f"kvpress-{press}", "1")} <= budgets
    assert {("lethe", "0.3"), ("lethe", "1"), ("lethe[max_kv_ratio=0.5]", "0.5")} <= budgets
    assert {("full", ""), ("window-64", "64 tokens")} <= budgets
    assert {(COMPOSED_LABEL, "0.3"), (COMPOSED_LABEL, "1")} <= budgets
    assert len(budgets) == 2 * 6 + 3 + 2 + 2  # the explicit max_kv_ratio is measured once


def test_per_position_values_are_what_the_rows_average(run_dir, rows):
    by_length = json.loads((run_dir / "per-position.json").read_text())
    positions = by_length[str(LENGTH)]["positions"]
    assert positions == list(range(PROMPT, LENGTH, STRIDE))
    methods = by_length[str(LENGTH)]["methods"]
    kl_rows = {(r["policy"], r["budget"]): r["value"] for r in rows if r["metric"] == "kl_nats"}
    for (label, budget), mean in kl_rows.items():
        kl = torch.tensor(methods[f"{label} {budget}".strip()]["kl"])
        assert kl.shape == (1, len(positions)), label
        assert kl.mean().item() == pytest.approx(mean, rel=1e-5, abs=1e-9), label
    assert torch.tensor(methods["lethe 0.3"]["kl"]).max() > 0  # the values, not zeros


def test_missed_attention_is_what_a_method_leaves_out(run_dir, model_path):
    by_length = json.loads((run_dir / "missed.json").read_text())[str(LENGTH)]["methods"]
    layers = ag.load_model(model_path).config.num_hidden_layers
    positions = len(range(PROMPT, LENGTH, STRIDE))
    missed = {name: torch.tensor(entry["missed"]) for name, entry in by_length.items()}
    assert missed["full"].shape == (1, positions, layers)
    for name in ["full", "lethe 1", "kvpress-snapkv 1"]:
        assert missed[name].abs().max() < 1e-5, name  # reading everything misses nothing
    for name in ["window-64 64 tokens", "lethe 0.3", "kvpress-snapkv 0.3", "kvpress-random 0.3"]:
        assert 0 < missed[name].mean() < 1, name
    # a random eviction misses more of the attention than SnapKV's choice does
    assert missed["kvpress-random 0.3"].mean() > missed["kvpress-snapkv 0.3"].mean()


def test_keeping_everything_reads_as_full_attention(values):
    for label in [f"kvpress-{press}" for press in eviction_fidelity.KVPRESS_PRESSES] + ["lethe"]:
        assert values[label, "1", "top1_agreement"] == 1.0, label
        assert values[label, "1", "kl_nats"] < 1e-6, label
        assert values[label, "1", "kv_kept_fraction"] == 1.0, label
    assert values["full", "", "kl_nats"] < 1e-6
    # Lethe keeping everything under Tidal: its sparse layers still read only their selection
    assert values[COMPOSED_LABEL, "1", "kv_kept_fraction"] == 1.0
    assert values[COMPOSED_LABEL, "1", "kl_nats"] > 1e-4


def test_at_a_compression_a_press_holds_the_ratio_asked(values):
    # each measured position comes right after a compression (the stride a multiple of the
    # interval): each layer holds int(p * 0.3) of the p tokens seen, and reads the step's token
    positions = range(PROMPT, LENGTH, STRIDE)
    expected = sum((int(p * 0.3) + 1) / (p + 1) for p in positions) / len(positions)
    for press in eviction_fidelity.KVPRESS_PRESSES:
        kept = values[f"kvpress-{press}", "0.3", "kv_kept_fraction"]
        assert kept == pytest.approx(expected), press
        assert values[f"kvpress-{press}", "0.3", "kl_nats"] > 1e-4, press
    # Lethe holds its cap after a round and more until the next
    assert 0.3 < values["lethe", "0.3", "kv_kept_fraction"] < 0.5


def test_passages_spread_over_processes_measure_as_one_process_does(run_dir, model_path, tmp_path):
    """Two worker processes, a passage each, gathered in passage order: the first passage's values
    are the single-process run's to the last digit, and the second is another passage."""
    eviction_fidelity.main([
        "--model-path", str(model_path), "--lengths", str(LENGTH), "--prompts-per-length", "2",
        "--positions-from", str(PROMPT), "--stride", str(STRIDE), "--kv-ratios", "0.3",
        "--evict-threshold", "64", "--presses", "", "--policies", "lethe", "--threads", "1",
        "--processes", "2", "--out-dir", str(tmp_path), "--results-md", str(tmp_path / "R.md"),
        "--per-position", str(tmp_path / "per-position.json"),
    ])  # fmt: skip
    spread = json.loads((tmp_path / "per-position.json").read_text())[str(LENGTH)]["methods"]
    alone = json.loads((run_dir / "per-position.json").read_text())[str(LENGTH)]["methods"]
    for metric in ("top1", "kl"):
        assert len(spread["lethe 0.3"][metric]) == 2
        assert spread["lethe 0.3"][metric][0] == alone["lethe 0.3"][metric][0], metric
    assert spread["lethe 0.3"]["kl"][1] != spread["lethe 0.3"]["kl"][0]


WORKER_OF_A_KILLED_RUN = """
import multiprocessing, os, time
from benchmarks.worker_pool import stop_with_parent

def worker(watching):
    stop_with_parent(poll_s=0.1)
    watching.set()
    time.sleep(120)  # a task of minutes

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    watching = context.Event()
    child = context.Process(target=worker, args=(watching,))
    child.start()
    assert watching.wait(60), "the worker did not start"
    print(child.pid, flush=True)
    os._exit(0)  # the parent gone at once, as when killed
"""


def test_a_worker_stops_once_its_run_is_killed(tmp_path):
    (tmp_path / "run.py").write_text(WORKER_OF_A_KILLED_RUN)  # spawn re-imports it in the worker
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(tmp_path / "run.py")], cwd=root, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                         timeout=120, check=True)  # fmt: skip
    status = Path(f"/proc/{int(out.stdout)}/status")
    assert status.exists()  # the worker outlived its parent
    deadline = time.monotonic() + 20
    while status.exists() and "State:\tZ" not in status.read_text():
        assert time.monotonic() < deadline, "the orphaned worker is still running"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "text, message",
    [("full", "neither evicts nor selects"), ("lethe:{oops", "not JSON"), ("lethe:[1]", "JSON object"),
     ("lethe:{\"max_kv_ratio\": 2}", "max_kv_ratio")],
)  # fmt: skip
def test_policies_that_evict_nothing_or_bad_parameters_are_refused(text, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        eviction_fidelity.main(["--policies", text, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--policies" in err and message in err, err


def test_more_passages_than_the_texts_give_are_refused(tmp_path, capsys, model_path):
    """A passage measured twice would count its positions twice: past each file's start only
    whole windows further into a file are taken, and asking for more exits 2."""
    (tmp_path / "a.txt").write_text("a is a letter. " * 30)  # 150 tokens: one 64-token window more
    (tmp_path / "b.txt").write_text("b is a letter. " * 20)  # 100: its start only
    argv = ["--text-dir", str(tmp_path), "--presses", "", "--policies", "lethe"]
    argv += ["--lengths", "64", "--positions-from", "32", "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit:
        eviction_fidelity.main([*argv, "--prompts-per-length", "4"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--prompts-per-length 4" in err and "3 distinct" in err, err
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    a = tokenizer((tmp_path / "a.txt").read_text(), add_special_tokens=False)["input_ids"]
    prompts, _ = at.natural_text_prompts(tokenizer, [64] * 3, tmp_path)
    assert prompts[0] == a[:64] and prompts[2] == a[64:128]  # a's next window, after b's start
    assert prompts[1][:5] != prompts[0][:5]
    assert at.passage_starts([150, 100], 64, first_file=1) == [(1, 0), (0, 0), (0, 64)]
    assert at.passage_starts([300], 100) == [(0, 0), (0, 100), (0, 200)]


@pytest.fixture(scope="module")
def passage(model_path):
    pytest.importorskip("kvpress")
    model = ag.load_model(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    (ids,), _ = at.natural_text_prompts(tokenizer, [LENGTH])
    positions = list(range(PROMPT, LENGTH, STRIDE))
    return model, ag.Passage.prefill(model, ids, positions, hidden_states=True)


def reads_of(model, name: str, kv_ratio: float = 0.3):
    from sglang_ext.tools import kvpress_reads as kr

    return kr.KvpressReads(model, kr.make_press(name, INTERVAL), kv_ratio, PROMPT, INTERVAL)


@torch.inference_mode()
def test_streaming_llm_keeps_its_sinks_and_window_by_kvpress_definition(passage):
    model, text = passage
    reads = reads_of(model, "streaming_llm")
    reads.advance(text, PROMPT)
    # the prompt's compression: the 4 sinks and the most recent of the int(128 * 0.3) = 38 kept
    prompt_kept = set(range(4)) | set(range(PROMPT - 34, PROMPT))
    for layer in range(model.config.num_hidden_layers):
        for head in reads.held(layer):
            assert set(head.tolist()) == prompt_kept
    # a decode compression keeps the cache's first 4 entries and its last (int(144 * 0.3) - 4);
    # the cache's order is topk's from the last compression on, not the positions'
    step = PROMPT + INTERVAL - 1
    reads.advance(text, step)
    cache = torch.cat([reads.held(0), torch.full((reads.held(0).shape[0], 1), step)], dim=1)
    reads.advance(text, step + 1)
    n_kept = int((step + 1) * 0.3)
    for head, kept in zip(cache, reads.held(0)):
        assert set(kept.tolist()) == set(head[:4].tolist()) | set(head[4 - n_kept :].tolist())


def cached_positions(cache_keys: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[kv_heads, n]: the passage position of each key in a kvpress cache (its nearest key)."""
    distance = torch.cdist(cache_keys, keys, compute_mode="donot_use_mm_for_euclid_dist")
    assert float(distance.min(-1).values.max()) < 1e-3  # each is one of the passage's keys
    return distance.argmin(-1)


@pytest.mark.parametrize("name", ["snapkv", "expected_attention", "streaming_llm"])
@torch.inference_mode()
def test_the_driving_keeps_what_kvpress_own_hooks_keep(passage, name):
    """kvpress's own PrefillDecodingPress over the same tokens, teacher-forced: after the prompt
    every layer's cache holds what the reads hold, in the same order; after decode compressions
    layer 0 still does (above it kvpress's decoded tokens see a compressed cache, where the
    reads keep full attention's)."""
    from kvpress import CompressionRatioDecodingPress, PrefillDecodingPress

    from sglang_ext.tools.kvpress_reads import make_press

    model, text = passage
    reads = reads_of(model, name)
    own = make_press(name, INTERVAL)  # a press of its own: the reads set their press's ratio
    decoding = CompressionRatioDecodingPress(
        base_press=own, target_compression_ratio=0.7, compression_interval=INTERVAL
    )
    own.compression_ratio = 0.7
    press = PrefillDecodingPress(prefilling_press=own, decoding_press=decoding)
    cache, ids = DynamicCache(), torch.tensor([text.ids])
    last = PROMPT + 2 * INTERVAL - 1  # two decode compressions
    with press(model):
        # transformers 5.12 passes no cache_position, which kvpress's hooks read: given by hand
        model(input_ids=ids[:, :PROMPT], past_key_values=cache, cache_position=torch.arange(PROMPT))
        reads.advance(text, PROMPT)
        for layer in range(model.config.num_hidden_layers):
            held = cached_positions(cache.layers[layer].keys[0], text.keys[layer])
            assert torch.equal(held, reads.held(layer)), layer
        for position in range(PROMPT, last + 1):
            model(
                input_ids=ids[:, position : position + 1], past_key_values=cache,
                position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([cache.get_seq_length()]),
            )  # fmt: skip
    reads.advance(text, last + 1)
    held = cached_positions(cache.layers[0].keys[0], text.keys[0])
    assert held.shape[1] == int((last + 1) * 0.3)
    assert torch.equal(held, reads.held(0))


@pytest.mark.parametrize("per_kv_head", [True, False])
@torch.inference_mode()
def test_our_snapkv_keeps_what_kvpress_snapkv_keeps_entry_for_entry(passage, per_kv_head):
    """The port, checked entry by entry: `snapkv` on Lethe's runtime, with kvpress's window (one
    query short of the interval), keeps in every list what kvpress's SnapKV keeps, driven plainly
    (``plain``: its window queries at their own positions, ties in cache order), at the prompt's
    compression and two decode compressions; its lists are in kvpress's order after the prompt's.
    Per KV head, and with one list per layer as kvpress's scores averaged over heads."""
    from sglang_ext.policies import build_policy
    from sglang_ext.policies.calibration import model_fingerprint
    from sglang_ext.tools import kvpress_reads as kr

    model, text = passage
    num_layers = model.config.num_hidden_layers
    theirs = kr.KvpressReads(
        model, kr.make_press("snapkv", INTERVAL), 0.3, PROMPT, INTERVAL,
        one_list_per_layer=not per_kv_head, plain=True,
    )  # fmt: skip
    params = {"compression_ratio": 0.7, "compression_interval": INTERVAL,
              "window_size": INTERVAL - 1, "per_kv_head": per_kv_head}  # fmt: skip
    ctx = at.cpu_context(num_layers, model_fingerprint(model.config))
    ours = ag.decoded_reads(build_policy("snapkv", params).for_model(ctx), num_layers, PROMPT)
    for position in (PROMPT, PROMPT + INTERVAL, PROMPT + 2 * INTERVAL):  # before each step
        theirs.advance(text, position)
        ours.advance(text, position)
        runtime, heads = ours._runtime, ours._runtime.lists_per_layer
        for layer in range(num_layers):
            for head, kept in enumerate(theirs.held(layer)[:heads]):
                i = layer * heads + head
                held = runtime.positions[i, ours.ROW, : runtime.count[i, ours.ROW]]
                assert int(held[-1]) == position  # the step's own token, then the kept
                if position == PROMPT:
                    assert held[:-1].tolist() == kept.tolist(), (layer, head)
                assert sorted(held[:-1].tolist()) == sorted(kept.tolist()), (position, layer, head)


@torch.inference_mode()
def test_one_list_per_layer_keeps_the_same_entries_in_every_kv_head(passage):
    from sglang_ext.tools import kvpress_reads as kr

    model, text = passage
    per_head = reads_of(model, "snapkv")
    per_layer = kr.KvpressReads(
        model, kr.make_press("snapkv", INTERVAL), 0.3, PROMPT, INTERVAL, one_list_per_layer=True
    )
    step = PROMPT + 2 * INTERVAL  # after two decode compressions
    per_head.advance(text, step)
    per_layer.advance(text, step)
    layer = model.config.num_hidden_layers - 1
    shared, own = per_layer.held(layer), per_head.held(layer)
    assert shared.shape == own.shape  # the same count kept
    assert all(torch.equal(head, shared[0]) for head in shared)
    assert not all(torch.equal(head.sort().values, own[0].sort().values) for head in own)


@torch.inference_mode()
def test_by_position_leaves_the_same_entries_in_position_order(passage):
    """kvpress's cache after a compression is in its top-k's order; ``by_position`` keeps it by
    position: the first compression keeps the same entries, and they are what differ after."""
    from sglang_ext.tools import kvpress_reads as kr

    model, text = passage
    own = reads_of(model, "snapkv")
    positional = kr.KvpressReads(
        model, kr.make_press("snapkv", INTERVAL), 0.3, PROMPT, INTERVAL, by_position=True
    )
    own.advance(text, PROMPT + 1)  # the prompt compressed, nothing decoded since
    positional.advance(text, PROMPT + 1)
    layer = model.config.num_hidden_layers - 1
    ranked, ordered = own.held(layer), positional.held(layer)
    assert torch.equal(ranked.sort(1).values, ordered)
    assert not torch.equal(ranked, ordered)  # top-k's order is not by position


def test_a_methods_top1_and_kl_are_paired_with_the_first_press_at_the_nearest_kept_fraction():
    """Passage by passage against the reference run whose KV kept is nearest: the mean
    difference and its 95 % half-width (Student's t over the passages' mean differences); no
    pairing for the reference, a read that keeps everything, or a context the reference did not
    run at; no half-width from one passage."""
    reference = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])  # [passages, positions]
    ones, zeros = torch.ones(3, 2), torch.zeros(3, 2)
    results = {
        ("kvpress-snapkv", "0.3", 64): (reference, 0.1 * ones, [0.3, 0.3]),
        ("kvpress-snapkv", "0.5", 64): (ones, zeros, [0.5, 0.5]),
        ("lethe", "0.27", 64): (torch.tensor([[1.0, 0], [1, 1], [1, 1]]), 0.2 * ones, [0.3, 0.32]),
        ("h2o", "compression_ratio 0.5", 64): (zeros, zeros, [0.52, 0.5]),
        ("full", "", 64): (ones, zeros, []),
        ("lethe", "0.3", 128): (ones, zeros, [0.3]),
        ("kvpress-snapkv", "0.3", 32): (ones[:1], zeros[:1], [0.3]),
        ("lethe", "0.3", 32): (zeros[:1], zeros[:1], [0.3]),
    }
    values = eviction_fidelity.means(results, "kvpress-snapkv")
    lethe = values["lethe", "0.27", 64]
    # against the run keeping 0.3, the nearer: per passage -0.5, +0.5, 0 (std 0.5)
    t = 4.302652729749464  # Student's t, 97.5 % quantile, 2 degrees of freedom
    assert lethe["top1_minus_reference"] == pytest.approx(0.0)
    assert lethe["top1_minus_reference_ci95"] == pytest.approx(t * 0.5 / 3**0.5)
    assert lethe["kl_minus_reference"] == pytest.approx(0.1)
    assert lethe["kl_minus_reference_ci95"] == pytest.approx(0.0, abs=1e-12)
    h2o = values["h2o", "compression_ratio 0.5", 64]  # no kv ratio in its label: by what it kept
    assert h2o["top1_minus_reference"] == pytest.approx(-1.0)
    unpaired = [("kvpress-snapkv", "0.5", 64), ("full", "", 64), ("lethe", "0.3", 128)]
    for key in unpaired:
        assert "top1_minus_reference" not in values[key], key
        assert "kl_minus_reference" not in values[key], key
    one_passage = values["lethe", "0.3", 32]
    assert one_passage["top1_minus_reference"] == -1.0
    assert "top1_minus_reference_ci95" not in one_passage
    table = eviction_fidelity.markdown(values)
    assert "| +0.000 ± 1.242 |" in table and "| +0.100 ± 0.000 |" in table  # lethe's
    assert "| -1.000 |" in table  # one passage: no half-width
