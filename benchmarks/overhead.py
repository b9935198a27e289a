"""A policy's overhead against vanilla SGLang, pooled over repeated runs of one benchmark.

A single decode-step point is one median, and separate engine processes differ by several percent
from run to run; the geometric mean of the per-point ratios over every point of every run is the
number to hold against a goal such as "full costs at most 2%".

    python -m benchmarks.overhead --metric decode_step_latency_s benchmarks/results/decode_step-*.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def ratios_by_policy(paths: list[Path], metric: str) -> dict[str, dict[Path, list[float]]]:
    """policy -> results file -> that run's ratios of ``metric``."""
    ratios: dict[str, dict[Path, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for row in json.loads(path.read_text()):
            if row["metric"] == metric and row["policy"] != "vanilla" and row["ratio"]:
                ratios[row["policy"]][path].append(row["ratio"])
    return ratios


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--metric", required=True, help="a metric of the rows, e.g. decode_step_latency_s"
    )
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files (one per run)")
    args = parser.parse_args(argv)
    ratios = ratios_by_policy(args.results, args.metric)
    if not ratios:
        raise SystemExit(
            f"no policy rows with metric {args.metric!r} in {len(args.results)} file(s)"
        )
    print("| policy | metric | runs | points | geomean ratio | min | max |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for policy, runs in sorted(ratios.items()):
        values = [ratio for run in runs.values() for ratio in run]
        print(
            f"| {policy} | {args.metric} | {len(runs)} | {len(values)} | "
            f"{geometric_mean(values):.4f} | {min(values):.4f} | {max(values):.4f} |"
        )


if __name__ == "__main__":
    main()
