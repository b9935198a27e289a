"""The real SGLang HTTP server for tests, with the requests the tests make of it."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import requests

from sglang_ext.engine_process import EngineServer, free_port

__all__ = ["ServerProcess", "free_port", "policy_servers"]


class ServerProcess(EngineServer):
    def generate(self, text, max_new_tokens: int = 32, timeout: float = 300) -> dict | list:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        response = requests.post(f"{self.url}/generate", json=body, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 120) -> None:
        """Until the scheduler has no running or queued request (its idle memory check then runs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # the loads query waits on a scheduler that, on 2 cores beside other servers, can lag
                loads = requests.get(f"{self.url}/v1/loads?include=core", timeout=30).json()["loads"]
            except requests.Timeout:
                continue
            if all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in loads):
                time.sleep(1)  # let a few idle loops (and their checks) pass
                return
            time.sleep(0.5)
        raise TimeoutError(f"server still busy after {timeout}s")


@contextlib.contextmanager
def policy_servers(model_path, env: dict, log_dir: Path, configs: dict):
    """One ``sglang_ext.launch`` server per entry of ``configs``, name -> (policy, its config or
    None, further flags), all booting at once; name -> ServerProcess, stopped on exit."""
    started = {}
    try:
        for name, (policy, config, flags) in configs.items():
            port = free_port()
            argv = [sys.executable, "-m", "sglang_ext.launch", "--policy", policy]
            if config is not None:
                argv += ["--policy-config", json.dumps(config)]
            argv += ["--model-path", str(model_path), "--port", str(port), *flags]
            started[name] = ServerProcess(argv, env, log_dir / f"{name}.log", port).start()
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()
