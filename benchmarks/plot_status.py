"""The status plot: end-to-end throughput of each policy against the fastest vanilla SGLang
backend, read from the measured rows under benchmarks/results/ (the runs RESULTS.md quotes).

    .venv/bin/python -m benchmarks.plot_status [--out PATH]

Every bar is one row's ``ratio`` (``value / baseline_value``) of ``e2e_output_tok_s``, as the
benchmark wrote it; nothing is typed in here but which row files to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "status-throughput-vs-vanilla.png"
METRIC = "e2e_output_tok_s"

MEMORY_BOUND = "e2e-llama8b-nvidia-h200-2026-11-29-memory-bound-composition-128x8192.json"
# (panel title, [(bar label, row file, policy in that file)]): the newest run of each claim,
# as benchmarks/RESULTS.md lists them
PANELS = [
    (
        "H200 · 64 requests × 1,024 → 16,384 tokens",
        [
            ("vanilla fa3", "e2e-qwen1.5b-nvidia-h200-2026-11-28-three-vanilla-backends-delta-remeasured-16k.json", "vanilla@fa3"),
            ("vanilla flashinfer", "e2e-qwen1.5b-nvidia-h200-2026-11-28-three-vanilla-backends-delta-remeasured-16k.json", "vanilla@flashinfer"),
            ("vanilla triton", "e2e-qwen1.5b-nvidia-h200-2026-11-28-three-vanilla-backends-delta-remeasured-16k.json", "vanilla@triton"),
            ("delta", "e2e-qwen1.5b-nvidia-h200-2026-11-29-new-layout-delta-lethe-16k.json", "delta"),
            ("tidal", "e2e-qwen1.5b-nvidia-h200-2026-11-28-threshold-search-short-list-launch-16k.json", "tidal"),
            ("lethe", "e2e-qwen1.5b-nvidia-h200-2026-11-29-new-layout-delta-lethe-16k.json", "lethe"),
            ("lethe,delta", "e2e-qwen1.5b-nvidia-h200-2026-11-27-mix-and-members-16k.json", "lethe/delta"),
        ],
    ),
    (
        "H200 · fixed 131,072-token KV pool",
        [
            ("vanilla fa3", "e2e-qwen1.5b-nvidia-h200-2026-11-27-lethe-fixed-pool-bounded-growth.json", "vanilla@fa3"),
            ("lethe\n1k → 8k", "e2e-qwen1.5b-nvidia-h200-2026-11-27-lethe-fixed-pool-bounded-growth.json", "lethe"),
            ("lethe\n8k → 1k", "e2e-qwen1.5b-nvidia-h200-2026-11-27-long-prompts-admission-reopened.json", "lethe"),
            ("lethe,delta\n8k → 1k", "e2e-qwen1.5b-nvidia-h200-2026-11-27-mix-fixed-pool-long-prompts.json", "lethe/delta"),
        ],
    ),
    (
        "H200 · llama8b, 128 × 1,024 → 8,192, default pool",
        [
            ("vanilla fa3", MEMORY_BOUND, "vanilla@fa3"),
            ("tidal", MEMORY_BOUND, "tidal"),
            ("lethe", MEMORY_BOUND, "lethe"),
            ("lethe+tidal", MEMORY_BOUND, "lethe+tidal"),
        ],
    ),
]


def ratio(file: str, policy: str) -> tuple[float, str]:
    """The row's ratio to the fastest vanilla of its run, and the date it was measured."""
    rows = json.loads((RESULTS / file).read_text())
    (row,) = [r for r in rows if r["metric"] == METRIC and r["policy"] == policy]
    return row["value"] / row["baseline_value"], row["date"][:10]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = [len(bars) for _, bars in PANELS]
    fig, axes = plt.subplots(
        1, len(PANELS), figsize=(16, 4.6), gridspec_kw={"width_ratios": widths}, sharey=True
    )
    for ax, (title, bars) in zip(axes, PANELS):
        values, dates = zip(*(ratio(file, policy) for _, file, policy in bars))
        labels = [label for label, _, _ in bars]
        colors = ["#9aa5b1" if label.startswith("vanilla") else "#2b6cb0" for label in labels]
        ax.bar(range(len(bars)), values, color=colors)
        for i, value in enumerate(values):
            ax.text(i, value + 0.03, f"{value:.2f}×", ha="center", va="bottom", fontsize=9)
        ax.axhline(1.0, color="#444", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(bars)), labels, fontsize=8.5)
        span = min(dates) if min(dates) == max(dates) else f"{min(dates)} to {max(dates)}"
        ax.set_title(f"{title}\n(measured {span})", fontsize=10)
    axes[0].set_ylabel("output tokens/s ÷ fastest vanilla backend")
    axes[0].set_ylim(0, 2.4)
    fig.suptitle(
        "sglang_ext: end-to-end throughput against vanilla SGLang 0.5.17 "
        "(dummy weights, qwen1.5b shape unless a panel names another; each bar against the "
        "vanilla of its own run)",
        fontsize=11,
    )
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
