"""End-to-end generation throughput and KV tokens in use, per policy and for vanilla SGLang in
the same run: one server per policy (dummy weights, no tokenizer), N concurrent /generate
requests of random input ids, each decoding exactly --output-len tokens.

    python -m benchmarks.e2e --shape qwen1.5b --policies vanilla@fa3,vanilla@flashinfer,full \
        --requests 64 --input-len 1024 --output-len 1024

NAME@BACKEND runs a policy (or vanilla SGLang) on that attention backend; ``lethe/delta`` one server
of several policies (``--policy lethe,delta``), its requests naming them in turn (the greedy check
sends the first's); ratios are against the
fastest vanilla backend of the run, and the greedy check compares a policy's tokens with vanilla's
on its own backend (backends round differently). Rows name each policy's budget.

KV tokens in use are sampled during the run from SGLang's /v1/loads (``num_used_tokens``: KV slots
held by running requests, not the radix cache's evictable ones), which reads the load snapshot the
scheduler publishes every --kv-publish-steps decode steps, as is the number of requests running at
once. Retractions are counted from the server's log (SGLang logs each with ``#retracted_reqs``).
The same snapshot's decode-step counter gives the x axis of KV in use against generated tokens: a
request running from the first step has generated one token per step.

A decode step's time against its context, from the server's own decode log lines (SGLang's gen
throughput every 40 steps) while the whole batch runs: ``decode_step_fixed_ms`` (at context 0) and
``decode_step_slope_ms`` (per 1,024 tokens of each request's context), a least-squares line: where
an end-to-end ratio comes from (a policy's fixed cost per step against its growth with context);
and ``decode_step_ms``, the median of those lines' step times (TPOT at the full batch).
``decode_step_residual_frac`` is the root mean square of the steps' distance from that line over
the median step. A GPU-bound step follows its line; one noisy at every context (5 % in an H200
DELTA run whose line came out flat, 2026-11-28, against 0.4-1.3 % in DELTA's four runs before it)
waited on something else than its kernels, such as the host, and a ratio from it measures that.
``decode_step_ideal_ms`` is the step a run would take at the fastest vanilla's cost: that
vanilla's line at the run's mean tokens attended per layer and step (vanilla's whole context; a
policy's as its server reports them, before ART's early stop). Its ratio (to vanilla's) is the
least fraction of vanilla's step a policy could take if it paid only vanilla's fixed cost and
vanilla's cost per token read, its inverse the step speed-up within reach: where a goal sits
against what the device allows. Both runs must have decoded all --requests at once.

``--real-weights`` serves the embedded model (SmolLM2-135M-Instruct, ``--shape smol``) with its real
weights instead, each request a different window of natural text (the quality benchmark's
passages) in the model's chat template: where what a policy reads depends on real attention (ART
stops on it).

``--profile-steps N`` puts the server under the torch profiler for N forward steps once the run
has decoded half its tokens (``--profile-at-step``): the kernels of the whole decode steps in that
window, per step (``kernel_ms:NAME``, ``gpu_busy_ms``, ``host_gap_ms``, as benchmarks.decode_profile
names them), at the run's own batch and KV, where a synthetic one-batch profile's KV differs. The
profiled steps are slower; their share of a run is small, and a ratio is best taken without it.
``--profile-python`` records Python stacks too, to find where the host's work comes from.

A run too long for one sitting can be split by policy: with --partial-dir, each policy's
measurement is saved there, and every call reports all policies found there (the same --shape,
--requests, --input-len and --output-len), vanilla's as the baseline. Without it each policy's
measurement is still saved as it completes, under a directory of this call's own in --out-dir
(printed; git ignores it), so that a call cut short by a time limit keeps the policies it
finished: report them with --report-only --partial-dir DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import sys
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks import decode_profile, harness, plot
from benchmarks.harness import EngineServer, Row, RunInfo
from sglang_ext.launch import flag_value

BENCH = "e2e"
REAL_WEIGHTS_SHAPE = "smol"  # the embedded model's shape (--real-weights)
# Logged by sglang_ext.engine.backends when an engine process builds a policy backend.
POLICY_ACTIVE_LOG = "decoding with policy"
RETRACTED_LOG = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
DECODE_LOG = re.compile(
    r"Decode batch.*?#running-req: (\d+), #token: (\d+),.*?gen throughput \(token/s\): ([\d.]+)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = harness.common_parser(BENCH, __doc__)
    parser.add_argument(
        "--dp", type=int, default=1, help="data-parallel workers (SGLang's --dp-size) of --tp GPUs"
    )
    parser.add_argument("--requests", type=int, default=64, help="sent at once")
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, default=None,
        help="SGLang's: the largest decode batch its CUDA graphs capture (default: SGLang's)",
    )  # fmt: skip
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument(
        "--sample-interval", type=float, default=0.05, help="seconds between KV samples"
    )
    parser.add_argument(
        "--kv-publish-steps",
        type=int,
        default=1,
        help="decode steps between the engine's load snapshots, which the KV samples read "
        "(SGLang's default, 15, hides short runs; 1 costs every policy's steps a little)",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="of the random input ids, or of the passages' offsets (same for every policy)",
    )  # fmt: skip
    parser.add_argument(
        "--real-weights", action="store_true",
        help="the embedded model's real weights on natural-text prompts (--shape smol)",
    )  # fmt: skip
    parser.add_argument(
        "--seeds-dir", type=Path, default=None,
        help="text files for --real-weights' passages (default: the quality benchmark's)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-steps", type=int, default=0,
        help="forward steps under the torch profiler during the run (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-at-step", type=int, default=None,
        help="the run's decode step the profile starts at (default: half --output-len)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-python", action="store_true",
        help="the profile records Python stacks too (where host work comes from; a larger trace)",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=20, help="kernels named per profile")
    parser.add_argument(
        "--partial-dir",
        type=Path,
        help="save each policy's measurement here and report every policy saved here",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="measure nothing: report the policies saved under --partial-dir (a run split over "
        "device calls, reported where its partials were brought back)",
    )
    return parser


def server_argv(args: argparse.Namespace, policy: str, port: int) -> list[str]:
    """The server of ``policy``: NAME or NAME@BACKEND (``vanilla@fa3``: SGLang on fa3)."""
    name, backend = harness.split_policy(policy)
    if args.real_weights:
        from sglang_ext.model import default_model_path

        weights = ["--model-path", str(default_model_path())]
    else:
        weights = ["--model-path", str(harness.shape_path(args.shape)), "--load-format", "dummy"]
    flags = [
        *weights,
        "--skip-tokenizer-init",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--load-snapshot-publish-interval", str(args.kv_publish_steps),
        *harness.engine_flags(
            args.max_total_tokens, args.tp, args.context_length, backend, dp=args.dp
        ),
    ]  # fmt: skip
    if args.cuda_graph_max_bs:  # capturing fewer sizes starts a server sooner
        flags += ["--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    if name == harness.VANILLA:
        return [sys.executable, "-m", "sglang.launch_server", *flags]
    own = harness.policy_config(policy, args.policy_config, args.policies)
    config = ["--policy-config", own] if own else []
    served = harness.served_policy(policy)
    return [sys.executable, "-m", "sglang_ext.launch", "--policy", served, *config, *flags]


# Greedy tokens are compared one request at a time: in a concurrent batch, GEMM shapes (and so
# the last bits of the logits) depend on which requests happen to share a step, even for vanilla.
GREEDY_CHECK_REQUESTS = 8
GREEDY_CHECK_TOKENS = 64
WARMUP_REQUESTS = 4  # sent at once before the clock starts: a prefill of several requests


@dataclasses.dataclass(frozen=True)
class Generated:
    output_ids: list[int]
    attended: list[float]  # per decode step, tokens attended (mean over layers); vanilla: none


def generate(
    url: str, input_ids: list[int], output_len: int, kv_policy: str | None = None
) -> Generated:
    """Sends one request (under the server's policy ``kv_policy`` when given): the tokens it
    generated and what the policy attended at each step (``server.report``)."""
    sampling = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}
    if kv_policy is not None:
        sampling["custom_params"] = {"kv_policy": {"name": kv_policy}}
    body = {"input_ids": input_ids, "sampling_params": sampling}
    response = requests.post(f"{url}/generate", json=body, timeout=3600)
    response.raise_for_status()
    out = response.json()
    attended = out["meta_info"].get("kv_attended_tokens") or []
    return Generated(out["output_ids"], [a for a in attended if a is not None])


@dataclasses.dataclass
class KvSample:
    seconds: float
    kv_tokens: int  # KV slots held by running requests
    running: int
    decode_steps: int  # since the sampler started
    generated: int  # tokens, all requests, since the sampler started


class KvSampler:
    """Polls the server's load snapshot from a thread while requests run, and hands each sample
    to ``observers``."""

    def __init__(self, url: str, interval_s: float, observers=()):
        self.url, self.interval_s, self.observers = url, interval_s, observers
        self.samples: list[KvSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> KvSampler:
        self._start = time.perf_counter()
        self._steps0, self._generated0 = self._decode_counters(self._loads())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loads(self) -> list[dict]:
        return requests.get(f"{self.url}/v1/loads", params={"include": "core"}, timeout=10).json()[
            "loads"
        ]

    @staticmethod
    def _decode_counters(loads: list[dict]) -> tuple[int, int]:
        # decode_moments: [steps, sum batch, sum step us, sum batch^2, sum batch*us, generated]
        moments = [load.get("decode_moments") or [0.0] * 6 for load in loads]
        return int(max(m[0] for m in moments)), int(sum(m[5] for m in moments))

    def _run(self) -> None:
        while not self._stop.is_set():
            loads = self._loads()
            steps, generated = self._decode_counters(loads)
            sample = KvSample(
                seconds=time.perf_counter() - self._start,
                kv_tokens=sum(load["num_used_tokens"] for load in loads),
                running=sum(load["num_running_reqs"] for load in loads),
                decode_steps=steps - self._steps0,
                generated=generated - self._generated0,
            )
            self.samples.append(sample)
            for observe in self.observers:
                observe(sample)
            self._stop.wait(self.interval_s)


class StepProfiler:
    """Profiles ``steps`` forward steps of a running server (SGLang's /start_profile, kernels and
    host ops) from the first sample at or past ``at_step`` decode steps; the trace goes to
    ``trace_dir``."""

    def __init__(self, url: str, at_step: int, steps: int, trace_dir: Path, stacks: bool = False):
        self.url, self.at_step, self.steps, self.trace_dir = url, at_step, steps, trace_dir
        self.stacks = stacks  # Python stacks in the trace
        self.running: int | None = None  # requests running when it started

    def __call__(self, sample: KvSample) -> None:
        if self.running is not None or sample.decode_steps < self.at_step:
            return
        self.running = sample.running
        body = {
            "output_dir": str(self.trace_dir), "num_steps": self.steps,
            "activities": ["CPU", "GPU"], "with_stack": self.stacks, "record_shapes": False,
        }  # fmt: skip
        requests.post(f"{self.url}/start_profile", json=body, timeout=60).raise_for_status()

    def result(self, top: int, wait_s: float = 120.0) -> dict[str, float]:
        """Per decode step of the profile (``decode_profile.step_profile``, its whole steps), the
        steps it holds and the requests running; {} where it never started."""
        if self.running is None:
            return {}
        events = self._first_rank_trace(time.monotonic() + wait_s)
        whole = decode_profile.whole_graph_steps(events)
        if whole is None:
            raise RuntimeError(f"{self.trace_dir}: fewer than two CUDA graph replays (graphs off?)")
        kernels, steps = whole
        metrics = decode_profile.step_profile(kernels, steps, top, periods=True)
        return {**metrics, "profiled_steps": float(steps), "profiled_running": float(self.running)}

    def _first_rank_trace(self, deadline: float) -> list[dict]:
        """The events of the first rank's trace (every rank runs the same steps), once the server
        has written it whole: it exports the trace when the steps end."""
        while True:
            traces = sorted(self.trace_dir.glob("*TP-0*.trace.json.gz"))
            try:
                if traces:
                    return decode_profile.trace_events(traces[0])
            except (EOFError, OSError, ValueError):  # still being written
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no whole profile trace in {self.trace_dir} by the deadline")
            time.sleep(1.0)


def max_running(samples: list[KvSample]) -> int:
    """The most requests running at once in a run's samples (0: none)."""
    return max((s.running for s in samples), default=0)


def kv_per_request(samples: list[KvSample]) -> tuple[float, float]:
    """Peak KV tokens per running request (the 99th percentile over samples: a sample taken
    while requests are being prefilled counts their KV but not them) and its steady value: the
    median over the run's second half (after the first rounds of eviction)."""
    per_request = [(s.seconds, s.kv_tokens / s.running) for s in samples if s.running]
    if len(per_request) < 2:
        return (per_request[0][1],) * 2 if per_request else (0.0, 0.0)
    half = per_request[-1][0] / 2
    steady = [kv for t, kv in per_request if t >= half]
    peak = statistics.quantiles([kv for _, kv in per_request], n=100)[98]
    return peak, statistics.median(steady)


def measure(
    url: str, prompts: list[list[int]], output_len: int, interval_s: float,
    kv_policies: list[str | None] = (None,), observers=(),
) -> tuple[float, KvSampler, float | None]:
    """Output tokens/s over all requests sent at once (request i under ``kv_policies[i % n]``),
    the sampler of KV and running requests meanwhile (its samples handed to ``observers``), and
    the tokens attended per layer at a decode step, the mean over every request's steps (None
    where the server reports none)."""
    # Full-length prompts, several at once, compile what the measured prefill runs (FlashInfer
    # JIT-builds kernels on first use: 10 s inside the clock at --tp 2 on 2026-11-26, and 9 s at
    # its first prefill of two requests after a one-request warm-up on 2026-11-28); reversed, so
    # the radix cache holds no measured prompt's prefix.
    warmup = [ids[::-1] for ids in prompts[:WARMUP_REQUESTS]]
    with ThreadPoolExecutor(len(warmup)) as pool:
        list(pool.map(lambda ids: generate(url, ids, 4), warmup))
    sampler = KvSampler(url, interval_s, observers)
    with sampler, ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        chosen = [kv_policies[i % len(kv_policies)] for i in range(len(prompts))]
        outs = list(pool.map(lambda ids, kv: generate(url, ids, output_len, kv), prompts, chosen))
        elapsed = time.perf_counter() - start
    tokens = sum(len(out.output_ids) for out in outs)
    attended = [a for out in outs for a in out.attended]
    return tokens / elapsed, sampler, statistics.fmean(attended) if attended else None


def greedy_match_rows(info: RunInfo, args, runs: list[PolicyRun]) -> list[Row]:
    """Fraction of the greedy check's requests whose tokens equal those of vanilla on the same
    attention backend exactly (backends round differently, so only that comparison is exact)."""
    vanilla = {r.attention_backend: r.greedy for r in runs if harness.is_vanilla(r.policy)}
    references = {run.policy: vanilla.get(run.attention_backend) for run in runs}
    return _match_rows(info, args, runs, references, "identical_frac")


def single_gpu_match_rows(info: RunInfo, args, runs: list[PolicyRun]) -> list[Row]:
    """Under --tp or --dp: against the same policy on one GPU (saved under --partial-dir by a run
    of the same sizes), the fraction of the greedy check's requests whose tokens are all equal,
    and how many first tokens are equal on average. Vanilla's own values are the floor: tensor
    parallelism sums the layers' outputs in another order (on dummy weights, 2026-11-25, no
    request kept all 64 tokens)."""
    if not args.partial_dir or (args.tp, args.dp) == (1, 1):
        return []
    one_gpu = argparse.Namespace(**{**vars(args), "tp": 1, "dp": 1})
    references = {run.policy: run.greedy for run in saved_runs(one_gpu)}
    return _match_rows(info, args, runs, references, "identical_to_one_gpu_frac") + _match_rows(
        info, args, runs, references, "common_prefix_with_one_gpu", _mean_common_prefix
    )  # fmt: skip


def _identical_fraction(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return sum(a == b for a, b in zip(outputs, reference)) / len(reference)


def _mean_common_prefix(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of how many first tokens the two outputs share."""
    lengths = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(outputs, reference)
    ]
    return sum(lengths) / len(reference)


def _match_rows(
    info: RunInfo, args, runs: list[PolicyRun], references: dict, what: str,
    measure=_identical_fraction,
) -> list[Row]:
    """A row per run with a reference: ``measure`` of its greedy outputs against it."""
    return [
        info.row(
            bench=BENCH, policy=run.policy, model_shape=harness.model_label(args), batch=1,
            context=args.input_len, metric=f"greedy_{GREEDY_CHECK_TOKENS}_tokens_{what}",
            value=measure(run.greedy, reference),
            attention_backend=run.attention_backend, kv_source="real",
        )
        for run in runs
        if (reference := references.get(run.policy))
    ]  # fmt: skip


@dataclasses.dataclass
class PolicyRun:
    """One policy's measurement, as taken: rows are derived from it when reported."""

    policy: str
    device: str
    sglang_version: str
    date: str
    output_tok_s: float
    retracted: int
    samples: list[KvSample]
    greedy: list[list[int]]
    attention_backend: str = ""  # SGLang's --attention-backend of its server
    budget: str = ""  # the policy's KV budget (KVPolicy.budget)
    step_curve: tuple[float, float] | None = None  # decode_step_curve of its server's log
    step_ms: float | None = None  # decode_step_ms of its server's log (TPOT at the full batch)
    step_residual: float | None = None  # decode_step_residual_frac of its server's log
    mean_attended: float | None = None  # measure's tokens attended per layer and step
    profile: dict[str, float] = dataclasses.field(default_factory=dict)  # StepProfiler.result

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)) + "\n")

    @classmethod
    def load(cls, path: Path) -> PolicyRun:
        data = json.loads(path.read_text())
        data["samples"] = [KvSample(**sample) for sample in data["samples"]]
        return cls(**data)

    def rows(self, args) -> list[Row]:
        samples = self.samples
        kv_tokens = [s.kv_tokens for s in samples] or [0]
        peak_per_request, steady_per_request = kv_per_request(samples)
        metrics = {
            "e2e_output_tok_s": self.output_tok_s,
            "peak_kv_tokens_in_use": float(max(kv_tokens)),
            "mean_kv_tokens_in_use": statistics.fmean(kv_tokens),
            "peak_kv_tokens_per_request": peak_per_request,
            "steady_kv_tokens_per_request": steady_per_request,
            "max_running_requests": float(max_running(samples)),
            "mean_running_requests": statistics.fmean([s.running for s in samples] or [0]),
            "retracted_requests": float(self.retracted),
        }
        if self.step_curve is not None:
            fixed, slope = self.step_curve
            metrics |= {"decode_step_fixed_ms": fixed, "decode_step_slope_ms": slope}
        if self.step_ms is not None:
            metrics["decode_step_ms"] = self.step_ms
        if self.step_residual is not None:
            metrics["decode_step_residual_frac"] = self.step_residual
        metrics |= self.profile
        return [self.row(args, name, value) for name, value in metrics.items()]

    def row(self, args, metric: str, value: float) -> Row:
        return Row(
            bench=BENCH, policy=self.policy, model_shape=harness.model_label(args),
            batch=args.requests, context=args.input_len, metric=metric, value=value,
            device=self.device, sglang_version=self.sglang_version, date=self.date,
            attention_backend=self.attention_backend, kv_source="real", budget=self.budget,
        )  # fmt: skip


