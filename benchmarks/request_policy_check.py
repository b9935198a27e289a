"""Per-request policies on a GPU server (CUDA graphs on), SmolLM2's real weights: the checks of
tests/test_engine_selection.py and tests/test_engine_art.py where the CPU tests cannot reach
(compiled kernels, graphs, bf16). One server at a time (several on one GPU would profile each
other's memory); prints a JSON object of checks and writes it under --out-dir.

    source benchmarks/gpu_smol_model.sh && python -m benchmarks.request_policy_check --out-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.engine_process import EngineServer, engine_env, free_port

# ~2.7k tokens of similar facts: more than tidal's default 1024-token budget
PROMPT = " ".join(
    f"Fact {i}: the {color} box holds {i * 7} marbles."
    for i, color in enumerate(["red", "blue", "green", "yellow", "white"] * 40)
) + " Question: how many marbles does the green box of fact 2 hold? Answer:"
LOOSE_ART = {"tau": 1e-2, "phi": 1e-1, "patience": 1}


def generate(url: str, kv_policy: dict | None = None, tokens: int = 24) -> dict:
    sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if kv_policy is not None:
        sampling["custom_params"] = {"kv_policy": kv_policy}
    response = requests.post(f"{url}/generate", json={"text": PROMPT, "sampling_params": sampling}, timeout=300)
    response.raise_for_status()
    return response.json()


@contextlib.contextmanager
def serving(out_dir: Path, checks: dict, name: str, policy: str, config: dict):
    port = free_port()
    argv = [sys.executable, "-m", "sglang_ext.launch", "--policy", policy, "--policy-config",
            json.dumps(config), "--port", str(port), "--log-level", "info", "--enable-metrics"]  # fmt: skip
    with EngineServer(argv, engine_env(), out_dir / f"{name}.log", port) as server:
        server.wait_ready()
        yield server.url
        server.wait_idle()
        log = server.log()
        checks[f"{name}: no traceback or leak"] = "Traceback" not in log and "leak" not in log.lower()


def run(out_dir: Path) -> dict:
    checks: dict = {}
    with serving(out_dir, checks, "full", "full", {}) as url:
        full = generate(url)["output_ids"]
    with serving(out_dir, checks, "tidal_small", "tidal", {"budget_tokens": 64}) as url:
        small = generate(url)["output_ids"]
    with serving(out_dir, checks, "tidal", "tidal", {}) as url:
        with ThreadPoolExecutor(2) as pool:  # one batch: own budget beside the server's
            mine, default = pool.map(lambda spec: generate(url, spec), [{"budget_tokens": 64}, None])
        checks["tidal: own 64-token budget gives the 64-token server's tokens"] = mine["output_ids"] == small
        checks["tidal: attended tokens, own 64 vs server's 1024"] = [
            mine["meta_info"]["kv_attended_tokens"][-1], default["meta_info"]["kv_attended_tokens"][-1]
        ]  # fmt: skip
        checks["tidal: the other request of the batch gives its tokens alone (bf16: batch-dependent)"] = (
            default["output_ids"] == generate(url)["output_ids"]
        )  # fmt: skip
    with serving(out_dir, checks, "art", "art", {}) as url:
        checks["art: {name: full} gives full's tokens"] = generate(url, {"name": "full"})["output_ids"] == full
        checks["art: patience 0 gives full's tokens"] = generate(url, {"patience": 0})["output_ids"] == full
        checks["art: defaults give full's tokens"] = generate(url)["output_ids"] == full
        generate(url, LOOSE_ART)
        generate(url, tokens=4)  # a later step publishes the counts
        metrics = requests.get(f"{url}/metrics", timeout=30).text
        checks["art: metrics"] = [line for line in metrics.splitlines() if line.startswith("sglang_ext:art")]
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.request_policy_check", description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/request_policy_check"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    checks = run(args.out_dir)
    (args.out_dir / "checks.json").write_text(json.dumps(checks, indent=1) + "\n")
    print(json.dumps(checks, indent=1))


if __name__ == "__main__":
    main()
