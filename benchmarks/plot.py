"""PNG plots of benchmark rows (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.harness import Row  # noqa: E402


def _policies(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(r.policy for r in rows))


def _title(rows: list[Row], what: str) -> str:
    return f"{what} · {rows[0].model_shape} · {rows[0].device}"


def plot_decode_step(
    rows: list[Row],
    path: Path,
    metric: str = "decode_step_latency_s",
    to_ms: float = 1e3,
    what: str = "decode-step latency",
) -> Path | None:
    """A time metric (decode-step latency by default) against context, one panel per batch size,
    one line per policy."""
    measured = [r for r in rows if r.metric == metric and r.value is not None]
    if not measured:
        return None
    batches = sorted({r.batch for r in measured})
    contexts = sorted({r.context for r in measured})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for policy in _policies(measured):
            points = sorted(
                (r.context, r.value * to_ms)
                for r in measured
                if r.batch == batch and r.policy == policy
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set(title=f"batch {batch}", xlabel="context (tokens)", ylabel=f"{what} (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(_title(rows, what))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_e2e(rows: list[Row], kv_timelines: dict[str, list], path: Path) -> Path | None:
    """KV tokens in use, all requests and per running request, against the tokens a request
    has generated (decode steps since the first request: the paper's Fig. 4), and output
    throughput per policy. Timelines hold benchmarks.e2e.KvSample."""
    throughput = {
        r.policy: r.value for r in rows if r.metric == "e2e_output_tok_s" and r.value is not None
    }
    if not throughput:
        return None
    fig, (kv_ax, per_request_ax, tput_ax) = plt.subplots(1, 3, figsize=(15, 3.8))
    for policy, samples in kv_timelines.items():
        running = [s for s in samples if s.running]
        kv_ax.plot([s.decode_steps for s in samples], [s.kv_tokens for s in samples], label=policy)
        per_request_ax.plot(
            [s.decode_steps for s in running],
            [s.kv_tokens / s.running for s in running],
            label=policy,
        )
    xlabel = "tokens generated per request (decode steps)"
    kv_ax.set(title="KV tokens in use", xlabel=xlabel, ylabel="tokens")
    per_request_ax.set(title="KV tokens per running request", xlabel=xlabel, ylabel="tokens")
    for ax in (kv_ax, per_request_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    tput_ax.bar(list(throughput), list(throughput.values()))
    tput_ax.set(title="output throughput", ylabel="tokens/s")
    tput_ax.grid(alpha=0.3, axis="y")
    fig.suptitle(_title(rows, "end-to-end generation"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