def ideal_step_rows(args, runs: list[PolicyRun]) -> list[Row]:
    """``decode_step_ideal_ms`` of every run that decoded all --requests at once, on the line of
    the fastest such vanilla run: the step at vanilla's cost per step and per token read."""
    whole = [run for run in runs if max_running(run.samples) == args.requests]
    lines = [run for run in whole if harness.is_vanilla(run.policy) and run.step_curve]
    if not lines:
        return []
    fixed, slope = max(lines, key=lambda run: run.output_tok_s).step_curve
    vanilla_attended = args.input_len + (args.output_len - 1) / 2  # every token, its context
    rows = []
    for run in whole:
        attended = vanilla_attended if harness.is_vanilla(run.policy) else run.mean_attended
        if attended is not None:
            rows.append(run.row(args, "decode_step_ideal_ms", fixed + slope * attended / 1024))
    return rows


def measure_policy(args, policy: str, prompts: list[list[int]], info: RunInfo) -> PolicyRun:
    port = harness.free_port()
    log_name = f"{BENCH}-{args.shape}-{harness.file_safe(policy)}.log"
    log_path = (args.log_dir or args.out_dir) / log_name
    print(f"{BENCH}: {policy} on {args.shape} ({info.device}), log {log_path}", flush=True)
    argv = server_argv(args, policy, port)
    with EngineServer(argv, harness.engine_env(), log_path, port) as server:
        server.wait_ready()
        if not harness.is_vanilla(policy) and not POLICY_ACTIVE_LOG in server.log():
            raise RuntimeError(f"{policy}: the server did not load the policy; log {log_path}")
        profilers = []
        if args.profile_steps:
            at_step = args.output_len // 2 if args.profile_at_step is None else args.profile_at_step
            traces = log_path.with_suffix(".traces")
            profilers.append(
                StepProfiler(server.url, at_step, args.profile_steps, traces, args.profile_python)
            )
        tok_s, sampler, attended = measure(
            server.url, prompts, args.output_len, args.sample_interval,
            harness.request_policies(policy), profilers,
        )  # fmt: skip
        profile = profilers[0].result(args.top) if profilers else {}
        log = server.log()
        retracted = sum(int(n) for n in RETRACTED_LOG.findall(log))
        step_curve, step_ms = decode_step_curve(log), decode_step_ms(log)
        step_residual = decode_step_residual_frac(log)
        greedy = [
            generate(server.url, ids, GREEDY_CHECK_TOKENS).output_ids
            for ids in prompts[:GREEDY_CHECK_REQUESTS]
        ]
    print(f"{BENCH}: {policy}: {tok_s:.1f} output tok/s, {retracted} retracted", flush=True)
    return PolicyRun(
        policy=policy, device=info.device, sglang_version=info.sglang_version, date=info.date,
        output_tok_s=tok_s, retracted=retracted, samples=sampler.samples, greedy=greedy,
        attention_backend=flag_value(argv, "--attention-backend", ""),
        budget=harness.policy_budget(
            policy, harness.policy_config(policy, args.policy_config, args.policies)
        ),
        step_curve=step_curve,
        step_ms=step_ms, step_residual=step_residual, mean_attended=attended, profile=profile,
    )  # fmt: skip


