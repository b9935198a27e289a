"""``python -m sglang_ext.calibrate``: measure a model's decode attention and choose the layer lists
of ``delta`` and ``tidal`` for it, written where the policies look for them (policies/calibration).

It decodes a few long natural-text prompts greedily under full attention
(sglang_ext.attention_trace) and measures per layer:

- **attention shift** (DELTA, Appendix D): at each decode step, each layer's attention
  probabilities of all query heads flattened into one vector a_l; shift(l) = 1 - cos(a_{l-1}, a_l),
  the mean over steps and prompts. Also recorded: the same on DELTA's token scores (max over heads),
  which is what its selection ranks by.
- **top-k recall per re-selection layer** (TidalDecode, Fig. 2b): for each candidate R, with tokens
  selected at layer 2 and re-selected at R by the policy's own rule, the overlap of the tokens a
  sparse layer reads with that layer's own top-k (same score, q·k max over heads, k =
  --budget-tokens), mean over sparse layers, steps and prompts.

Choice, after full layers [0, 1] (both papers):

- DELTA: layer 2 is the first Δ-layer (Sec. 5.1). The paper takes the later ones "with large shifts
  while ensuring that they are well distributed across the network depth"; here that rule is made
  exact: layers 3..L-1 are cut into num_delta_layers - 1 contiguous spans of equal depth and each
  span contributes its layer of largest shift. The paper's published choices ([2, 14, 22] and
  [2, 14, 23] of 28, [2, 8, 31] of 32, [2, 6, 42] of 48) each put one later Δ-layer in each half.
- TidalDecode: selection layers [2, R] with R of highest recall (the peak of Fig. 2b).

    python -m sglang_ext.calibrate [--model-path P] [--prompts 2048,3072,4096] [--decode-steps 32]
        [--budget-tokens 256] [--num-delta-layers 3] [--out FILE.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_ext import attention_trace as at
from sglang_ext.policies import build_policy
from sglang_ext.policies.calibration import FORMAT, calibration_dir, model_fingerprint

FULL_LAYERS = [0, 1]
FIRST_SELECTION_LAYER = 2


def layer_shift(previous: torch.Tensor, current: torch.Tensor) -> float:
    """1 - cosine similarity of two layers' attention maps, each flattened into one vector."""
    return 1.0 - float(F.cosine_similarity(previous.flatten(), current.flatten(), dim=0))


def topk_overlap(read: torch.Tensor, top_k: torch.Tensor) -> float:
    """|read ∩ top_k| / |top_k| for token positions (TidalDecode's recall, Fig. 2b)."""
    return float(torch.isin(top_k, read).float().mean())


def tidal_policy(reselection_layer: int, budget_tokens: int, recent_tokens: int = 1):
    return build_policy(
        "tidal",
        {
            "full_layers": FULL_LAYERS,
            "selection_layers": [FIRST_SELECTION_LAYER, reselection_layer],
            "budget_tokens": budget_tokens,
            "recent_tokens": recent_tokens,
        },
    )


def measure(trace: at.DecodeTrace, budget_tokens: int) -> dict[str, list[float | None]]:
    """One trace's per-layer measurements, means over its decode steps; None where undefined
    (no previous layer; not a candidate re-selection layer)."""
    num_layers = trace.num_layers
    candidates = range(FIRST_SELECTION_LAYER + 1, num_layers)
    rule = at.selection_rule(tidal_policy(candidates[0], budget_tokens), num_layers)
    truth_rule = at.selection_rule(tidal_policy(candidates[0], budget_tokens, 0), num_layers)
    sources = {
        r: at.selection_sources(tidal_policy(r, budget_tokens), num_layers) for r in candidates
    }
    shift, score_shift, recall = torch.zeros(num_layers), torch.zeros(num_layers), {}
    for step, seq_len in enumerate(trace.seq_lens):
        logits = [trace.logits(step, layer) for layer in range(num_layers)]
        probs = [torch.softmax(layer_logits, dim=-1) for layer_logits in logits]
        for layer in range(1, num_layers):
            shift[layer] += layer_shift(probs[layer - 1], probs[layer])
            score_shift[layer] += layer_shift(probs[layer - 1].amax(0), probs[layer].amax(0))
        selected, top_k = {}, {}
        for layer in range(FIRST_SELECTION_LAYER, num_layers):
            scores = at.TOKEN_SCORES["tidal"](logits[layer])
            selected[layer] = at.choose_tokens(rule, scores, seq_len)
            top_k[layer] = at.choose_tokens(truth_rule, scores, seq_len)
        for r, by_layer in sources.items():
            overlaps = [
                topk_overlap(selected[src], top_k[layer]) for layer, src in by_layer.items()
            ]
            recall[r] = recall.get(r, 0.0) + sum(overlaps) / len(overlaps)
    n = trace.num_steps
    return {
        "attention_shift": [None, *(shift[1:] / n).tolist()],
        "token_score_shift": [None, *(score_shift[1:] / n).tolist()],
        "tidal_topk_recall": [recall[r] / n if r in recall else None for r in range(num_layers)],
    }


def mean_measurements(per_trace: list[dict]) -> dict[str, list[float | None]]:
    """Per layer, the mean over traces (each trace has the same number of steps)."""
    return {
        key: [
            None if values[0] is None else sum(values) / len(values)
            for values in zip(*(m[key] for m in per_trace))
        ]
        for key in per_trace[0]
    }


