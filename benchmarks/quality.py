"""Quality of the sparse decode policies against full attention, on the real CPU engine with
SmolLM2-135M-Instruct's real weights: one server per policy and budget, started one after another,
each sent the same greedy requests one at a time.

    python -m benchmarks.quality --policies full,delta,tidal --budgets 256,512,1024

- Greedy agreement: natural-text prompts (a passage, then a request to summarise it) of the
  --greedy-lengths, --greedy-tokens new tokens each with EOS ignored; per prompt, the length of the
  prefix identical to full attention's output and the fraction of positions where the tokens equal.
- Retrieval: benchmarks.lookup_task prompts at --lookup-lengths x --lookup-depths x --seeds;
  accuracy over all cases, and over the cases full attention passes in the same run (a policy is
  judged only where the model itself can answer).

A budget B maps to delta ``{"budget_pages": B/16, "recent_pages": B/128}`` and tidal
``{"budget_tokens": B}``; layer lists are the policies' defaults. ART (``art``, ``delta+art``,
``tidal+art``, ART at its defaults) changes only how much of its base's selection is read, so its
runs are also compared with their base's run (``full``, ``delta-B``, ``tidal-B``): the ``*_vs_base``
rows; and their servers count ART's tiles (``/metrics``): per lookup length, the share of its
traversals' tiles ART read over the lookups (``lookup_art_tiles_read_frac``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path

import requests

from benchmarks import harness, lookup_task, plot_quality
from benchmarks.harness import EngineServer, Row, RunInfo
from sglang_ext.policies import policy_class

BENCH = "quality"
SHAPE = harness.REAL_MODEL
FULL = "full"
ART_SUFFIX = "+art"
BASES = (FULL, "delta", "tidal")
VARIED = ("delta", "tidal", "art", "delta+art", "tidal+art")  # what --variants may change
DEFAULT_SEEDS_DIR = harness.BENCH_DIR.parents[1] / "shared" / "seeds"
# Fallback passages where the seeds are absent: large, prose-heavy stdlib modules.
STDLIB_SOURCES = ["argparse.py", "inspect.py", "typing.py"]
SUMMARY_REQUEST = (
    "Here is an excerpt of a document:\n\n{passage}\n\nSummarise the excerpt in detail."
)
PASSAGE_MARK = "<<passage>>"
POLICY_DESCRIBED = re.compile(r"decoding with policy (\{.*\})")


@dataclasses.dataclass(frozen=True)
class PolicyRun:
    policy: str
    budget: int | None  # tokens; None for full attention
    correction: int = 0  # tidal's cache correction interval; 0: off
    params: tuple = ()  # (key, JSON value) pairs changed from the defaults (--variants)

    @property
    def series(self) -> str:
        """The policy and its variant, without the budget: one line of the plot."""
        series = f"{self.policy}+cc{self.correction}" if self.correction else self.policy
        if self.params:
            changes = ",".join(f"{key}={json.dumps(value)}" for key, value in self.params)
            series += f"[{changes}]"
        return series

    @property
    def label(self) -> str:
        return self.series if self.budget is None else f"{self.series}-{self.budget}"

    @property
    def base(self) -> str:
        """The policy ART runs over (``art`` is ``full+art``); the policy itself otherwise."""
        return FULL if self.policy == "art" else self.policy.removesuffix(ART_SUFFIX)

    @property
    def reads_tiles(self) -> bool:
        return self.base != self.policy

    @property
    def base_label(self) -> str | None:
        """The run this one is compared with besides full attention: its base's, when ART is on
        (an ``art`` variant's parameters are ART's: its base is full attention; a ``BASE+art``
        variant's are its base's, and ART's under the key "art")."""
        if not self.reads_tiles:
            return None
        params = () if self.policy == "art" else tuple(p for p in self.params if p[0] != "art")
        return dataclasses.replace(self, policy=self.base, params=params).label

    @property
    def config(self) -> dict | None:
        if self.policy == "art":
            return dict(self.params) or None
        if self.base == "delta":
            return {**policy_class("delta").for_token_budget(self.budget), **dict(self.params)}
        if self.base == "tidal":
            tokens = policy_class("tidal").for_token_budget(self.budget)
            return {**tokens, "correction_interval": self.correction, **dict(self.params)}
        return None


def policy_runs(
    policies: list[str], budgets: list[int], corrections: list[int] = (),
    variants: list[tuple[str, dict]] = (),
) -> list[PolicyRun]:
    """Full attention first (every other run is compared with it), then each policy per budget;
    tidal also with each cache correction interval in ``corrections``; each of ``variants``
    (policy, changed parameters) per budget."""
    valid = [*BASES, "art", *(b + ART_SUFFIX for b in BASES[1:])]
    unknown = set(policies) - set(valid)
    if unknown:
        raise SystemExit(f"unknown --policies {sorted(unknown)} (valid: {', '.join(valid)})")
    bad = [b for b in budgets if b % 128]
    if bad:
        raise SystemExit(f"--budgets must be multiples of 128 (delta's recent pages): {bad}")
    sparse = [PolicyRun(p, None) for p in policies if p == "art"]
    sparse += [PolicyRun(p, b) for p in policies if p not in (FULL, "art") for b in budgets]
    if corrections and "tidal" not in policies:
        raise SystemExit("--correction-intervals applies to tidal: add it to --policies")
    sparse += [PolicyRun("tidal", b, t) for t in corrections for b in budgets]
    if unserved := sorted({name for name, _ in variants} - set(VARIED)):
        raise SystemExit(f"--variants: this benchmark varies {', '.join(VARIED)}, not {unserved}")
    for name, params in variants:  # art has no budget: one run of each
        runs_budgets = [None] if name == "art" else budgets
        sparse += [PolicyRun(name, b, params=tuple(params.items())) for b in runs_budgets]
    runs = [PolicyRun(FULL, None), *sparse]
    labels = {run.label for run in runs}
    if unmatched := sorted({run.base_label for run in runs} - labels - {None}):
        raise SystemExit(f"--policies/--variants: ART runs are compared with their base's run; "
                         f"add {unmatched}")  # fmt: skip
    return runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{BENCH}", description=__doc__)
    parser.add_argument("--policies", type=harness.name_list, default=[FULL, "delta", "tidal"])
    parser.add_argument("--budgets", type=harness.int_list, default=[256, 512, 1024])
    parser.add_argument("--greedy-lengths", type=harness.int_list, default=[4096, 6144, 7680])
    parser.add_argument("--greedy-tokens", type=int, default=256)
    parser.add_argument("--lookup-lengths", type=harness.int_list, default=[2048, 4096, 7680])
    parser.add_argument("--lookup-depths", type=_float_list, default=[0.1, 0.5, 0.9])
    parser.add_argument("--seeds", type=int, default=3, help="lookup prompts per length and depth")
    parser.add_argument("--lookup-tokens", type=int, default=16)
    parser.add_argument("--seeds-dir", type=Path, default=DEFAULT_SEEDS_DIR,
                        help="text files for the greedy passages (else stdlib source)")  # fmt: skip
    # This CPU (AVX2, no AVX-512 BF16) multiplies bf16 matrices ~20x slower than float32.
    parser.add_argument(
        "--correction-intervals",
        type=harness.int_list,
        default=[],
        help="also run tidal with cache correction every T decode steps, per T",
    )
    parser.add_argument(
        "--variants", type=lambda text: harness.variant_list(text, VARIED),
        default=[],
        help="also run delta or tidal with parameters changed, per budget, or art once: "
        "'delta:full_layers=[0],delta_layers=[1,4,14,22];tidal:sink_tokens=0;art:patience=2'; "
        "ART over a selection, per budget (its base's run needed): "
        "'tidal+art:art={\"tau\":1e-3,\"patience\":2}'",
    )  # fmt: skip
    parser.add_argument("--dtype", default="float32", help="engine dtype (default: float32)")
    parser.add_argument(
        "--server-args",
        default="",
        help="more SGLang flags for every server, e.g. on a GPU host "
        "'--disable-prefill-cuda-graph'",
    )
    parser.add_argument("--threads", type=int, default=2, help="the engine's OMP_NUM_THREADS")
    parser.add_argument("--out-dir", type=Path, default=harness.DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=harness.DEFAULT_RESULTS_MD)
    parser.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: out-dir)")
    return parser


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def passage_sources(seeds_dir: Path, min_tokens: int, tokenizer) -> tuple[str, list[list[int]]]:
    """Where the passages come from, and the token ids of each source long enough to use."""
    seeds = sorted(seeds_dir.glob("*.txt")) if seeds_dir.is_dir() else []
    origin = f"seed texts in {seeds_dir}"
    if not seeds:
        seeds = [Path(os.__file__).parent / name for name in STDLIB_SOURCES]
        origin = "Python stdlib source (no seed texts found)"
    texts = [tokenizer(p.read_text(), add_special_tokens=False).input_ids for p in seeds]
    usable = [(p.name, ids) for p, ids in zip(seeds, texts) if len(ids) >= min_tokens]
    if not usable:
        raise SystemExit(f"no passage source of {min_tokens} tokens among {seeds}")
    return f"{origin}: {', '.join(name for name, _ in usable)}", [ids for _, ids in usable]