def full_batch_steps(log: str) -> list[tuple[float, float]]:
    """(mean context per request / 1,024, step ms) of each of the server's decode log lines at its
    largest batch, a line's step time being requests / gen throughput; the first such line is
    left out (its interval holds the prefill)."""
    lines = [(int(r), int(t), float(g)) for r, t, g in DECODE_LOG.findall(log)]
    batch = max((r for r, _, _ in lines), default=0)
    return [(t / r / 1024, 1e3 * r / g) for r, t, g in lines if r == batch and g > 0][1:]


def decode_step_ms(log: str) -> float | None:
    """The median decode step (ms) at the full batch (``full_batch_steps``); None without one."""
    steps = [step for _, step in full_batch_steps(log)]
    return statistics.median(steps) if steps else None


def decode_step_curve(log: str) -> tuple[float, float] | None:
    """(ms at context 0, ms per 1,024 tokens of context) of a decode step: the least-squares line
    through ``full_batch_steps``; None with fewer than three lines."""
    return _step_line(full_batch_steps(log))


def decode_step_residual_frac(log: str) -> float | None:
    """The root mean square of ``full_batch_steps``' distance from ``decode_step_curve``'s line,
    over their median step; None with fewer than three lines."""
    full = full_batch_steps(log)
    line = _step_line(full)
    if line is None:
        return None
    fixed, slope = line
    off_line = [step - fixed - slope * context for context, step in full]
    median_step = statistics.median(step for _, step in full)
    return math.sqrt(statistics.fmean([d * d for d in off_line])) / median_step


