"""Start and stop a real SGLang HTTP server for tests, with its log in a file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int):
        self.argv, self.env, self.log_path, self.port = argv, env, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self) -> "ServerProcess":
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def generate(self, text, max_new_tokens: int = 32, timeout: float = 300) -> dict | list:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        response = requests.post(f"{self.url}/generate", json=body, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the scheduler has no running or queued request (its idle memory check then runs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loads = requests.get(f"{self.url}/v1/loads?include=core", timeout=5).json()["loads"]
            if all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in loads):
                time.sleep(1)  # let a few idle loops (and their checks) pass
                return
            time.sleep(0.5)
        raise TimeoutError(f"server still busy after {timeout}s")