def greedy_prompts(tokenizer, sources: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Prompt i: the start of source i (cycling) cut to make the chat prompt ``lengths[i]`` long."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SUMMARY_REQUEST.format(passage=PASSAGE_MARK)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, after = (tokenizer(part, add_special_tokens=False).input_ids
                     for part in text.split(PASSAGE_MARK))  # fmt: skip
    return [
        before + sources[i % len(sources)][: length - len(before) - len(after)] + after
        for i, length in enumerate(lengths)
    ]


def server_argv(run: PolicyRun, args: argparse.Namespace, port: int) -> list[str]:
    config = ["--policy-config", json.dumps(run.config)] if run.config else []
    metrics = ["--enable-metrics"] if run.reads_tiles else []  # ART's tile counts
    return [
        sys.executable, "-m", "sglang_ext.launch", "--policy", run.policy, *config,
        "--port", str(port), "--dtype", args.dtype, *metrics,
        # Every request is prefilled whole, independent of what an earlier one left cached.
        "--disable-radix-cache", *shlex.split(args.server_args),
    ]  # fmt: skip


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    response = requests.post(
        f"{url}/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=3600
    )
    response.raise_for_status()
    return response.json()


def serve_and_generate(run, args, prompts, cases, log_dir: Path) -> dict:
    """One server for ``run``: its resolved policy parameters and its outputs to every request."""
    port = harness.free_port()
    log_path = log_dir / f"{BENCH}-{run.label}.log"
    env = harness.engine_env()
    env["OMP_NUM_THREADS"] = str(args.threads)
    print(f"{BENCH}: {run.label}, log {log_path}", flush=True)
    with EngineServer(server_argv(run, args, port), env, log_path, port) as server:
        server.wait_ready()
        described = POLICY_DESCRIBED.search(server.log())
        if described is None:
            raise RuntimeError(f"{run.label}: the server did not load the policy; log {log_path}")
        greedy = []
        for ids in prompts:
            greedy.append(generate(server.url, ids, args.greedy_tokens)["output_ids"])
            print(f"{BENCH}: {run.label}: greedy prompt of {len(ids)} tokens done", flush=True)
        def counted() -> tuple[float, float]:  # ART's tiles so far
            return harness.art_tiles(server.url) if run.reads_tiles else (0.0, 0.0)

        answers, tiles, before = [], [], counted()
        for case in cases:
            answers.append(generate(server.url, case.prompt_ids, args.lookup_tokens)["text"])
            after = counted()
            tiles.append([after[0] - before[0], after[1] - before[1]])
            before = after
    passed = sum(lookup_task.is_correct(c, a) for c, a in zip(cases, answers))
    print(f"{BENCH}: {run.label}: lookup {passed}/{len(cases)} correct", flush=True)
    return {"params": ast.literal_eval(described[1]), "greedy": greedy, "answers": answers,
            "lookup_tiles": tiles}  # fmt: skip