def _step_line(full: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through (context, step) points."""
    if len(full) < 3:
        return None
    contexts, step_ms = zip(*full, strict=True)
    slope, fixed = statistics.linear_regression(contexts, step_ms)
    return fixed, slope


def partial_path(args, policy: str, directory: Path | None = None) -> Path:
    """Where ``policy``'s measurement of this run is saved: in ``directory``, else --partial-dir."""
    run = f"{harness.run_label(args)}-{args.requests}x{args.input_len}-{args.output_len}"
    # the policy's own name is inside the file
    safe = policy if policy == "*" else harness.file_safe(policy)
    return (directory or args.partial_dir) / f"{BENCH}-partial-{run}-{safe}.json"


def saved_runs(args) -> list[PolicyRun]:
    """Every policy saved under --partial-dir for this run's shape and sizes, vanilla first."""
    paths = sorted(args.partial_dir.glob(partial_path(args, "*").name))
    runs = [PolicyRun.load(path) for path in paths]
    return sorted(runs, key=lambda run: not harness.is_vanilla(run.policy))


def saved_run_info(runs: list[PolicyRun]) -> RunInfo:
    """The device, version and last date of the saved runs: the report names where they ran."""
    devices = {(run.device, run.sglang_version) for run in runs}
    if len(devices) != 1:
        raise SystemExit(f"--report-only: saved runs from {sorted(devices)}, not one device")
    [(device, sglang_version)] = devices
    command = harness.RunInfo.detect().command
    last = max(run.date for run in runs)
    return RunInfo(device, sglang_version, "(not in the saved runs)", last, command)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.real_weights and args.shape != REAL_WEIGHTS_SHAPE:
        build_parser().error(f"--real-weights serves SmolLM2: --shape {REAL_WEIGHTS_SHAPE}")
    for flag in ("profile_steps", "profile_at_step"):
        if (getattr(args, flag) or 0) < 0:
            build_parser().error(f"--{flag.replace('_', '-')} must be >= 0")
    if args.report_only:
        if not args.partial_dir:
            build_parser().error("--report-only needs --partial-dir")
        runs = saved_runs(args)
        if not runs:
            build_parser().error(f"--report-only: no saved runs under {args.partial_dir}")
        report(args, runs, saved_run_info(runs))
        return
    if not all(harness.is_vanilla(policy) for policy in args.policies):
        harness.require_plugin_entry_point()
    prompts = real_prompts(args) if args.real_weights else random_prompts(args)
    info = RunInfo.detect()
    # this call's own directory unless told: no other call's runs are joined by accident
    saved = args.partial_dir or args.out_dir / harness.file_safe(f"{BENCH}-partial-{info.date}")
    saved.mkdir(parents=True, exist_ok=True)
    print(f"{BENCH}: each policy's measurement is saved in {saved} as it completes", flush=True)
    runs = []
    for policy in args.policies:
        run = measure_policy(args, policy, prompts, info)
        run.save(partial_path(args, policy, saved))
        runs.append(run)
    if args.partial_dir:
        runs = saved_runs(args)
    report(args, runs, info)


def random_prompts(args) -> list[list[int]]:
    vocab = harness.shape_config(args.shape)["vocab_size"]
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.requests)]


