"""Lethe's quality against full attention in the same run, on the real engine with
SmolLM2-135M-Instruct's real weights, over a grid of sparse_ratio x recent_ratio (Lethe Tables
5-6): one server per configuration, the same greedy requests one at a time.

    python -m benchmarks.lethe_quality --sparse-ratios 100,400 --recent-ratios 0.1,0.3

Per configuration: lookup accuracy (benchmarks.lookup_task) over the cases full attention passes;
greedy agreement with full attention (identical prefix, fraction of equal tokens) on natural-text
prompts; and the KV each request kept and what its decode steps then read, from the servers'
round log lines (retained slots, and its layers' mean list, over positions at a request's last
round, averaged over requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from pathlib import Path

from benchmarks import harness, lookup_task, quality
from benchmarks.harness import RunInfo

BENCH = "lethe_quality"
ROUND = re.compile(
    r"lethe round \d+ of (\w+): (\d+) positions, .* retained (\d+) \(.*"
    r"retained per list \[([\d, ]+)\]"
)


@dataclasses.dataclass(frozen=True)
class LetheRun:
    """One server: full attention (params None) or lethe with ``params``."""

    params: dict | None

    @property
    def policy(self) -> str:
        return quality.FULL if self.params is None else "lethe"

    @property
    def config(self) -> dict | None:
        return self.params

    @property
    def label(self) -> str:
        if self.params is None:
            return quality.FULL
        return "lethe-" + "-".join(f"{k}{v}" for k, v in sorted(self.params.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{BENCH}", description=__doc__)
    parser.add_argument(
        "--sparse-ratios", type=_ratio_list, default=[100.0, 400.0],
        help="comma-separated; 'none' is one retained set for every layer (per_layer false)",
    )
    parser.add_argument("--recent-ratios", type=_float_list, default=[0.1, 0.3])
    parser.add_argument(
        "--pack-layers", type=_bool_list, default=[True],
        help="comma-separated true/false: per-layer lists packed into shared slots (memory = "
        "the sum of the lists) or freed by the union; both compares them in one run",
    )  # fmt: skip
    parser.add_argument("--max-kv-ratio", type=float, default=0.3)
    parser.add_argument("--evict-threshold", type=int, default=256)
    parser.add_argument("--greedy-lengths", type=harness.int_list, default=[1024])
    parser.add_argument("--greedy-tokens", type=int, default=128)
    parser.add_argument("--lookup-lengths", type=harness.int_list, default=[1024, 2048])
    parser.add_argument("--lookup-depths", type=_float_list, default=[0.1, 0.5, 0.9])
    parser.add_argument("--seeds", type=int, default=1, help="lookup prompts per length and depth")
    parser.add_argument("--lookup-tokens", type=int, default=12)
    parser.add_argument("--seeds-dir", type=Path, default=quality.DEFAULT_SEEDS_DIR)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--server-args", default="")
    parser.add_argument("--threads", type=int, default=2, help="the engine's OMP_NUM_THREADS")
    parser.add_argument("--out-dir", type=Path, default=harness.DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=harness.DEFAULT_RESULTS_MD)
    parser.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: out-dir)")
    return parser


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _bool_list(text: str) -> list[bool]:
    values = {"true": True, "false": False}
    try:
        return [values[x.strip().lower()] for x in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true/false values, got {text!r}") from None


def _ratio_list(text: str) -> list[float | None]:
    return [None if x.strip() == "none" else float(x) for x in text.split(",")]


def grid(args) -> list[LetheRun]:
    # the paper's rule: rounds on Algorithm 1's threshold, no shared core
    base = {
        "max_kv_ratio": args.max_kv_ratio, "evict_threshold": args.evict_threshold,
        "round_interval": 0, "shared_ratio": 0.0,
    }  # fmt: skip
    runs = [LetheRun(None)]
    for s in args.sparse_ratios:
        packs = args.pack_layers if s is not None else [True]  # one set: nothing to pack
        for r in args.recent_ratios:
            for pack in packs:
                extra = {} if pack else {"pack_layers": False}
                if s is None:  # Lethe's default lists are per layer
                    extra["per_layer"] = False
                runs.append(LetheRun({**base, "sparse_ratio": s, "recent_ratio": r, **extra}))
    return runs


def last_round_fractions(log_text: str) -> tuple[float | None, float | None]:
    """Means over requests, at each request's last round, of the KV it kept (retained slots /
    positions) and of what a decode step then reads (its layers' mean list / positions)."""
    last = {}
    for m in ROUND.finditer(log_text):
        per_layer = [int(n) for n in m[4].split(",")]
        positions = int(m[2])
        last[m[1]] = (int(m[3]) / positions, statistics.fmean(per_layer) / positions)
    if not last:
        return None, None
    kept, attended = zip(*last.values())
    return statistics.fmean(kept), statistics.fmean(attended)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    harness.require_plugin_entry_point()
    from transformers import AutoTokenizer

    from sglang_ext.model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    source, sources = quality.passage_sources(args.seeds_dir, max(args.greedy_lengths), tokenizer)
    prompts = quality.greedy_prompts(tokenizer, sources, args.greedy_lengths)
    cases = [
        lookup_task.make_case(tokenizer, length, depth, seed)
        for length in args.lookup_lengths
        for depth in args.lookup_depths
        for seed in range(args.seeds)
    ]
    runs = grid(args)
    log_dir = args.log_dir or args.out_dir
    info = RunInfo.detect()
    outputs, fractions = {}, {}
    for run in runs:
        outputs[run.label] = quality.serve_and_generate(run, args, prompts, cases, log_dir)
        log_text = (log_dir / f"quality-{run.label}.log").read_text()
        fractions[run.label] = last_round_fractions(log_text)

    reference = outputs[quality.FULL]
    full_passed = [lookup_task.is_correct(c, a) for c, a in zip(cases, reference["answers"])]
    rows, table = [], []
    for run in runs:
        out = outputs[run.label]
        correct = [lookup_task.is_correct(c, a) for c, a in zip(cases, out["answers"])]
        judged = [ok for ok, passed in zip(correct, full_passed) if passed]
        prefix = [quality.identical_prefix(o, r) for o, r in zip(out["greedy"], reference["greedy"])]
        match = [quality.match_fraction(o, r) for o, r in zip(out["greedy"], reference["greedy"])]
        metrics = {
            "lookup_accuracy_full_passed": sum(judged) / len(judged) if judged else None,
            "greedy_identical_prefix_tokens": statistics.fmean(prefix),
            "greedy_token_match_frac": statistics.fmean(match),
            "kv_kept_frac": fractions[run.label][0] if run.params else 1.0,
            "attended_frac": fractions[run.label][1] if run.params else 1.0,
        }
        for metric, value in metrics.items():
            rows.append(info.row(bench=BENCH, policy=run.label, model_shape=quality.SHAPE,
                                 batch=1, context=max(args.lookup_lengths), metric=metric,
                                 value=value))  # fmt: skip
        table.append((run, metrics))
    json_path = harness.save_results(BENCH, quality.SHAPE, rows, info, args.out_dir, args.results_md)
    cases_path = json_path.with_name(json_path.stem + "-cases.json")
    cases_path.write_text(json.dumps({r.label: outputs[r.label] for r in runs}, indent=1) + "\n")
    lines = [
        "",
        f"- lookup: {len(cases)} cases (lengths {args.lookup_lengths} x depths "
        f"{args.lookup_depths} x {args.seeds} seeds), full attention passes {sum(full_passed)}; "
        f"greedy: prompts of {[len(p) for p in prompts]} tokens ({source}), "
        f"{args.greedy_tokens} new tokens, EOS ignored",
        f"- engine: {info.device}, --dtype {args.dtype}, --disable-radix-cache, one request at a "
        f"time, temperature 0; lethe evict_threshold {args.evict_threshold}, max_kv_ratio "
        f"{args.max_kv_ratio}; requests and answers: `{cases_path.name}`",
        "",
        "| policy | sparse_ratio | recent_ratio | layers' memory | KV kept | read per step "
        "| lookup (cases full passes) | greedy identical prefix | greedy tokens equal |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run, m in table:
        params = run.params or {}
        lines.append(
            f"| {run.policy} | {params.get('sparse_ratio', '–')} | "
            f"{params.get('recent_ratio', '–')} | {_memory(params)} | "
            f"{_fmt(m['kv_kept_frac'])} | {_fmt(m['attended_frac'])} | "
            f"{_fmt(m['lookup_accuracy_full_passed'])} | "
            f"{m['greedy_identical_prefix_tokens']:.1f} | {m['greedy_token_match_frac']:.3f} |"
        )
    notes = "\n".join(lines) + "\n"
    with open(args.results_md, "a") as md:
        md.write(notes)
    print(notes, flush=True)


def _memory(params: dict) -> str:
    if params.get("sparse_ratio") is None:
        return "–"
    return "packed (sum)" if params.get("pack_layers", True) else "union"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
