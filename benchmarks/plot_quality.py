"""The quality benchmark's summary per policy and budget: a markdown table and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.harness import Row

# (metric of the rows, column / panel title); each is averaged over prompts or lengths.
SUMMARY_METRICS = [
    ("greedy_identical_prefix_tokens", "identical prefix (tokens)"),
    ("greedy_token_match_frac", "tokens equal to full's"),
    ("lookup_accuracy_all", "lookup accuracy, all cases"),
    ("lookup_accuracy_full_passed", "lookup accuracy, cases full passes"),
    ("greedy_token_match_frac_vs_base", "tokens equal to its base's (ART runs)"),
]


def summary(rows: list[Row], runs) -> dict[str, dict[str, float | None]]:
    """Per run label, each summary metric's mean over its rows (None where no row has a value)."""
    table = {}
    for run in runs:
        values = {}
        for metric, _ in SUMMARY_METRICS:
            found = [
                r.value
                for r in rows
                if r.policy == run.label and r.metric == metric and r.value is not None
            ]
            values[metric] = mean(found) if found else None
        table[run.label] = values
    return table


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def summary_markdown(rows: list[Row], runs, notes: list[str]) -> str:
    """The notes as a list, then the means per policy and budget (unweighted over prompts and
    over lookup lengths)."""
    means = summary(rows, runs)
    lines = [f"- {note}" for note in notes] + [
        "",
        "| policy | budget (tokens) | " + " | ".join(title for _, title in SUMMARY_METRICS) + " |",
        "| --- | ---: |" + " ---: |" * len(SUMMARY_METRICS),
    ]
    for run in runs:
        cells = " | ".join(_fmt(means[run.label][metric]) for metric, _ in SUMMARY_METRICS)
        lines.append(f"| {run.series} | {run.budget or 'all'} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_quality(rows: list[Row], runs, path: Path) -> Path:
    """One panel per summary metric against the budget, one line per policy; full attention's
    lookup accuracy is the dashed reference."""
    means = summary(rows, runs)
    fig, axes = plt.subplots(1, len(SUMMARY_METRICS), figsize=(4.2 * len(SUMMARY_METRICS), 3.8))
    policies = list(dict.fromkeys(run.series for run in runs if run.budget is not None))
    full = next((run.label for run in runs if run.budget is None), None)
    for ax, (metric, title) in zip(axes, SUMMARY_METRICS):
        for policy in policies:
            points = [(run.budget, means[run.label][metric]) for run in runs
                      if run.series == policy and means[run.label][metric] is not None]  # fmt: skip
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=policy)
        if full and means[full][metric] is not None:
            ax.axhline(means[full][metric], color="grey", linestyle="--", label="full")
        budgets = sorted({run.budget for run in runs if run.budget is not None})
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set(title=title, xlabel="budget (tokens)")
        ax.set_ylim(bottom=0, top=1.05 if metric != "greedy_identical_prefix_tokens" else None)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"quality vs full attention · {rows[0].model_shape} · {rows[0].device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
