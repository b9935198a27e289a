"""Where a decode step's host time goes on the GPU engine, per policy and for vanilla SGLang in the
same run: SGLang's one-batch benchmark (CUDA graphs on, dummy weights), its steps timed and
profiled on the host (benchmarks.host_timing).

    python -m benchmarks.decode_host --shape qwen1.5b --policies vanilla@fa3,full,delta \\
        --batch 1,32 --context 32768 --skip-prefill-compute

Per policy and point: ``host_latency_to_launch_ms``, the host time from the step's call to its
CUDA graph's launch (the GPU waits for it: one_batch syncs every step); ``host_latency_call_ms``,
the call's whole host time (its launches included; a host sync inside it shows up here);
``decode_step_latency_ms``, the step to the GPU's end, on the same timed steps; and
``host_ms:FUNCTION``, the ``--top`` functions by cumulative time per step under cProfile (steps
apart from the timed ones: its overhead inflates Python, so these rank the parts, they do not
time them). Each point's whole profile is written as text beside the engine logs. The host
measures of benchmarks.host_step are the adapter's alone, on this machine's CPU.
"""

from __future__ import annotations

import json

from benchmarks import decode_step, harness
from benchmarks.harness import Row, RunInfo

BENCH = "decode_host"
TIMED = (
    ("host_latency_to_launch_ms", "host_to_launch_ms"),
    ("host_latency_call_ms", "host_call_ms"),
    ("decode_step_latency_ms", "step_ms"),
)


def build_parser():
    parser = decode_step.build_parser(rounds=False)
    parser.prog, parser.description = f"python -m benchmarks.{BENCH}", __doc__.split("\n\n")[0]
    parser.set_defaults(batch=[1, 32], context=[32768], output_len=24)
    parser.add_argument("--top", type=int, default=16, help="functions named per policy and point")
    return parser


def point_rows(point: dict, timing: dict, top: int, info: RunInfo) -> list[Row]:
    rows = [info.row(**point, metric=metric, value=timing[key]) for metric, key in TIMED]
    for name, ms in timing["functions"][:top]:
        rows.append(info.row(**point, metric=f"host_ms:{name}", value=ms))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    info, log_dir = decode_step.prepare_run(args)
    rows: list[Row] = []
    for policy in args.policies:
        log_path = decode_step.policy_log(args, BENCH, policy, log_dir, info)
        timing_path = log_path.with_suffix(".json")
        result = decode_step.run_policy(
            args, policy, log_path, child_flags=("--host-timing", str(timing_path))
        )
        for key, timing in json.loads(timing_path.read_text()).items():
            batch, context = map(int, key.split(","))
            point = decode_step.point_fields(args, BENCH, policy, result, batch, context)
            rows += point_rows(point, timing, args.top, info)
    harness.add_baseline_ratios(rows, speed_metric="decode_step_latency_ms")
    harness.save_results(BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
