"""Soak: a server of several policies (``--policy lethe,delta,tidal,full``: Lethe with rounds
from ``--evict-threshold`` tokens, DELTA and Tidal at budgets the prompts pass), its KV
conservation checks strict, loaded by locust (loadtest/locustfile.py: streaming /generate and
chat, each request one of the policies, a fraction of /generate requests aborted on purpose) for
``--duration``; then it must be idle with an exact pool, healthy, its log free of leaks and
tracebacks, and no request may have failed that was not aborted on purpose.

    python -m loadtest.soak --duration 10m --results-md benchmarks/RESULTS.md   # the long one
    python -m loadtest.soak --duration 60s                                    # CI's (tests/)
    python -m loadtest.soak --duration 10m --users 32 --prompt-words 256,2048 \\
        --max-tokens 64,512 -- --cuda-graph-max-bs 64                        # on a GPU host

On the CPU the server runs in float32 with one thread per op (the CPU engine's settings); on a
GPU host in the model's dtype with CUDA graphs. Flags after ``--`` go to the server.

Writes locust's CSVs and HTML and a JSON summary under --out-dir; exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import requests
import torch

from benchmarks.harness import RunInfo
from loadtest import driver
from benchmarks.engine_process import EngineServer, engine_env, free_port
from sglang_ext.server.metrics import by_policy

HERE = Path(__file__).resolve().parent
POLICY = "lethe,delta,tidal,full"
# per request, one of (None: the server's first, Lethe at its settings)
KV_POLICIES = [
    None, {"name": "full"}, {"name": "lethe", "recent_ratio": 0.5, "evict_threshold": 96},
    {"name": "delta"}, {"name": "tidal", "budget_tokens": 32},
]  # fmt: skip
ROUND = re.compile(r"lethe round \d+ of")
SELECTED = re.compile(r"sglang_ext: (\w+) layer \d+ first selected fewer")
ATTENDED = "sglang_ext:attended_tokens_per_step"  # a histogram, labelled by each request's policy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="10m", help="locust --run-time (e.g. 60s, 10m)")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--abort-fraction", type=float, default=0.2)
    parser.add_argument("--evict-threshold", type=int, default=128)
    parser.add_argument("--prompt-words", default="32,256", help="LOADTEST_PROMPT_WORDS")
    parser.add_argument("--max-tokens", default="16,64", help="LOADTEST_MAX_TOKENS")
    parser.add_argument("--locust", default=os.environ.get("LOCUST") or shutil.which("locust"),
                        help="the locust executable (default: $LOCUST, else on PATH)")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "soak")
    parser.add_argument("--results-md", type=Path, default=None, help="append a section here")
    parser.add_argument("server_args", nargs="*", help="after --: flags for the server")
    return parser


def policy_config(evict_threshold: int) -> dict:
    return {
        "lethe": {"evict_threshold": evict_threshold},
        "delta": {"budget_pages": 4, "recent_pages": 1}, "tidal": {"budget_tokens": 64},
    }  # fmt: skip


def decoded_by_policy(metrics: str) -> dict[str, dict]:
    """From the server's /metrics: per policy, the decode steps its requests ran (one per request
    and step) and the tokens such a step attended on average (over layers). Unlike the selection
    log line, which only a step outside a CUDA graph writes, this counts every step."""
    steps, tokens = (by_policy(metrics, f"{ATTENDED}_{part}") for part in ("count", "sum"))
    return {
        policy: {"request_steps": int(n), "mean_attended_tokens": round(tokens[policy] / n, 1)}
        for policy, n in sorted(steps.items())
        if n
    }


def run(args) -> dict:
    if not args.locust:
        raise SystemExit("--locust: no locust executable (pip install locust, or pass its path)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    info = RunInfo.detect()
    port = free_port()
    env = engine_env()
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    argv = [
        sys.executable, "-m", "sglang_ext.launch", "--policy", POLICY,
        "--policy-config", json.dumps(policy_config(args.evict_threshold)),
        "--port", str(port), "--enable-metrics", "--log-level", "info",
    ]  # fmt: skip
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = "1"
        argv += ["--dtype", "float32"]
    argv += args.server_args
    log_path = args.out_dir / "server.log"
    with EngineServer(argv, env, log_path, port) as server:
        server.wait_ready()
        (args.out_dir / "server_url").write_text(server.url)  # for a watcher (loadtest/gpu_soak.sh)
        mix = {
            "LOADTEST_ABORT_FRACTION": str(args.abort_fraction),
            "LOADTEST_KV_POLICIES": json.dumps(KV_POLICIES),
            "LOADTEST_PROMPT_WORDS": args.prompt_words, "LOADTEST_MAX_TOKENS": args.max_tokens,
        }  # fmt: skip
        loaded_s = driver.run_locust(args.locust, server.url, args.out_dir, args.users, args.duration, mix)
        after = driver.settle(server)
        metrics = requests.get(f"{server.url}/metrics", headers=server.headers, timeout=60).text
        (args.out_dir / "server_url").unlink()  # the server stops next: the watcher stops probing
    totals = driver.read_stats(args.out_dir / "locust_stats.csv")
    requested = {k: v for k, v in totals.items() if driver.is_request(k)}
    summary = {
        "date": info.date, "device": info.device, "sglang": info.sglang_version,
        "duration": args.duration, "load_seconds": round(loaded_s, 1), "users": args.users,
        "abort_fraction": args.abort_fraction, "policy": POLICY, "kv_policies": KV_POLICIES,
        "evict_threshold": args.evict_threshold, "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens, "server_args": args.server_args,
        "requests": sum(v["requests"] for v in requested.values()),
        "failed": sum(v["failures"] for v in requested.values()),
        "aborted_on_purpose": sum(v["requests"] for k, v in totals.items() if "ABORTED" in k),
        "eviction_rounds": len(ROUND.findall(after["log"])),
        "selected": sorted(set(SELECTED.findall(after["log"]))),  # policies whose budget bit
        "decoded_by_policy": decoded_by_policy(metrics),
        "healthy_after": after["healthy_after"],
        "leak_or_traceback_in_log": after["leak_or_traceback_in_log"],
        "entries": totals,
    }
    summary["passed"] = (
        summary["failed"] == 0 and summary["healthy_after"] and not summary["leak_or_traceback_in_log"]
        and summary["requests"] > 0 and summary["eviction_rounds"] > 0
        and set(POLICY.split(",")) <= set(summary["decoded_by_policy"])  # each one decoded
    )  # fmt: skip
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def results_section(summary: dict, command: str) -> str:
    keys = ["requests", "failed", "aborted_on_purpose", "eviction_rounds", "selected", "healthy_after",
            "leak_or_traceback_in_log", "passed"]  # fmt: skip
    decoded = summary["decoded_by_policy"]
    return "\n".join([
        f"## soak · {summary['policy']} · {summary['device']} · {summary['date']}", "",
        f"- command: `{command}`",
        f"- sglang {summary['sglang']}; {summary['users']} locust users for {summary['duration']} "
        f"({summary['load_seconds']} s), prompts of {summary['prompt_words']} words, "
        f"{summary['max_tokens']} tokens at most, "
        f"{summary['abort_fraction']:.0%} of /generate aborted on purpose, per-request kv_policy mix "
        f"{json.dumps(summary['kv_policies'])}, policy config "
        f"{json.dumps(policy_config(summary['evict_threshold']))}, "
        "SGLang's strict KV checks on",
        "", "| " + " | ".join(keys) + " |", "|" + " ---: |" * len(keys),
        "| " + " | ".join(str(summary[k]) for k in keys) + " |", "",
        "| policy | request decode steps | mean tokens attended per step |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {d['request_steps']} | {d['mean_attended_tokens']} |"
          for name, d in decoded.items()),
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "entries"}, indent=1), flush=True)
    if args.results_md:
        command = "python -m loadtest.soak " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.results_md, "a") as md:
            md.write(results_section(summary, command) + "\n")
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