def identical_prefix(ours: list[int], reference: list[int]) -> int:
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return i
    return min(len(ours), len(reference))


def match_fraction(ours: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(ours, reference)) / max(len(reference), 1)


def quality_rows(info, runs, outputs, prompts, cases) -> list[Row]:
    reference = outputs[FULL]
    full_passed = [lookup_task.is_correct(c, a) for c, a in zip(cases, reference["answers"])]
    rows = []
    for run in runs:
        out = outputs[run.label]
        point = dict(bench=BENCH, policy=run.label, model_shape=SHAPE, batch=1)
        compared = {"": reference} if run.policy != FULL else {}
        if run.base_label:
            compared["_vs_base"] = outputs[run.base_label]
        for suffix, other in compared.items():
            for ids, ours, theirs in zip(prompts, out["greedy"], other["greedy"]):
                rows += [
                    info.row(**point, context=len(ids), metric=f"greedy_identical_prefix_tokens{suffix}",
                             value=float(identical_prefix(ours, theirs))),
                    info.row(**point, context=len(ids), metric=f"greedy_token_match_frac{suffix}",
                             value=match_fraction(ours, theirs)),
                ]  # fmt: skip
        correct = [lookup_task.is_correct(c, a) for c, a in zip(cases, out["answers"])]
        for length in sorted({c.target_len for c in cases}):
            at = [i for i, c in enumerate(cases) if c.target_len == length]
            judged = [i for i in at if full_passed[i]]
            rows.append(info.row(**point, context=length, metric="lookup_accuracy_all",
                                 value=sum(correct[i] for i in at) / len(at)))  # fmt: skip
            if run.reads_tiles:  # what ART read of its traversals over these lookups
                read, available = (sum(out["lookup_tiles"][i][k] for i in at) for k in (0, 1))
                rows.append(info.row(**point, context=length, metric="lookup_art_tiles_read_frac",
                                     value=read / available if available else None,
                                     skipped=None if available else "no tile counted"))  # fmt: skip
            if run.policy != FULL:
                rows.append(info.row(
                    **point, context=length, metric="lookup_accuracy_full_passed",
                    value=sum(correct[i] for i in judged) / len(judged) if judged else None,
                    skipped=None if judged else "full attention passed no case",
                ))  # fmt: skip
    return rows