def real_prompts(args) -> list[list[int]]:
    """--requests chat prompts of exactly --input-len tokens, request i a passage starting
    --seed + 509 (i // n) tokens into source i % n of the quality benchmark's n passages: no two
    share more than the chat template's first tokens."""
    from transformers import AutoTokenizer

    from benchmarks import quality
    from sglang_ext.model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    origin, sources = quality.passage_sources(
        args.seeds_dir or quality.DEFAULT_SEEDS_DIR, args.input_len, tokenizer
    )
    print(f"{BENCH}: prompts from {origin}", flush=True)
    windows = []
    for i in range(args.requests):
        source = sources[i % len(sources)]
        start = (args.seed + 509 * (i // len(sources))) % max(len(source) - args.input_len, 1)
        windows.append(source[start:])
    return quality.greedy_prompts(tokenizer, windows, [args.input_len] * args.requests)


def report(args, runs: list[PolicyRun], info: RunInfo) -> None:
    rows = [row for run in runs for row in run.rows(args)]
    rows += greedy_match_rows(info, args, runs) + single_gpu_match_rows(info, args, runs)
    rows += ideal_step_rows(args, runs)
    harness.add_baseline_ratios(rows, speed_metric="e2e_output_tok_s")
    json_path = harness.save_results(
        BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md
    )
    timelines = {run.policy: run.samples for run in runs}
    print(f"plot: {plot.plot_e2e(rows, timelines, json_path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
