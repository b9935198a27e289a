"""Host time the engine adapter adds to every decode step, per batch size, on this machine's CPU:
the batch's per-request view (``engine.requests.step_requests``), each request's report
(``PolicyRuntime.report``) and the step's report entries (``server.report.step_entries``). SGLang's
one-batch benchmark runs a step synchronously, so this time adds to every measured decode step.

    python -m benchmarks.host_step --policies full,delta --batch 1,64,256

The requests are stand-ins with the fields the adapter reads from SGLang's ``Req``; the runtime is
the policy's own ``report`` on its model-sized layer lists.
"""

from __future__ import annotations

import argparse
import timeit
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness
from benchmarks.harness import RunInfo
from sglang_ext.engine import requests
from sglang_ext.policies import build_policy
from sglang_ext.policies.runtime import PolicyRuntime, RequestState
from sglang_ext.server import report

BENCH = "host_step"
NUM_LAYERS, CONTEXT = 28, 8192  # the qwen1.5b shape's depth, a decode at 8k tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{BENCH}", description=__doc__)
    parser.add_argument("--policies", type=harness.name_list, default=["full", "delta", "tidal"])
    parser.add_argument("--batch", type=harness.int_list, default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per point")
    parser.add_argument("--out-dir", type=Path, default=harness.DEFAULT_OUT_DIR)
    parser.add_argument("--results-md", type=Path, default=harness.DEFAULT_RESULTS_MD)
    return parser


def step_fn(policy_name: str, batch: int):
    """One decode step's adapter host work for ``batch`` requests decoding under the policy."""
    ctx = SimpleNamespace(num_layers=NUM_LAYERS, model_fingerprint=None)
    policy = build_policy(policy_name)
    if hasattr(policy, "for_model"):
        policy = policy.for_model(ctx)
    runtime = SimpleNamespace(policy=policy, ctx=ctx)
    reqs = []
    for i in range(batch):
        req = SimpleNamespace(
            rid=f"r{i}", req_pool_idx=i, origin_input_ids=range(CONTEXT), output_ids=[0] * 16,
            cache_protected_len=0,
        )  # fmt: skip
        setattr(req, requests._STATE, RequestState(policy))
        reqs.append(req)
    seq_lens = [CONTEXT + 16] * batch

    def step():
        batch_view = requests.step_requests(runtime, reqs, seq_lens)
        reports = [PolicyRuntime.report(runtime, r, extend=False) for r in batch_view]
        report.step_entries(reports)

    return step


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    info = RunInfo.detect()
    rows = []
    for name in args.policies:
        for batch in args.batch:
            step = step_fn(name, batch)
            # the best of five: the least disturbed by other work on the machine
            ms = min(timeit.repeat(step, number=args.steps, repeat=5)) / args.steps * 1e3
            rows.append(info.row(
                bench=BENCH, policy=name, model_shape="qwen1.5b", batch=batch, context=CONTEXT,
                metric="host_step_ms", value=ms, kv_source="synthetic",  # no KV: host work only
                budget=harness.policy_budget(name, None),
            ))  # fmt: skip
    harness.save_results(BENCH, "qwen1.5b", rows, info, args.out_dir, args.results_md)


if __name__ == "__main__":
    main()
