"""Attention recall of DELTA and TidalDecode in their sparse layers (DELTA's Eq. 9): the attention
mass, per query head, of the tokens a sparse layer is allowed to read, mean over heads, decode steps
and prompts; per policy, token budget and prompt length, and per layer. CPU, real model weights.

    python -m benchmarks.recall --lengths 4096,7500 --budgets 256,512,1024 --decode-steps 16

Each prompt (natural text, exactly the given length in tokens) is decoded greedily under full
attention (sglang_ext.tools.attention_trace); each policy's own selection then runs on that trace with the
layer lists the engine would use: the model's calibration file, else the papers' layers scaled to
its depth. A budget of B tokens is B/16 pages with B/128 recent pages for DELTA (the paper's ratio:
64 pages, 8 recent) and B tokens with the decoded token kept for TidalDecode.

Every layer's query comes from the full-attention residual stream, an oracle on hidden states: the
recall is what the selection rule keeps of full attention, not of a sparse run whose own errors
compound; the selection rule itself is the engine's. Full attention's recall is 1 by definition, so
the rows carry no baseline or ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import RunInfo
from benchmarks.plot_recall import plot_recall
from sglang_ext.tools import attention_trace as at
from sglang_ext.tools.calibrate import model_slug
from sglang_ext.policies import build_policy, policy_class
from sglang_ext.policies.calibration import find_calibration, model_fingerprint

BENCH = "recall"


def build_parser() -> argparse.ArgumentParser:
    parser = harness.trace_parser(BENCH, __doc__, lengths=[4096, 7500], decode_steps=16)
    parser.add_argument("--budgets", type=harness.int_list, default=[256, 512, 1024])
    return parser


def policies_for(budget: int, ctx) -> dict[str, object]:
    """Both policies at a budget of ``budget`` tokens, layer lists resolved as the engine does."""
    return {
        name: build_policy(name, policy_class(name).for_token_budget(budget)).for_model(ctx)
        for name in ("delta", "tidal")
    }


def layer_recalls(trace: at.DecodeTrace, policies: dict) -> dict:
    """key -> recall per layer (None where not sparse), mean over heads and the trace's steps."""
    selections = {key: at.replay(trace, policy) for key, policy in policies.items()}
    sums = {key: [0.0] * trace.num_layers for key in policies}
    for step in range(trace.num_steps):
        for layer in range(trace.num_layers):
            probs = None
            for key, steps in selections.items():
                if layer in steps[step]:
                    probs = trace.probs(step, layer) if probs is None else probs
                    sums[key][layer] += at.attention_recall(probs, steps[step][layer])
    sparse = {key: set(steps[0]) for key, steps in selections.items()}
    return {
        key: [v / trace.num_steps if layer in sparse[key] else None for layer, v in enumerate(s)]
        for key, s in sums.items()
    }


def mean_curves(curves: list[list[float | None]]) -> list[float | None]:
    return [None if v[0] is None else sum(v) / len(v) for v in zip(*curves)]


def mean_sparse(curve: list[float | None]) -> float:
    values = [v for v in curve if v is not None]
    return sum(values) / len(values) if values else math.nan


def measure(model, tokenizer, policies: dict, args) -> tuple[dict, str]:
    """(policy, budget, length) -> recall per layer, mean over prompts; and the prompts' source."""
    per_layer, prompt_source = {}, ""
    for length in args.lengths:
        prompts, prompt_source = at.natural_text_prompts(
            tokenizer, [length] * args.prompts_per_length, args.text_dir
        )
        curves = {key: [] for key in policies}
        for ids in prompts:
            start = time.perf_counter()
            trace = at.trace_decode(model, ids, args.decode_steps)
            for key, curve in layer_recalls(trace, policies).items():
                curves[key].append(curve)
            elapsed = time.perf_counter() - start
            print(f"{BENCH}: {length}-token prompt in {elapsed:.0f} s", flush=True)
        for (name, budget), curve_list in curves.items():
            per_layer[(name, budget, length)] = mean_curves(curve_list)
    return per_layer, prompt_source


def notes(args, model_name: str, prompt_source: str, policies: dict, calibration) -> list[str]:
    """What the RESULTS.md section needs beyond the table: the setup, the layers, the caveats."""
    layers = {
        name: {"full_layers": policy.full_layers, policy.selection_field: policy.selecting_layers()}
        for (name, _), policy in policies.items()
    }
    origin = f"`{Path(calibration['path']).name}`" if calibration else "the papers (no calibration)"
    return [
        (
            f"- model: {model_name} (real weights), transformers fp32 on the CPU; "
            f"{args.prompts_per_length} prompt(s) per length, {args.decode_steps} greedy decode "
            f"steps each; prompts: {prompt_source}"
        ),
        f"- layers: {json.dumps(layers)}, from {origin}",
        (
            "- value: DELTA's Eq. 9 recall, the attention mass (per head, under full attention) of "
            "the tokens a sparse layer reads, mean over heads, sparse layers, steps and prompts; "
            "DELTA reads B/16 pages (B/128 recent), TidalDecode B tokens (the decoded one kept). "
            "Full attention's recall is 1 by definition, hence no vanilla value or ratio."
        ),
        (
            "- oracle: every layer's query comes from the full-attention residual stream (an "
            "upper-bound-style oracle on hidden states); the selection rule is the engine's own."
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    model = at.load_model(model_path)
    fingerprint = model_fingerprint(model.config)
    ctx = at.cpu_context(model.config.num_hidden_layers, fingerprint)
    policies = {
        (name, budget): policy
        for budget in args.budgets
        for name, policy in policies_for(budget, ctx).items()
    }
    info, shape = RunInfo.detect(on_cpu=True), model_slug(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    per_layer, prompt_source = measure(model, tokenizer, policies, args)
    rows = [
        info.row(
            bench=BENCH,
            policy=name,
            model_shape=shape,
            batch=1,
            context=length,
            metric=f"attention_recall_budget_{budget}",
            value=mean_sparse(curve),
        )
        for (name, budget, length), curve in sorted(per_layer.items())
    ]
    json_path = harness.save_results(BENCH, shape, rows, info, args.out_dir, args.results_md)
    layers_path = json_path.with_name(f"{json_path.stem}-layers.json")
    curves = [
        {"policy": name, "budget_tokens": budget, "context": length, "recall_per_layer": curve}
        for (name, budget, length), curve in sorted(per_layer.items())
    ]
    layers_path.write_text(json.dumps(curves, indent=1) + "\n")
    title = f"attention recall in sparse layers · {model_path.name} · {info.device}"
    png = plot_recall(per_layer, title, json_path.with_suffix(".png"))
    lines = notes(args, model_path.name, prompt_source, policies, find_calibration(fingerprint))
    lines.append(f"- per-layer curves: `{layers_path.name}`; plot: `{png.name}`")
    with open(args.results_md, "a") as md:
        md.write("\n".join(lines) + "\n\n")
    print(f"per-layer curves: {layers_path}\nplot: {png}", flush=True)


if __name__ == "__main__":
    main()
