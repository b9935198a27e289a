"""The real SGLang HTTP server for tests, with the requests the tests make of it."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import requests

from benchmarks.engine_process import EngineServer, free_port

__all__ = ["ServerProcess", "free_port", "metric", "policy_servers"]


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
