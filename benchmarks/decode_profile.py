"""Where a decode step's GPU time goes, kernel by kernel, per policy and for vanilla SGLang in the
same run: SGLang's one-batch benchmark under the torch profiler (CUDA graphs on, dummy weights).

    python -m benchmarks.decode_profile --shape qwen1.5b --policies vanilla@fa3,delta,tidal \\
        --batch 1 --context 32768 --skip-prefill-compute

Per policy and point, rows of each kernel's GPU time per decode step (``kernel_ms:NAME``, or
``kernel_ms:NAME[grid]`` for a kernel launched with several grids; the
``--top`` longest, the rest summed as ``kernel_ms:(other)``), the kernels launched per step
(``kernels_per_step``) and their summed time (``gpu_busy_ms``); the GPU's idle time between a
step's kernels (``gpu_idle_in_step_ms``, gaps up to HOST_GAP_US: launch latency) and between steps
(``host_gap_ms``: host work the GPU waits for). The profiled steps are not the timed ones:
benchmarks.decode_step measures latency without the profiler.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import tempfile
from pathlib import Path

from benchmarks import decode_step, harness
from benchmarks.harness import Row, RunInfo

BENCH = "decode_profile"


def build_parser():
    parser = decode_step.build_parser(rounds=False)
    parser.prog, parser.description = f"python -m benchmarks.{BENCH}", __doc__.split("\n\n")[0]
    parser.set_defaults(batch=[1], context=[32768], output_len=8)
    parser.add_argument("--profile-steps", type=int, default=3, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=14, help="kernels named per policy and point")
    return parser


# A GPU gap longer than this is the host's (sampling's read-back, the next step's preparation);
# shorter ones are launch latency between kernels inside a step's CUDA graph.
HOST_GAP_US = 50.0


def trace_events(trace_path: Path) -> list[dict]:
    """The events of a torch-profiler chrome trace (gzipped)."""
    with gzip.open(trace_path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernel_events(trace_path: Path) -> list[dict]:
    """The GPU kernels of a torch-profiler chrome trace, in start order."""
    return kernels_of(trace_events(trace_path))


def kernels_of(events: list[dict]) -> list[dict]:
    kernels = [event for event in events if event.get("cat") == "kernel"]
    return sorted(kernels, key=lambda event: float(event["ts"]))


def whole_graph_steps(events: list[dict]) -> tuple[list[dict], int] | None:
    """The kernels of a trace's whole decode steps and how many: those from the first CUDA graph
    replay's first kernel to the last replay's (each decode step replays one graph), whatever
    launched them; None with fewer than two replays. A trace started or stopped mid-step (a
    server profiled while it runs) holds parts of steps at either end."""
    replays = {
        event["args"]["correlation"]
        for event in events
        if event.get("name") == "cudaGraphLaunch" and "correlation" in event.get("args", {})
    }
    kernels = kernels_of(events)
    first_kernel: dict[int, float] = {}
    for kernel in kernels:  # in start order
        first_kernel.setdefault(kernel.get("args", {}).get("correlation"), float(kernel["ts"]))
    starts = sorted(ts for correlation, ts in first_kernel.items() if correlation in replays)
    if len(starts) < 2:
        return None
    inside = [k for k in kernels if starts[0] <= float(k["ts"]) < starts[-1]]
    return inside, len(starts) - 1


def idle_gaps_us(kernels: list[dict]) -> tuple[float, float]:
    """(idle µs between kernels in gaps up to HOST_GAP_US, idle µs in longer gaps)."""
    short = long = 0.0
    end = None
    for event in kernels:
        start = float(event["ts"])
        if end is not None and start > end:
            if start - end <= HOST_GAP_US:
                short += start - end
            else:
                long += start - end
        end = max(end or start, start + float(event["dur"]))
    return short, long


def kernel_times_us(kernels: list[dict]) -> dict[str, list[float]]:
    """Each GPU kernel's durations (µs), by kernel name; a kernel launched with several grids is
    split by grid, ``NAME[x,y,z]`` (our split-KV stage 1 over the whole cache and over selected
    pages are one kernel with different grids)."""
    by_grid = collections.defaultdict(lambda: collections.defaultdict(list))
    for event in kernels:
        grid = ",".join(map(str, event.get("args", {}).get("grid", [])))
        by_grid[short_name(event["name"])][grid].append(float(event["dur"]))
    times = {}
    for name, grids in by_grid.items():
        for grid, durations in grids.items():
            times[name if len(grids) == 1 else f"{name}[{grid}]"] = durations
    return times


def short_name(kernel: str) -> str:
    """A kernel's name without template arguments and namespaces, up to 60 characters."""
    name = re.sub(r"<.*", "", kernel.split("(")[0]).strip()
    return name.rsplit("::", 1)[-1][:60] or kernel[:60]


def step_profile(
    kernels: list[dict], steps: int, top: int, periods: bool = False
) -> dict[str, float]:
    """Per step of ``steps`` profiled: each of the ``top`` longest kernels' GPU time
    (``kernel_ms:NAME``, the rest as ``kernel_ms:(other)``), the kernels launched, their summed
    time and the GPU's idle time inside steps and between them (ms). ``periods``: the kernels
    span ``steps`` whole step periods, each with its gap (``whole_graph_steps``)."""
    times = kernel_times_us(kernels)
    per_step = {name: sum(durations) / steps / 1e3 for name, durations in times.items()}
    ranked = sorted(per_step.items(), key=lambda item: -item[1])
    metrics = {f"kernel_ms:{name}": ms for name, ms in ranked[:top]}
    metrics["kernel_ms:(other)"] = sum(ms for _, ms in ranked[top:])
    metrics["kernels_per_step"] = sum(len(durations) for durations in times.values()) / steps
    metrics["gpu_busy_ms"] = sum(per_step.values())
    # the profiled steps' kernels lie between the first's and the last's: steps - 1 host gaps
    short, long = idle_gaps_us(kernels)
    metrics["gpu_idle_in_step_ms"] = short / steps / 1e3
    gaps = steps if periods else steps - 1
    if gaps:
        metrics["host_gap_ms"] = long / gaps / 1e3
    return metrics


def profile_rows(point: dict, kernels: list[dict], steps: int, top: int, info) -> list:
    metrics = step_profile(kernels, steps, top)
    return [info.row(**point, metric=name, value=value) for name, value in metrics.items()]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    info, log_dir = decode_step.prepare_run(args)
    rows: list[Row] = []
    for policy in args.policies:
        log_path = decode_step.policy_log(args, BENCH, policy, log_dir, info)
        with tempfile.TemporaryDirectory() as traces:
            flags = (
                "--profile", "--profile-stage", "decode", "--profile-activities", "GPU",
                "--profile-start-step", str(args.output_len - 1 - args.profile_steps),
                "--profile-steps", str(args.profile_steps), "--profile-prefix", "p",
            )  # fmt: skip
            os.environ["SGLANG_TORCH_PROFILER_DIR"] = traces  # where one_batch writes traces
            result = decode_step.run_policy(args, policy, log_path, flags)
            for trace in sorted(Path(traces).glob("p_batch*_decode.trace.json.gz")):
                batch, context = map(int, re.findall(r"batch(\d+)_input(\d+)", trace.name)[0])
                point = decode_step.point_fields(args, BENCH, policy, result, batch, context)
                kernels = kernel_events(trace)
                rows += profile_rows(point, kernels, args.profile_steps, args.top, info)
    harness.save_results(BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
