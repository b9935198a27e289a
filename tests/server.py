"""The real SGLang HTTP server for tests, with the requests the tests make of it."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import requests

from benchmarks.engine_process import EngineServer, free_port

__all__ = ["ServerProcess", "assert_pool_exact", "free_port", "metric", "policy_servers"]


class ServerProcess(EngineServer):
    def stop(self, graceful: bool = False) -> None:
        # a test checks the server's state (the strict pool, its metrics) before teardown, and
        # nothing needs the drain: waiting for SGLang's shutdown cost 20-30 s per server on 2 cores
        super().stop(graceful)

    def generate(self, text, max_new_tokens: int = 32, timeout: float = 300) -> dict | list:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        response = requests.post(f"{self.url}/generate", json=body, headers=self.headers, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def metrics(self) -> str:
        return requests.get(f"{self.url}/metrics", headers=self.headers, timeout=60).text

    def abort_mid_stream(self, text: str, after_chunks: int = 8, max_new_tokens: int = 400) -> None:
        """A long greedy generation streamed, left after ``after_chunks`` chunks: the client gone,
        SGLang aborts the request and must release its KV."""
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        body = {"text": text, "stream": True, "sampling_params": sampling}
        with requests.post(
            f"{self.url}/generate", json=body, headers=self.headers, stream=True, timeout=300
        ) as response:
            response.raise_for_status()
            chunks = (line for line in response.iter_lines() if line.startswith(b"data:"))
            for _ in range(after_chunks):
                next(chunks)


# What a server's log shows when a check fired (matched lower-cased): SGLang's strict KV checks
# (conftest's strict_env) "Full Pool Mem Leak Detected!", "... memory leak detected!", "KV double
# free", "KV page use-after-free"; tensor-parallel ranks' "ranks disagree" (policies/base.py); the
# traceback of whatever raised in a process; an IndexError (SGLang's request normalization gave
# 500s of those).
LOG_FAULTS = ("leak", "double free", "use-after-free", "ranks disagree", "traceback", "indexerror")
# A short greedy request any server answers: token ids (servers may run --skip-tokenizer-init)
PROBE = {
    "input_ids": list(range(100, 116)),
    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
}


def _healthy(server, checks: int = 3) -> bool:
    """Whether one of a few /health checks passes. Each is a one-token generation SGLang gives 20 s;
    on 2 cores beside three other servers one was seen to miss it (CI, 2026-11-26), and the next
    one shows whether the server is alive."""
    return any(
        requests.get(f"{server.url}/health", timeout=30).status_code == 200 for _ in range(checks)
    )


def assert_pool_exact(*servers: EngineServer, settle_s: float = 10) -> None:
    """After a test's requests: each server still serves (a short generation, /health), and once
    idle its KV pool is exact, every slot free or the radix cache's: each scheduler (each data-
    parallel worker) reports no token in use (SGLang's ``num_used_tokens``, the pool less its
    free and evictable slots: what its idle conservation check holds, read back here rather than
    trusted to raise), and its log shows no check that fired (``LOG_FAULTS``)."""
    for server in servers:
        name = server.log_path.name
        probe = requests.post(
            f"{server.url}/generate", json=PROBE, headers=server.headers, timeout=300
        )
        assert probe.status_code == 200, (name, probe.status_code, probe.text[:300])
        assert probe.json()["meta_info"]["completion_tokens"] == 4
        assert _healthy(server), name
        server.wait_idle()
        deadline = time.monotonic() + settle_s  # the idle scheduler's last load snapshot
        while True:
            loads = requests.get(
                f"{server.url}/v1/loads?include=core", headers=server.headers, timeout=60
            ).json()["loads"]
            in_use = [load["num_used_tokens"] for load in loads]
            if (in_use and not any(in_use)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert in_use and not any(in_use), f"{name}: KV tokens in use at idle: {loads}"
        lines = server.log().splitlines()
        faulty = [line for line in lines if any(fault in line.lower() for fault in LOG_FAULTS)]
        assert not faulty, f"{name}:\n" + "\n".join(faulty[:20])


def metric(text: str, name: str) -> float:
    """The value of a sample in Prometheus text (summed over its label sets)."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert found, f"{name} not exported"
    return sum(float(value) for value in found)


@contextlib.contextmanager
def policy_servers(model_path, env: dict, log_dir: Path, configs: dict, start_after: str | None = None):
    """One ``sglang_ext.launch`` server per entry of ``configs``, name -> (policy, its config or
    None, further flags), all booting at once; name -> ServerProcess, stopped on exit. With
    ``start_after`` (a log line), each starts once the one before has logged it: servers sharing a
    GPU each size their KV pool from the free memory they find, and must not measure each other's."""
    started = {}
    try:
        for name, (policy, config, flags) in configs.items():
            port = free_port()
            argv = [sys.executable, "-m", "sglang_ext.launch", "--policy", policy]
            if config is not None:
                argv += ["--policy-config", json.dumps(config)]
            argv += ["--model-path", str(model_path), "--port", str(port), *flags]
            started[name] = ServerProcess(argv, env, log_dir / f"{name}.log", port).start()
            if start_after is not None:
                started[name].wait_for_log(start_after)
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()
