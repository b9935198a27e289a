"""PNG plot of benchmarks.recall: attention recall per sparse layer, one panel per prompt length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LINESTYLES = {"delta": "-", "tidal": "--"}


def plot_recall(
    per_layer: dict[tuple[str, int, int], list[float | None]], title: str, path: Path
) -> Path:
    """per_layer: (policy, budget, length) -> recall per layer (None where the layer is not
    sparse). Colour = budget, line style = policy."""
    lengths = sorted({length for _, _, length in per_layer})
    budgets = sorted({budget for _, budget, _ in per_layer})
    colors = dict(zip(budgets, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False, sharey=True
    )
    for ax, length in zip(axes[0], lengths):
        for (policy, budget, at_length), values in per_layer.items():
            if at_length != length:
                continue
            points = [(layer, v) for layer, v in enumerate(values) if v is not None]
            ax.plot(
                *zip(*points), LINESTYLES.get(policy, ":"), marker=".", color=colors[budget],
                label=f"{policy} B={budget}",
            )  # fmt: skip
        ax.set(title=f"context {length} tokens", xlabel="sparse layer", ylabel="attention recall")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
