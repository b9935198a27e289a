"""Two decode_step runs of the same points, side by side: each policy's step latency in both, and
the change once each run is normalised by its own vanilla triton step (the engine's drift between
runs cancels out; what is left is the code's).

    python -m benchmarks.compare_runs results/AFTER.json results/BEFORE.json --policies delta,tidal
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRIC = "decode_step_latency_s"
TRITON = ("vanilla@triton", "vanilla")  # how a run names vanilla on triton


def latencies(path: Path) -> dict:
    rows = json.loads(path.read_text())
    return {
        (r["policy"], r["batch"], r["context"]): r["value"]
        for r in rows if r["metric"] == METRIC and r["value"] is not None
    }  # fmt: skip


def anchor(values: dict, batch: int, context: int) -> float | None:
    return next((values[(p, batch, context)] for p in TRITON if (p, batch, context) in values), None)


def table(after: dict, before: dict, policies: list[str]) -> str:
    lines = [
        "| policy | batch | context | after (ms) | before (ms) | after / before | "
        "same, per own triton step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    points = sorted({(b, c) for (_, b, c) in after} & {(b, c) for (_, b, c) in before})
    for policy in policies:
        for batch, context in points:
            a, b = after.get((policy, batch, context)), before.get((policy, batch, context))
            if a is None or b is None:
                continue
            a_anchor, b_anchor = anchor(after, batch, context), anchor(before, batch, context)
            normalised = (
                f"{(a / a_anchor) / (b / b_anchor):.3f}" if a_anchor and b_anchor else "–"
            )
            lines.append(
                f"| {policy} | {batch} | {context} | {a * 1e3:.2f} | {b * 1e3:.2f} "
                f"| {a / b:.3f} | {normalised} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare_runs", description=__doc__)
    parser.add_argument("after", type=Path)
    parser.add_argument("before", type=Path)
    parser.add_argument("--policies", required=True, type=lambda t: t.split(","))
    args = parser.parse_args(argv)
    print(table(latencies(args.after), latencies(args.before), args.policies))


if __name__ == "__main__":
    main()