def choose_delta_layers(shift: list[float | None], num_delta_layers: int) -> list[int]:
    """Layer 2, then the largest-shift layer of each of num_delta_layers - 1 equal spans of
    layers 3..L-1."""
    later = list(range(FIRST_SELECTION_LAYER + 1, len(shift)))
    if not 1 <= num_delta_layers <= len(later) + 1:
        raise ValueError(f"num_delta_layers must be in [1, {len(later) + 1}]")
    spans = torch.tensor(later).tensor_split(num_delta_layers - 1) if num_delta_layers > 1 else []
    return [FIRST_SELECTION_LAYER] + [
        max(span.tolist(), key=lambda layer: shift[layer]) for span in spans
    ]


def choose_tidal_layers(recall: list[float | None]) -> list[int]:
    """Layer 2 and the re-selection layer of highest recall (the lowest such layer on a tie)."""
    candidates = [layer for layer, value in enumerate(recall) if value is not None]
    return [FIRST_SELECTION_LAYER, max(candidates, key=lambda layer: (recall[layer], -layer))]


def calibration(measurements: dict, num_delta_layers: int) -> dict:
    """The layer lists of both policies, chosen from the mean measurements."""
    return {
        "delta": {
            "full_layers": FULL_LAYERS,
            "delta_layers": choose_delta_layers(measurements["attention_shift"], num_delta_layers),
        },
        "tidal": {
            "full_layers": FULL_LAYERS,
            "selection_layers": choose_tidal_layers(measurements["tidal_topk_recall"]),
        },
    }


def model_slug(model_path: Path) -> str:
    return re.sub(r"[^a-z0-9]+", "-", model_path.name.lower()).strip("-")


def plot(data: dict, path: Path) -> Path:
    """Shift per layer and recall per re-selection layer, the chosen layers marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = data["measurements"]
    fig, (shift_ax, recall_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    curves = {
        "attention_shift": "all heads (Appendix D)",
        "token_score_shift": "max over heads (DELTA's token score)",
    }
    for key, label in curves.items():
        points = [(layer, v) for layer, v in enumerate(m[key]) if v is not None]
        shift_ax.plot(*zip(*points), marker=".", label=label)
    for layer in data["delta"]["delta_layers"]:
        shift_ax.axvline(layer, color="red", alpha=0.4, linestyle="--")
    shift_ax.set(
        title=f"attention shift; Δ-layers {data['delta']['delta_layers']} (dashed)",
        xlabel="layer l (pair l-1, l)",
        ylabel="1 - cos",
    )
    points = [(layer, v) for layer, v in enumerate(m["tidal_topk_recall"]) if v is not None]
    recall_ax.plot(*zip(*points), marker="o")
    chosen = data["tidal"]["selection_layers"][-1]
    recall_ax.axvline(chosen, color="red", alpha=0.4, linestyle="--")
    recall_ax.set(
        title=f"TidalDecode top-{m['tidal_budget_tokens']} recall; selection layers "
        f"{data['tidal']['selection_layers']}",
        xlabel="re-selection layer R",
        ylabel="recall in sparse layers",
    )
    for ax in (shift_ax, recall_ax):
        ax.grid(alpha=0.3)
    shift_ax.legend(fontsize=8)
    source = data["source"]
    fig.suptitle(
        f"calibration · {source['model']} · prompts of {source['prompts_tokens']} tokens · "
        f"{source['decode_steps']} decode steps"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.calibrate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-path", type=Path, default=None, help="HF folder (default: SmolLM2)"
    )
    parser.add_argument(
        "--prompts",
        default="2048,3072,4096",
        help="comma-separated lengths in tokens, one natural-text prompt each",
    )
    parser.add_argument("--text-dir", type=Path, default=at.SEED_TEXT_DIR)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--budget-tokens", type=int, default=256, help="k of TidalDecode's top-k")
    parser.add_argument("--num-delta-layers", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: <calibration dir>/<model>.json"
    )
    parser.add_argument("--plot", type=Path, default=None, help="also write this PNG")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sglang_ext.model import default_model_path

    model_path = args.model_path or default_model_path()
    lengths = [int(part) for part in args.prompts.split(",") if part]
    prompts, prompt_source = at.natural_text_prompts(
        AutoTokenizer.from_pretrained(str(model_path)), lengths, args.text_dir
    )
    model = at.load_model(model_path)
    per_trace = []
    for ids in prompts:
        start = time.perf_counter()
        trace = at.trace_decode(model, ids, args.decode_steps)
        per_trace.append(measure(trace, args.budget_tokens))
        elapsed = time.perf_counter() - start
        print(f"calibrate: {len(ids)}-token prompt in {elapsed:.0f} s", file=sys.stderr, flush=True)
    measurements = {**mean_measurements(per_trace), "tidal_budget_tokens": args.budget_tokens}
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    data = {
        "format": FORMAT,
        "model": model_fingerprint(model.config),
        **calibration(measurements, args.num_delta_layers),
        "measurements": measurements,
        "source": {
            "model": model_path.name,
            "prompts": prompt_source,
            "prompts_tokens": lengths,
            "decode_steps": args.decode_steps,
            "date": now.isoformat().replace("+00:00", "Z"),
            "command": shlex.join(["python", "-m", "sglang_ext.calibrate", *argv]),
        },
    }
    out = args.out or calibration_dir() / f"{model_slug(model_path)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"calibrate: delta {data['delta']}, tidal {data['tidal']} -> {out}", flush=True)
    if args.plot:
        print(f"calibrate: plot {plot(data, args.plot)}", flush=True)
    return out


if __name__ == "__main__":
    main()
