"""``python -m sglang_ext.tools.calibrate``: measure a model's decode attention and choose the layer lists
of ``delta`` and ``tidal`` for it, written where the policies look for them (policies/calibration).

It decodes a few long natural-text prompts greedily under full attention
(sglang_ext.tools.attention_trace) and measures per layer:

- **attention shift** (DELTA, Appendix D): at each decode step, each layer's attention
  probabilities of all query heads flattened into one vector a_l; shift(l) = 1 - cos(a_{l-1}, a_l),
  the mean over steps and prompts. Also recorded: the same on DELTA's token scores (max over heads),
  which is what its selection ranks by.
- **top-k recall per re-selection layer** (TidalDecode, Fig. 2b): for each candidate R, with tokens
  selected at layer 2 and re-selected at R by the policy's own rule, the overlap of the tokens a
  sparse layer reads with that layer's own top-k (same score, Tidal's default, k =
  --budget-tokens), mean over sparse layers, steps and prompts.

Choice by what the layers do to the model's output: the teacher-forced next-token agreement with
full attention (sglang_ext.tools.agreement) on other text than the measurements'
(``--agreement-first-text``), at a ``--agreement-budget-tokens`` budget. From full layers [0, 1]
and the first selection at layer 2 (both papers), later selection layers are added one at a time,
each the layer whose addition gives the lowest mean KL(full ‖ policy): DELTA to
``--num-delta-layers``, Tidal one re-selection layer. The same from full layer [0] and the first
selection at layer 1, with one selection layer more (as many layers read the whole cache); that
start wins where its KL is ``START_MARGIN`` lower than the papers'. Layers are chosen by the
agreement measure itself, not by the proxies above (layer shift, top-k overlap), whose choices
the agreement benchmark found far from full attention.

    python -m sglang_ext.tools.calibrate [--model-path P] [--prompts 2048,3072,4096] [--decode-steps 32]
        [--budget-tokens 256] [--num-delta-layers 3] [--agreement-prompts 4096,4096]
        [--agreement-budget-tokens 1024] [--out FILE.json] [--plot FILE.png]
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

from sglang_ext.tools import agreement as ag
from sglang_ext.tools import attention_trace as at
from sglang_ext.policies import build_policy, policy_class
from sglang_ext.policies.calibration import FORMAT, calibration_dir, model_fingerprint

FULL_LAYERS = [0, 1]  # both papers'; the measurements' proxies select from layer 2 after them
FIRST_SELECTION_LAYER = 2
# (full layers, the first selection layer, selection layers beyond the policy's count): both
# read the whole cache at as many layers, so they decode at about the same speed
STARTS = ((FULL_LAYERS, FIRST_SELECTION_LAYER, 0), ([0], 1, 1))
# Another start replaces the papers' only with a KL this much lower: a smaller lead on the
# calibration's text need not hold on other text
START_MARGIN = 0.10


def layer_shift(previous: torch.Tensor, current: torch.Tensor) -> float:
    """1 - cosine similarity of two layers' attention maps, each flattened into one vector."""
    return 1.0 - float(F.cosine_similarity(previous.flatten(), current.flatten(), dim=0))


def topk_overlap(read: torch.Tensor, top_k: torch.Tensor) -> float:
    """|read ∩ top_k| / |top_k| for token positions (TidalDecode's recall, Fig. 2b)."""
    return float(torch.isin(top_k, read).float().mean())


def tidal_policy(reselection_layer: int, budget_tokens: int, exact_top_k: bool = False):
    """Tidal with its default recent and sink tokens, or choosing the plain top-k by its score."""
    exact = {"recent_tokens": 0, "sink_tokens": 0} if exact_top_k else {}
    return build_policy(
        "tidal",
        {
            "full_layers": FULL_LAYERS,
            "selection_layers": [FIRST_SELECTION_LAYER, reselection_layer],
            "budget_tokens": budget_tokens,
            **exact,
        },
    )


def measure(trace: at.DecodeTrace, budget_tokens: int) -> dict[str, list[float | None]]:
    """One trace's per-layer measurements, means over its decode steps; None where undefined
    (no previous layer; not a candidate re-selection layer)."""
    num_layers = trace.num_layers
    candidates = range(FIRST_SELECTION_LAYER + 1, num_layers)
    rule_policy = tidal_policy(candidates[0], budget_tokens)
    rule = at.selection_rule(rule_policy, num_layers)
    truth_rule = at.selection_rule(tidal_policy(candidates[0], budget_tokens, True), num_layers)
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
            scores = at.TOKEN_SCORES[rule_policy.score](logits[layer])
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


