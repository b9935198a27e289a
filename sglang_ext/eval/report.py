"""What a run found, per policy, task and length against the reference: benchmark rows (the
fields of benchmarks/harness.py's Row, bench ``eval``), a Markdown table and a plot."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any
from statistics import fmean

from sglang_ext.eval import scoring
from sglang_ext.eval.client import ServerFacts
from sglang_ext.eval.store import REFERENCE, Result, Store
from sglang_ext.rows import Row

ROWS_FILE, TABLE_FILE, PLOT_FILE = "rows.json", "table.md", "accuracy.png"
ALL_TASKS = "all"  # the mean over tasks, in rows (accuracy:all) and the plot


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What was run, where and how."""

    url: str
    facts: ServerFacts  # the policies' server
    reference_facts: ServerFacts  # the reference's: the same, or --baseline-url's
    reference_label: str  # "full", or "vanilla" (--baseline-url)
    policies: tuple[str, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    cases: int  # per task and length
    concurrency: int
    seed: int
    date: str  # ISO, UTC
    budgets: dict[str, str]  # policy -> its KV budget in words (policy_budgets)

    def __post_init__(self):
        if min(self.cases, self.concurrency) < 1 or not all((self.policies, self.tasks,
                                                              self.lengths)):  # fmt: skip
            raise ValueError(f"nothing to report: {self}")


@dataclasses.dataclass(frozen=True)
class Outcomes:
    """The results a report covers: those of the run's cases (a folder may also hold more
    cases per task and length from an earlier run), by (case key, arm)."""

    finished: dict[tuple[str, str], Result]
    failed: dict[tuple[str, str], Result]  # this run's failed requests

    @classmethod
    def of(cls, store: Store, cases: int) -> Outcomes:
        def covered(results):
            return {key: r for key, r in results.items() if r.index < cases}

        return cls(covered(store.finished), covered(store.failed))

    def where(self, arm: str, task: str, length: int, failed: bool = False) -> list[Result]:
        results = self.failed if failed else self.finished
        return [r for (_, name), r in results.items()
                if name == arm and r.task == task and r.length == length]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    """One policy on one task at one length, over the cases that finished under it and under
    the reference (the reference's own values over those same cases)."""

    cases: int
    failed: int  # this run's failed requests of the policy there
    accuracy: float | None = None
    reference_accuracy: float | None = None
    agreement: float | None = None  # scoring.agreement with the reference's tokens
    retained: float | None = None  # KV tokens held at the end, as the server reported
    reference_retained: float | None = None
    attended: float | None = None  # KV tokens read per decode step
    reference_attended: float | None = None


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def cell(outcomes: Outcomes, arm: str, task: str, length: int) -> Cell:
    reference = outcomes.finished
    pairs = [(r, reference[(r.case, REFERENCE)]) for r in outcomes.where(arm, task, length)
             if (r.case, REFERENCE) in reference]  # fmt: skip
    failed = len(outcomes.where(arm, task, length, failed=True))
    if not pairs:
        return Cell(0, failed)
    ours, theirs = [p for p, _ in pairs], [r for _, r in pairs]
    return Cell(
        cases=len(pairs), failed=failed,
        accuracy=fmean(r.correct for r in ours),
        reference_accuracy=fmean(r.correct for r in theirs),
        agreement=fmean(scoring.agreement(p.output_ids, r.output_ids) for p, r in pairs),
        retained=_mean([r.retained_tokens for r in ours]),
        reference_retained=_mean([r.retained_tokens for r in theirs]),
        attended=_mean([r.attended_tokens for r in ours]),
        reference_attended=_mean([r.attended_tokens for r in theirs]),
    )  # fmt: skip


def reference_cell(outcomes: Outcomes, task: str, length: int) -> tuple[float | None, int]:
    """The reference's accuracy over all its finished cases there, and its failed requests."""
    ours = outcomes.where(REFERENCE, task, length)
    failed = len(outcomes.where(REFERENCE, task, length, failed=True))
    return (fmean(r.correct for r in ours) if ours else None), failed


def rows(outcomes: Outcomes, info: RunInfo) -> list[Row]:
    """Per policy, length and task: accuracy (baseline: the reference's, on the same cases),
    agreement with the reference's tokens (no baseline: the reference agrees with itself), KV
    retained and attended (baseline: the reference's where it reports them); and per length
    ``accuracy:all``, the mean over the tasks."""
    facts, label = info.facts, info.reference_label

    def row(policy, length, metric, value, baseline, why) -> Row:
        return Row(
            bench="eval", policy=policy, model_shape=facts.model, batch=info.concurrency,
            context=length, metric=metric, value=value, baseline_value=baseline,
            ratio=value / baseline if value is not None and baseline else None,
            device=facts.device, sglang_version=facts.sglang_version, date=info.date,
            skipped=None if value is not None else why,
            attention_backend=facts.attention_backend,
            baseline_backend="" if baseline is None else info.reference_facts.attention_backend,
            kv_source="real", budget=info.budgets.get(policy, ""),
        )  # fmt: skip

    out = []
    for policy in info.policies:
        for length in info.lengths:
            scored = []
            for task in info.tasks:
                c = cell(outcomes, policy, task, length)
                missing = f"no case finished under both it and {label}" + (
                    f" ({c.failed} requests failed)" if c.failed else ""
                )
                unreported = "the server reported no KV for it" if c.cases else missing
                out += [
                    row(policy, length, f"accuracy:{task}", c.accuracy, c.reference_accuracy,
                        missing),
                    row(policy, length, f"agreement:{task}", c.agreement, None, missing),
                    row(policy, length, f"kv_retained:{task}", c.retained, c.reference_retained,
                        unreported),
                    row(policy, length, f"kv_attended:{task}", c.attended, c.reference_attended,
                        unreported),
                ]  # fmt: skip
                if c.cases:
                    scored.append(c)
            out.append(row(
                policy, length, f"accuracy:{ALL_TASKS}",
                fmean(c.accuracy for c in scored) if scored else None,
                fmean(c.reference_accuracy for c in scored) if scored else None,
                f"no task finished under both it and {label}",
            ))  # fmt: skip
    return out


def length_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _share(value: float | None, of: float | None) -> str:
    return f"{value / of:.0%}" if value is not None and of else "n/a"


def markdown(outcomes: Outcomes, info: RunInfo) -> str:
    facts, label, cases = info.facts, info.reference_label, info.cases
    head = [f"{label} (reference)", *info.policies]
    lines = [
        f"## KV policies against {label} attention: {facts.model}",
        "",
        (f"{info.url}: {facts.attention_backend} on {facts.device}, SGLang "
         f"{facts.sglang_version}; {cases} case{'s' * (cases != 1)} per task and length, greedy, "
         f"seed {info.seed}; {info.date}."),
        "",
        ("Cell: accuracy (every expected answer in the output) · agreement (share of the output "
         f"equal to {label}'s tokens from the start) · KV kept (tokens held at the end, share of "
         f"{label}'s) · KV read (per decode step, share of {label}'s)."),
        "",
        "| task | length | " + " | ".join(head) + " |",
        "| --- | --- |" + " --- |" * len(head),
    ]  # fmt: skip
    for length in info.lengths:
        for task in info.tasks:
            accuracy, failed = reference_cell(outcomes, task, length)
            cells = [_fmt(accuracy) + (f" · {failed} failed" if failed else "")]
            for policy in info.policies:
                c = cell(outcomes, policy, task, length)
                text = "no result"
                if c.cases:
                    text = " · ".join([
                        _fmt(c.accuracy), _fmt(c.agreement),
                        _share(c.retained, c.reference_retained),
                        _share(c.attended, c.reference_attended),
                    ])  # fmt: skip
                cells.append(text + (f" · {c.failed} failed" if c.failed else ""))
            lines.append(f"| {task} | {length_label(length)} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, *shortfalls(outcomes, info)]) + "\n"


# where the reference answers at least this share, a policy is to answer this share of what it does
ANSWERED_BY_REFERENCE, SHARE_OF_REFERENCE = 0.5, 0.95


def shortfalls(outcomes: Outcomes, info: RunInfo) -> list[str]:
    """Markdown lines: each policy, task and length where the reference answers at least
    ``ANSWERED_BY_REFERENCE`` of the cases and the policy less than ``SHARE_OF_REFERENCE`` of
    what it answers, with where the missed cases' answers sit in the prompt."""
    label, found = info.reference_label, []
    reference = outcomes.finished
    for policy, length, task in itertools.product(info.policies, info.lengths, info.tasks):
        c = cell(outcomes, policy, task, length)
        if not c.cases or c.reference_accuracy < ANSWERED_BY_REFERENCE:
            continue
        if c.accuracy >= SHARE_OF_REFERENCE * c.reference_accuracy:
            continue
        missed = [r for r in outcomes.where(policy, task, length)
                  if not r.correct and reference.get((r.case, REFERENCE), r).correct]  # fmt: skip
        depths = ", ".join(
            "/".join(f"{d:.0%}" for d in r.answer_depths) or "n/a" for r in missed
        )
        found.append(
            f"- `{policy}`, {task} at {length_label(length)}: {_fmt(c.accuracy)} against "
            f"{label}'s {_fmt(c.reference_accuracy)}; missed {len(missed)} that {label} answered, "
            f"answers at {depths} of the prompt"
        )
    if not found:
        return []
    return ["", f"Below {SHARE_OF_REFERENCE:.0%} of {label}'s accuracy where {label} answers at "
            f"least {ANSWERED_BY_REFERENCE:.0%} of the cases:", "", *found]  # fmt: skip


def plot(outcomes: Outcomes, info: RunInfo, path: Path) -> bool:
    """Accuracy against length, one panel per task and one of their mean, a line per policy
    and the reference dashed. False (and a message) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    lengths, panels = info.lengths, [*info.tasks, ALL_TASKS]
    columns = min(4, len(panels))
    rows_n = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(4 * columns, 3.2 * rows_n), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        chosen = info.tasks if panel == ALL_TASKS else [panel]
        # the reference wide and pale beneath: a policy on it stays visible
        reference = [_mean([reference_cell(outcomes, t, n)[0] for t in chosen]) for n in lengths]
        ax.plot(lengths, reference, color="0.6", linestyle="--", linewidth=4, marker="o",
                markersize=10, label=f"{info.reference_label} (reference)", zorder=1)  # fmt: skip
        for policy, marker in zip(info.policies, itertools.cycle("sD^vP*X")):
            values = [_mean([cell(outcomes, policy, t, n).accuracy for t in chosen])
                      for n in lengths]  # fmt: skip
            ax.plot(lengths, values, marker=marker, label=policy, zorder=2)
        ax.set_title("all tasks (mean)" if panel == ALL_TASKS else panel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("accuracy")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(f"{info.facts.model}: accuracy by prompt length, against {info.reference_label}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def served_policies(served: dict, policies: list[str]) -> dict[str, Any]:
    """Each policy as the server resolved its parameters (``GET /policy``), None for one this
    package cannot build (another version's)."""
    from sglang_ext.policies import PolicyConfigError, build_policy  # imports torch: only here

    described = {k: v for k, v in served.items() if k != "name"}
    built = {}
    for name in policies:
        # a single policy's parameters are the description's; a mix's are under each name
        params = described if name == served["name"] else described.get(name, {})
        try:
            built[name] = build_policy(name, params if isinstance(params, dict) else {})
        except (PolicyConfigError, TypeError, ValueError):
            built[name] = None
    return built


def policy_budgets(served: dict, policies: list[str]) -> dict[str, str]:
    """Each policy's KV budget in a few words (a row's ``budget``); empty where unknown."""
    built = served_policies(served, policies)
    return {name: policy.budget() if policy else "" for name, policy in built.items()}


def write(folder: Path, store: Store, info: RunInfo) -> list[Path]:
    """rows.json, table.md and (with matplotlib) accuracy.png in ``folder``; their paths."""
    outcomes = Outcomes.of(store, info.cases)
    written = [folder / ROWS_FILE, folder / TABLE_FILE]
    found = [dataclasses.asdict(r) for r in rows(outcomes, info)]
    written[0].write_text(json.dumps(found, indent=1) + "\n")
    written[1].write_text(markdown(outcomes, info))
    if plot(outcomes, info, folder / PLOT_FILE):
        written.append(folder / PLOT_FILE)
    return written
