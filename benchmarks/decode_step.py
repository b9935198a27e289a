"""Decode-step latency and throughput against context length and batch size, per policy and for
vanilla SGLang in the same run, from SGLang's offline one-batch benchmark (dummy weights).

    python -m benchmarks.decode_step --shape qwen1.5b --policies vanilla@fa3,vanilla@flashinfer,vanilla@triton,delta \
        --batch 1,16,64 --context 4096,16384 --output-len 32

``vanilla@BACKEND`` runs vanilla SGLang on that attention backend; ratios are against the fastest
vanilla backend at each point (``baseline_backend``).

Each point also gets its bandwidth floor: the bytes a step must read (the weights, and each
request's attended tokens' K and V, as the policy counts them, at the point's context) over the
device's measured copy bandwidth; ``decode_step_floor_latency_s`` is that time (its ratio: the
policy's bytes against vanilla's) and ``decode_step_latency_over_floor`` how far the measured step
is from it. ``decode_step_ideal_latency_s`` is a policy's step at the fastest vanilla's own costs
beyond its bytes: vanilla's step less the floor time of the KV the policy does not read. Its
ratio is the least fraction of vanilla's step within reach (as benchmarks.e2e's
``decode_step_ideal_ms``); at batch 1 the steps are host-bound, and a policy whose host path is
shorter than vanilla's can beat it.

Each policy runs in its own process (benchmarks.decode_step_child). A point whose KV does not fit
in the engine's pool is recorded as skipped, with the reason. ``--rounds N`` runs every policy N
times, the order reversed each round (one process to the next, the same step moved 8–11 % on an
H100, RESULTS.md 2026-11-27): a point's latency is the median of its rounds', and
``decode_step_rounds_max_over_min`` says how far they spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness, plot
from benchmarks.harness import Row, RunInfo
from sglang_ext.launch import flag_value, positive_int

BENCH = "decode_step"
METRICS = ("decode_step_latency_s", "decode_throughput_tok_s")
FLOOR_METRICS = ("decode_step_floor_latency_s", "decode_step_latency_over_floor")
IDEAL_METRIC = "decode_step_ideal_latency_s"
SPREAD_METRIC = "decode_step_rounds_max_over_min"


def build_parser(rounds: bool = True) -> argparse.ArgumentParser:
    """This benchmark's flags; ``rounds=False`` leaves out ``--rounds`` (benchmarks built on
    these flags that run each policy once)."""
    parser = harness.common_parser(BENCH, __doc__)
    parser.add_argument("--batch", type=harness.int_list, default=[1, 16, 64])
    parser.add_argument("--context", type=harness.int_list, default=[4096, 16384])
    parser.add_argument(
        "--output-len", type=int, default=32, help="decode steps per point (median taken)"
    )
    parser.add_argument(
        "--prefill-slice-tokens", type=int, default=16384, help="tokens per prefill forward"
    )
    parser.add_argument(
        "--max-running-requests", type=int, default=None,
        help="SGLang's cap (also sizes the request pool, and with it Lethe's state)",
    )
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest batch captured (SGLang's)"
    )
    parser.add_argument(
        "--skip-prefill-compute",
        action="store_true",
        help="fill each point's KV slots without running prefill (see decode_step_child)",
    )
    if rounds:
        parser.add_argument(
            "--rounds", type=positive_int, default=1,
            help="server processes per policy, round by round in alternating order (median taken)",
        )
    parser.add_argument(
        "--partial-dir", type=Path, default=None,
        help="save each policy's measurement here and report every policy saved here for the same "
        "points (a run split over device calls on one host; as benchmarks.e2e's)",
    )  # fmt: skip
    return parser


def run_policy(
    args: argparse.Namespace, policy: str, log_path: Path, extra_flags: tuple[str, ...] = (),
    child_flags: tuple[str, ...] = (),
) -> dict:
    """The child's result for one policy: {kv_capacity_tokens, attention_backend, runs};
    ``extra_flags`` go to SGLang's one-batch benchmark (benchmarks.decode_profile's profiler),
    ``child_flags`` to benchmarks.decode_step_child (benchmarks.decode_host's timing)."""
    one_batch_flags = [
        "--model-path", str(harness.shape_path(args.shape)),
        "--load-format", "dummy",
        *harness.engine_flags(
            args.max_total_tokens, args.tp, args.context_length, harness.split_policy(policy)[1]
        ),
        "--batch-size", *map(str, args.batch),
        "--input-len", *map(str, args.context),
        "--output-len", str(args.output_len),
        *extra_flags,
    ]  # fmt: skip
    for flag, value in (("--max-running-requests", args.max_running_requests),
                        ("--cuda-graph-max-bs", args.cuda_graph_max_bs)):  # fmt: skip
        if value is not None:
            one_batch_flags += [flag, str(value)]
    with tempfile.TemporaryDirectory() as tmp:
        result_json = Path(tmp) / "result.json"
        argv = [
            sys.executable, "-m", "benchmarks.decode_step_child",
            "--policy", harness.served_policy(policy),
            "--result-json", str(result_json),
            "--prefill-slice-tokens", str(args.prefill_slice_tokens),
            "--contexts", ",".join(map(str, args.context)),
            *(["--skip-prefill-compute"] if args.skip_prefill_compute else []),
            *child_flags,
        ]  # fmt: skip
        own = harness.policy_config(policy, args.policy_config, args.policies)
        if not harness.is_vanilla(policy) and own:
            argv += ["--policy-config", own]
        names = harness.request_policies(policy)
        if names != [None]:  # a server of several: its requests name them in turn
            argv += ["--request-policies", ",".join(names)]
        with open(log_path, "wb") as log:
            code = subprocess.call(
                [*argv, "--", *one_batch_flags],
                env=harness.engine_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            raise RuntimeError(
                f"{policy}: exited with {code}; log {log_path}:\n{harness.log_tail(log_path)}"
            )
        backend = harness.split_policy(policy)[1] or flag_value(one_batch_flags, "--attention-backend")
        return {**json.loads(result_json.read_text()), "backend_flag": backend}


def policy_rows(
    args: argparse.Namespace, info: RunInfo, policy: str, result: dict, copy_bytes_per_s: float
) -> list[Row]:
    measured = {
        (r["batch_size"], r["input_len"]): r["median_decode_latency"] for r in result["runs"]
    }
    round_latencies = {
        (r["batch_size"], r["input_len"]): r.get("round_latencies", []) for r in result["runs"]
    }
    rows = []
    for batch in args.batch:
        for context in args.context:
            point = point_fields(args, BENCH, policy, result, batch, context)
            latency = measured.get((batch, context))
            if latency is None:
                need = batch * (context + args.output_len)
                reason = f"KV needs {need} tokens, pool holds {result['kv_capacity_tokens']}"
                rows += [info.row(**point, metric=m, value=None, skipped=reason) for m in METRICS]
            else:
                floor = floor_latency_s(result, batch, context, copy_bytes_per_s)
                values = (latency, batch / latency, floor, latency / floor)
                metrics = METRICS + FLOOR_METRICS
                rows += [info.row(**point, metric=m, value=v) for m, v in zip(metrics, values)]
                rounds = round_latencies[batch, context]
                if len(rounds) > 1:
                    spread = max(rounds) / min(rounds)
                    rows.append(info.row(**point, metric=SPREAD_METRIC, value=spread))
    return rows


def ideal_rows(rows: list[Row]) -> list[Row]:
    """``IDEAL_METRIC`` of every run at every point where the fastest vanilla has a step and a
    floor: that vanilla's step - its floor + the run's floor (rows of one run, or of a saved one:
    the floors must share one copy bandwidth)."""
    latency, floor = METRICS[0], FLOOR_METRICS[0]
    floors = {
        (row.policy, harness.point_of(row)): row.value
        for row in rows
        if row.metric == floor and row.value is not None
    }
    fastest = harness.fastest_vanilla(rows, latency)
    ideal = []
    for row in rows:
        vanilla = fastest.get(harness.point_of(row))
        if row.metric != latency or row.value is None or vanilla is None:
            continue
        own, vanilla_floor = (floors.get((r.policy, harness.point_of(r))) for r in (row, vanilla))
        if own is not None and vanilla_floor is not None:
            ideal.append(dataclasses.replace(
                row, metric=IDEAL_METRIC, value=vanilla.value - vanilla_floor + own,
                baseline_value=None, ratio=None, baseline_backend="",
            ))  # fmt: skip
    return ideal


def merged_rounds(rounds: list[dict]) -> dict:
    """One policy's result over several server processes: each point's latency the median of
    theirs (``round_latencies`` keeps them all), the copy bandwidth the best they measured."""
    latencies: dict[tuple[int, int], list[float]] = {}
    for result in rounds:
        for run in result["runs"]:
            point = (run["batch_size"], run["input_len"])
            latencies.setdefault(point, []).append(run["median_decode_latency"])
    runs = [
        {"batch_size": batch, "input_len": context, "round_latencies": found,
         "median_decode_latency": statistics.median(found)}
        for (batch, context), found in latencies.items()
    ]  # fmt: skip
    best_copy = max(result["copy_bytes_per_s"] for result in rounds)
    return {**rounds[0], "runs": runs, "copy_bytes_per_s": best_copy}


def point_fields(args, bench: str, policy: str, result: dict, batch: int, context: int) -> dict:
    """A row's fields for one point of a policy's one_batch run (this module's, decode_profile's,
    decode_host's): what ran, on which backend, over which KV, at which budget."""
    return dict(
        bench=bench, policy=policy, model_shape=args.shape, batch=batch, context=context,
        attention_backend=result["backend_flag"],
        kv_source="synthetic" if args.skip_prefill_compute else "real",
        budget=harness.policy_budget(
            policy, harness.policy_config(policy, args.policy_config, args.policies)
        ),
    )  # fmt: skip


def floor_latency_s(result: dict, batch: int, context: int, copy_bytes_per_s: float) -> float:
    """The least time a decode step of ``batch`` requests at ``context`` tokens can take: the
    weights read once, each request's attended tokens' K and V read once, at copy bandwidth."""
    kv_bytes = batch * result["attended_tokens"][str(context)] * result["kv_bytes_per_token"]
    return (result["weight_bytes"] + kv_bytes) / copy_bytes_per_s


def prepare_run(args: argparse.Namespace) -> tuple[RunInfo, Path]:
    """Check the shape, detect where the run happens, and make the engine logs' folder."""
    harness.shape_path(args.shape)
    log_dir = args.log_dir or args.out_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    return RunInfo.detect(), log_dir


def policy_log(
    args, bench: str, policy: str, log_dir: Path, info: RunInfo, round_: int = 0
) -> Path:
    """The engine log of one policy's run, announced on stdout; rounds after the first
    (``round_`` from 0) are named by their number."""
    again = f"-round{round_ + 1}" if round_ else ""
    path = log_dir / f"{bench}-{args.shape}-{harness.file_safe(policy)}{again}.log"
    print(f"{bench}: {policy} on {args.shape} ({info.device}), log {path}", flush=True)
    return path


def partial_path(args: argparse.Namespace, policy: str) -> Path:
    """Where --partial-dir keeps one policy's result for this run's shape and points."""
    points = "-".join(map(str, args.batch)) + "x" + "-".join(map(str, args.context))
    safe = policy if policy == "*" else harness.file_safe(policy)
    return args.partial_dir / f"{BENCH}-partial-{harness.run_label(args)}-{points}-{safe}.json"


def saved_results(args: argparse.Namespace, device: str) -> dict[str, dict]:
    """Every policy saved under --partial-dir for this run's points, by name; all of one device."""
    results = {}
    for path in sorted(args.partial_dir.glob(partial_path(args, "*").name)):
        saved = json.loads(path.read_text())
        if saved["device"] != device:
            raise SystemExit(f"{path}: measured on {saved['device']}, not this run's {device}")
        results[saved["policy"]] = saved["result"]
    return results


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    info, log_dir = prepare_run(args)
    rounds: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    for round_ in range(args.rounds):
        order = args.policies if round_ % 2 == 0 else args.policies[::-1]
        for policy in order:
            log = policy_log(args, BENCH, policy, log_dir, info, round_)
            rounds[policy].append(run_policy(args, policy, log))
            backend = rounds[policy][-1]["attention_backend"]
            print(f"{BENCH}: {policy} decoded with {backend}", flush=True)
            if args.partial_dir:  # kept as it comes: a call that times out keeps what ran
                args.partial_dir.mkdir(parents=True, exist_ok=True)
                merged = merged_rounds(rounds[policy])
                saved = {"policy": policy, "device": info.device, "result": merged}
                partial_path(args, policy).write_text(json.dumps(saved))
    results = {policy: merged_rounds(found) for policy, found in rounds.items()}
    if args.partial_dir:
        results = saved_results(args, info.device)
    # every policy's floor at the best bandwidth any of its processes measured: the device's
    copy_bandwidth = max(result["copy_bytes_per_s"] for result in results.values())
    rows: list[Row] = []
    for policy, result in results.items():
        rows += policy_rows(args, info, policy, result, copy_bandwidth)
    rows += ideal_rows(rows)
    harness.add_baseline_ratios(rows, speed_metric=METRICS[0])
    json_path = harness.save_results(
        BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md
    )
    print(f"plot: {plot.plot_decode_step(rows, json_path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
