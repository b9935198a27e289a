"""End-to-end generation throughput and KV tokens in use, per policy and for vanilla SGLang in
the same run: one server per policy (dummy weights, no tokenizer), N concurrent /generate
requests of random input ids, each decoding exactly --output-len tokens.

    python -m benchmarks.e2e --shape qwen1.5b --policies vanilla,full \
        --requests 64 --input-len 1024 --output-len 1024

KV tokens in use are sampled during the run from SGLang's /v1/loads (``num_used_tokens``: KV slots
held by running requests, not the radix cache's evictable ones), which reads the load snapshot the
scheduler publishes every --kv-publish-steps decode steps, as is the number of requests running at
once. Retractions are counted from the server's log (SGLang logs each with ``#retracted_reqs``).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from benchmarks import harness, plot
from benchmarks.harness import EngineServer, Row, RunInfo

BENCH = "e2e"
# Logged by sglang_ext.backend when an engine process builds a policy backend.
POLICY_ACTIVE_LOG = "decoding with policy"
RETRACTED_LOG = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")


def build_parser() -> argparse.ArgumentParser:
    parser = harness.common_parser(BENCH, __doc__)
    parser.add_argument("--requests", type=int, default=64, help="sent at once")
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
        "--seed", type=int, default=0, help="of the random input ids (same for every policy)"
    )
    return parser


def server_argv(args: argparse.Namespace, policy: str, port: int) -> list[str]:
    flags = [
        "--model-path", str(harness.shape_path(args.shape)),
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--load-snapshot-publish-interval", str(args.kv_publish_steps),
        *harness.engine_flags(args.max_total_tokens, args.tp, args.context_length),
    ]  # fmt: skip
    if policy == harness.VANILLA:
        return [sys.executable, "-m", "sglang.launch_server", *flags]
    config = ["--policy-config", args.policy_config] if args.policy_config else []
    return [sys.executable, "-m", "sglang_ext.launch", "--policy", policy, *config, *flags]


# Greedy tokens are compared one request at a time: in a concurrent batch, GEMM shapes (and so
# the last bits of the logits) depend on which requests happen to share a step, even for vanilla.
GREEDY_CHECK_REQUESTS = 8
GREEDY_CHECK_TOKENS = 64


def generate(url: str, input_ids: list[int], output_len: int) -> list[int]:
    """Sends one request; returns the tokens it generated."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0},
    }
    response = requests.post(f"{url}/generate", json=body, timeout=3600)
    response.raise_for_status()
    return response.json()["output_ids"]


class KvSampler:
    """Polls the server's KV tokens in use from a thread: (seconds since start, tokens) samples."""

    def __init__(self, url: str, interval_s: float):
        self.url, self.interval_s = url, interval_s
        self.samples: list[tuple[float, int]] = []
        self.running: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> KvSampler:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            loads = requests.get(
                f"{self.url}/v1/loads", params={"include": "core"}, timeout=10
            ).json()
            tokens = sum(load["num_used_tokens"] for load in loads["loads"])
            self.samples.append((time.perf_counter() - self._start, tokens))
            self.running.append(sum(load["num_running_reqs"] for load in loads["loads"]))
            self._stop.wait(self.interval_s)


def measure(
    url: str, prompts: list[list[int]], output_len: int, interval_s: float
) -> tuple[float, KvSampler]:
    """Output tokens/s over all requests sent at once, and the sampler of KV and running
    requests meanwhile."""
    generate(url, prompts[0][:16], 4)  # compiles kernels before the clock starts
    with KvSampler(url, interval_s) as sampler, ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        tokens = sum(
            len(out) for out in pool.map(lambda ids: generate(url, ids, output_len), prompts)
        )
        elapsed = time.perf_counter() - start
    return tokens / elapsed, sampler


def greedy_match_rows(info: RunInfo, args, greedy: dict[str, list[list[int]]]) -> list[Row]:
    """Fraction of the greedy check's requests whose tokens equal vanilla's exactly."""
    reference = greedy.get(harness.VANILLA)
    if reference is None:
        return []
    return [
        info.row(
            bench=BENCH, policy=policy, model_shape=args.shape, batch=1, context=args.input_len,
            metric=f"greedy_{GREEDY_CHECK_TOKENS}_tokens_identical_frac",
            value=sum(a == b for a, b in zip(outputs, reference)) / len(reference),
        )
        for policy, outputs in greedy.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if any(policy != harness.VANILLA for policy in args.policies):
        harness.require_plugin_entry_point()
    vocab = harness.shape_config(args.shape)["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    info = RunInfo.detect()
    log_dir = args.log_dir or args.out_dir
    rows: list[Row] = []
    kv_timelines: dict[str, list[tuple[float, int]]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for policy in args.policies:
        port = harness.free_port()
        log_path = log_dir / f"{BENCH}-{args.shape}-{policy}.log"
        print(f"{BENCH}: {policy} on {args.shape} ({info.device}), log {log_path}", flush=True)
        with EngineServer(
            server_argv(args, policy, port), harness.engine_env(), log_path, port
        ) as server:
            server.wait_ready()
            if policy != harness.VANILLA and not POLICY_ACTIVE_LOG in server.log():
                raise RuntimeError(f"{policy}: the server did not load the policy; log {log_path}")
            tok_s, sampler = measure(server.url, prompts, args.output_len, args.sample_interval)
            samples = sampler.samples
            retracted = sum(int(n) for n in RETRACTED_LOG.findall(server.log()))
            greedy[policy] = [
                generate(server.url, ids, GREEDY_CHECK_TOKENS)
                for ids in prompts[:GREEDY_CHECK_REQUESTS]
            ]
        kv_timelines[policy] = samples
        kv_tokens = [tokens for _, tokens in samples] or [0]
        point = dict(
            bench=BENCH,
            policy=policy,
            model_shape=args.shape,
            batch=args.requests,
            context=args.input_len,
        )
        rows += [
            info.row(**point, metric="e2e_output_tok_s", value=tok_s),
            info.row(**point, metric="peak_kv_tokens_in_use", value=float(max(kv_tokens))),
            info.row(
                **point, metric="mean_kv_tokens_in_use", value=sum(kv_tokens) / len(kv_tokens)
            ),
            info.row(
                **point, metric="max_running_requests", value=float(max(sampler.running or [0]))
            ),
            info.row(**point, metric="retracted_requests", value=float(retracted)),
        ]
        print(
            f"{BENCH}: {policy}: {tok_s:.1f} output tok/s, peak KV {max(kv_tokens)} tokens",
            flush=True,
        )
    rows += greedy_match_rows(info, args, greedy)
    harness.add_baseline_ratios(rows)
    json_path = harness.save_results(
        BENCH, harness.run_label(args), rows, info, args.out_dir, args.results_md
    )
    print(f"plot: {plot.plot_e2e(rows, kv_timelines, json_path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
