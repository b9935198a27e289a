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
    parser = decode_step.build_parser()
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
    harness.shape_path(args.shape)
    info = RunInfo.detect()
    log_dir = args.log_dir or args.out_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    kv_source = "synthetic" if args.skip_prefill_compute else "real"
    rows: list[Row] = []
    for policy in args.policies:
        stem = f"{BENCH}-{args.shape}-{harness.file_safe(policy)}"
        print(f"{BENCH}: {policy} on {args.shape} ({info.device}), log {log_dir / stem}.log")
        timing_path = log_dir / f"{stem}.json"
        result = decode_step.run_policy(
            args, policy, log_dir / f"{stem}.log", child_flags=("--host-timing", str(timing_path))
        )
        for key, timing in json.loads(timing_path.read_text()).items():
            batch, context = map(int, key.split(","))
            point = dict(
                bench=BENCH, policy=policy, model_shape=args.shape, batch=batch, context=context,
                attention_backend=result["backend_flag"], kv_source=kv_source,
                budget=harness.policy_budget(policy, args.policy_config),
            )  # fmt: skip
            rows += point_rows(point, timing, args.top, info)
    harness.add_baseline_ratios(rows)
    harness.save_results(BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