def save_cases(path: Path, source: str, runs, outputs, prompts, cases) -> None:
    """Every request and answer, for reading what a policy got wrong."""
    record = {
        "greedy_passages": source,
        "greedy_prompt_tokens": [len(ids) for ids in prompts],
        "lookup_cases": [
            {
                "target_len": c.target_len,
                "prompt_tokens": len(c.prompt_ids),
                "depth": c.depth,
                "seed": c.seed,
                "key": c.key,
                "value": c.value,
            }
            for c in cases
        ],  # fmt: skip
        "runs": {run.label: outputs[run.label] for run in runs},
    }
    path.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    harness.require_plugin_entry_point()
    runs = policy_runs(args.policies, args.budgets, args.correction_intervals, args.variants)
    from transformers import AutoTokenizer

    from sglang_ext.model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    source, sources = passage_sources(args.seeds_dir, max(args.greedy_lengths), tokenizer)
    prompts = greedy_prompts(tokenizer, sources, args.greedy_lengths)
    cases = [
        lookup_task.make_case(tokenizer, length, depth, seed)
        for length in args.lookup_lengths
        for depth in args.lookup_depths
        for seed in range(args.seeds)
    ]
    info = RunInfo.detect()
    log_dir = args.log_dir or args.out_dir
    outputs = {run.label: serve_and_generate(run, args, prompts, cases, log_dir) for run in runs}
    rows = quality_rows(info, runs, outputs, prompts, cases)
    json_path = harness.save_results(BENCH, SHAPE, rows, info, args.out_dir, args.results_md)
    cases_path = json_path.with_name(json_path.stem + "-cases.json")
    save_cases(cases_path, source, runs, outputs, prompts, cases)
    png = plot_quality.plot_quality(rows, runs, json_path.with_suffix(".png"))
    notes = plot_quality.summary_markdown(rows, runs, [
        f"greedy passages: {source}; prompt tokens {[len(ids) for ids in prompts]}, "
        f"{args.greedy_tokens} new tokens each (EOS ignored)",
        f"lookup: {len(cases)} cases (lengths {args.lookup_lengths} x depths "
        f"{args.lookup_depths} x {args.seeds} seeds), {args.lookup_tokens} new tokens",
        f"engine: {info.device}, --dtype {args.dtype}, OMP_NUM_THREADS={args.threads}, "
        f"--disable-radix-cache {args.server_args}, requests one at a time, temperature 0",
        "policy parameters as the servers resolved them: "
        + "; ".join(f"{r.label} {outputs[r.label]['params']}" for r in runs if r.policy != FULL),
        f"requests and answers: `{cases_path.name}`; plot: `{png.name}`",
    ])  # fmt: skip
    with open(args.results_md, "a") as md:
        md.write(notes + "\n")
    print(f"\n{notes}", flush=True)


if __name__ == "__main__":
    main()
