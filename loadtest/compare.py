"""The same locust load against one server per policy, one after another, the first policy the
baseline: output tokens per second, time to first token and inter-token latency, each policy's
ratio to the baseline's, from the same run. Every request generates its max tokens
(LOADTEST_IGNORE_EOS), so the policies serve the same work.

    python -m loadtest.compare --policies full,delta,art --users 32 --duration 90s \\
        --prompt-words 512,2048 --max-tokens 128 --locust /tmp/locust/bin/locust \\
        --results-md benchmarks/RESULTS.md -- --model-path PATH --cuda-graph-max-bs 64

Flags after ``--`` go to every ``sglang_ext.launch`` server. ``--policy-configs`` gives a policy its
``--policy-config`` (a JSON object: policy -> config). Each server is warmed up (one short and
one long request) before its load, and after it must be idle, healthy and leak-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests

from benchmarks.harness import RunInfo
from loadtest import driver
from benchmarks.engine_process import EngineServer, engine_env, free_port

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="full,lethe", help="comma list; the first is the baseline")
    parser.add_argument("--policy-configs", type=json.loads, default={}, help="JSON: policy -> its --policy-config")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--duration", default="60s", help="locust --run-time per policy")
    parser.add_argument("--prompt-words", default="256,1024", help="LOADTEST_PROMPT_WORDS")
    parser.add_argument("--max-tokens", default="128", help="LOADTEST_MAX_TOKENS")
    parser.add_argument("--locust", required=True, help="the locust executable")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "compare")
    parser.add_argument("--results-md", type=Path, default=None, help="append a section here")
    parser.add_argument("server_args", nargs="*", help="after --: flags for every server")
    return parser


def summarize(stats: dict[str, dict], seconds: float) -> dict:
    """Totals over both routes: requests, failures, output tokens/s; TTFT and ITL of /generate."""
    requested = {k: v for k, v in stats.items() if driver.is_request(k)}
    # every streamed token is one TTFT or ITL event (loadtest/locustfile.py)
    tokens = sum(v["requests"] for k, v in stats.items() if k.split(" ", 1)[1].startswith(("TTFT", "ITL")))
    ttft, itl = stats.get("STREAM TTFT /generate", {}), stats.get("STREAM ITL /generate", {})
    return {
        "requests": sum(v["requests"] for v in requested.values()),
        "failed": sum(v["failures"] for v in requested.values()),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": ttft.get("p50_ms"), "ttft_p95_ms": ttft.get("p95_ms"),
        "itl_p50_ms": itl.get("p50_ms"), "itl_p95_ms": itl.get("p95_ms"),
        "itl_mean_ms": round(itl["mean_ms"], 2) if itl else None,
    }  # fmt: skip


def warm_up(url: str, long_words: int) -> None:
    """Requests of the load's kinds before it is timed: a long prompt, and a sampled chat (the
    model's default top_p): sampling kernels that compile on first use do it here."""
    for words in (16, long_words):
        body = {"text": "word " * words, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        requests.post(f"{url}/generate", json=body, timeout=600).raise_for_status()
    chat = {"model": "default", "messages": [{"role": "user", "content": "word " * 16}],
            "max_tokens": 8, "temperature": 0.7}  # fmt: skip
    requests.post(f"{url}/v1/chat/completions", json=chat, timeout=600).raise_for_status()


def run_policy(policy: str, args, mix: dict[str, str]) -> dict:
    out = args.out_dir / policy
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "sglang_ext.launch", "--policy", policy, "--port", str(port)]
    if policy in args.policy_configs:
        argv += ["--policy-config", json.dumps(args.policy_configs[policy])]
    argv += ["--log-level", "info", *args.server_args]
    with EngineServer(argv, engine_env(), out / "server.log", port) as server:
        server.wait_ready()
        warm_up(server.url, max(int(w) for w in args.prompt_words.split(",")))
        seconds = driver.run_locust(args.locust, server.url, out, args.users, args.duration, mix)
        after = driver.settle(server)
    result = {"policy": policy, "load_seconds": round(seconds, 1),
              **summarize(driver.read_stats(out / "locust_stats.csv"), seconds),
              "healthy_after": after["healthy_after"],
              "leak_or_traceback_in_log": after["leak_or_traceback_in_log"]}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


RATIOS = ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_mean_ms")


def compare(args) -> dict:
    info = RunInfo.detect()
    mix = {"LOADTEST_PROMPT_WORDS": args.prompt_words, "LOADTEST_MAX_TOKENS": args.max_tokens,
           "LOADTEST_IGNORE_EOS": "1"}  # fmt: skip
    results = [run_policy(policy, args, mix) for policy in args.policies.split(",")]
    base = results[0]
    for result in results:
        for key in RATIOS:
            ok = result[key] is not None and base[key]
            result[f"{key}_vs_{base['policy']}"] = round(result[key] / base[key], 3) if ok else None
    report = {"device": info.device, "sglang": info.sglang_version, "torch": info.torch_version,
              "date": info.date, "command": info.command, "users": args.users, "duration": args.duration,
              "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
              "server_args": args.server_args, "policy_configs": args.policy_configs, "results": results}  # fmt: skip
    (args.out_dir / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def results_section(report: dict) -> str:
    keys = ["policy", "requests", "failed", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms",
            "itl_p50_ms", "itl_p95_ms", "itl_mean_ms"]  # fmt: skip
    base = report["results"][0]["policy"]
    ratio_keys = [f"{k}_vs_{base}" for k in RATIOS]
    lines = [
        f"## loadtest · {report['device']} · {report['date']}", "",
        f"- command: `{report['command']}`",
        f"- sglang {report['sglang']}, torch {report['torch']}; {report['users']} locust users for "
        f"{report['duration']} per policy, streaming /generate and /v1/chat/completions, prompt words "
        f"{report['prompt_words']}, max tokens {report['max_tokens']} (ignore_eos), server flags "
        f"`{' '.join(report['server_args'])}`, policy configs `{json.dumps(report['policy_configs'])}`",
        "- TTFT and ITL of /generate as the client measured them (locust, same host as the server)",
        "", "| " + " | ".join(keys + ratio_keys) + " |", "|" + " ---: |" * len(keys + ratio_keys),
    ]  # fmt: skip
    for result in report["results"]:
        lines.append("| " + " | ".join(str(result[k]) for k in keys + ratio_keys) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    report = compare(args)
    if args.results_md:
        with open(args.results_md, "a") as md:
            md.write(results_section(report) + "\n")
    clean = all(r["failed"] == 0 and r["healthy_after"] and not r["leak_or_traceback_in_log"]
                for r in report["results"])  # fmt: skip
    sys.exit(0 if clean else 1)


if __name__ == "__main__":
    main()