def agreement_passages(model_path: Path, tokenizer, args) -> tuple[object, list[ag.Passage], str]:
    """The texts the layer choice is measured on, prefilled, with every --agreement-stride-th
    position from a quarter of each measured."""
    lengths = [int(part) for part in args.agreement_prompts.split(",") if part]
    texts, source = at.natural_text_prompts(
        tokenizer, lengths, args.text_dir, first_file=args.agreement_first_text
    )
    model = ag.load_model(model_path)
    passages = [
        ag.Passage.prefill(model, ids, list(range(len(ids) // 4, len(ids), args.agreement_stride)))
        for ids in texts
    ]
    return model, passages, source


def choose_layers(model, passages: list[ag.Passage], args) -> tuple[dict, dict]:
    """Both policies' layer lists by agreement, and every candidate's mean KL. Each policy is
    chosen from two starts that read the whole cache at as many layers: full layers [0, 1] with
    the first selection at 2 (both papers), and full layer [0] with the first selection at 1 and
    one more selection layer later; the papers' start unless the other's greedy choice has a
    KL ``START_MARGIN`` lower."""
    counts = {"delta": args.num_delta_layers, "tidal": 2}
    chosen, tried = {}, {}
    for name, count in counts.items():
        cls = policy_class(name)
        budget = cls.for_token_budget(args.agreement_budget_tokens)
        tried[name], best = {}, None
        for full_layers, first, extra in STARTS:

            def make(layers, name=name, cls=cls, budget=budget, full_layers=full_layers):
                return build_policy(
                    name, {**budget, "full_layers": full_layers, cls.selection_field: layers}
                )

            layers, kls = ag.greedy_layers(model, passages, make, [first], count + extra)
            tried[name].update(kls)  # distinct keys: each start's lists begin at its own layer
            if best is None or kls[str(layers)] < best[0] * (1 - START_MARGIN):
                best = kls[str(layers)], {"full_layers": full_layers, cls.selection_field: layers}
        chosen[name] = best[1]
    return chosen, tried


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
        prog="python -m sglang_ext.tools.calibrate", description=__doc__.split("\n\n")[0]
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
        "--agreement-prompts",
        default="4096,4096",
        help="lengths of the texts the layer choice is measured on, one each",
    )
    parser.add_argument(
        "--agreement-first-text",
        type=int,
        default=3,
        help="the text file the first of them starts with (3: not the benchmarks' texts)",
    )
    parser.add_argument("--agreement-stride", type=int, default=128, help="every n-th position")
    parser.add_argument("--agreement-budget-tokens", type=int, default=1024)
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
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts, prompt_source = at.natural_text_prompts(tokenizer, lengths, args.text_dir)
    model, passages, agreement_source = agreement_passages(model_path, tokenizer, args)
    chosen, agreement_kl = choose_layers(model, passages, args)
    model = at.load_model(model_path)
    per_trace = []
    for ids in prompts:
        start = time.perf_counter()
        trace = at.trace_decode(model, ids, args.decode_steps)
        per_trace.append(measure(trace, args.budget_tokens))
        elapsed = time.perf_counter() - start
        print(f"calibrate: {len(ids)}-token prompt in {elapsed:.0f} s", file=sys.stderr, flush=True)
    measurements = {
        **mean_measurements(per_trace),
        "tidal_budget_tokens": args.budget_tokens,
        "agreement_kl": agreement_kl,
        "agreement_budget_tokens": args.agreement_budget_tokens,
    }
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    data = {
        "format": FORMAT,
        "model": model_fingerprint(model.config),
        **chosen,
        "measurements": measurements,
        "source": {
            "model": model_path.name,
            "prompts": prompt_source,
            "prompts_tokens": lengths,
            "agreement_prompts": agreement_source,
            "decode_steps": args.decode_steps,
            "date": now.isoformat().replace("+00:00", "Z"),
            "command": shlex.join(["python", "-m", "sglang_ext.tools.calibrate", *argv]),
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
