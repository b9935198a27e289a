"""An SGLang HTTP server in a subprocess, for tests, benchmarks and load tests.

It runs in its own process group, logging to a file; stopping it ends the whole group (the
scheduler and detokenizer processes SGLang spawns included).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

from sglang_ext.config import POLICY_ENV
from sglang_ext.launch import flag_value
from sglang_ext.platform import cpu


_HANDED_OUT: set[int] = set()
_PORT_TAKEN = ("error while attempting to bind on address", "EADDRINUSE")


def free_port() -> int:
    """A free port never handed out before by this process: servers started side by side bind
    theirs only after loading, and must not be given each other's."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def log_tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def engine_env() -> dict[str, str]:
    """The environment of an engine process: this host's runtime, and no inherited policy
    (a server started by sglang_ext.launch sets its own)."""
    env = cpu.runtime_env()
    env.pop(POLICY_ENV, None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class EngineServer:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int):
        self.argv, self.env, self.log_path, self.port = argv, env, log_path, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}  # what its clients send

    def start(self) -> EngineServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv)
        data_parallel = any(
            flag_value(argv, flag, "1") != "1" for flag in ("--dp-size", "--data-parallel-size")
        )
        if "--nccl-port" not in argv and not data_parallel:
            # SGLang picks its torch.distributed port at start-up and binds it later; servers
            # starting together raced for the same one (EADDRINUSE). Hand it out like the HTTP port.
            # Not under --dp-size: every data-parallel worker would take that one port (SGLang
            # then reserves one per worker itself).
            argv += ["--nccl-port", str(free_port())]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 900) -> EngineServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            tail = log_tail(self.log_path, 6000)
            # Another server starting beside it took one of its ports for a socket of its own in
            # the meantime: SGLang then waits forever (HTTP) or exits (torch.distributed). Start
            # again on fresh ports.
            if any(sign in tail for sign in _PORT_TAKEN):
                self.stop()
                self._move_to(free_port())
                self.start()
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s}s:\n{log_tail(self.log_path)}")

    def wait_for_log(self, marker: str, timeout_s: float = 300) -> EngineServer:
        """Until the server's log shows ``marker``; a server that exits first raises with its log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if marker in self.log():
                return self
            if self.proc.poll() is not None:
                tail = log_tail(self.log_path)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{tail}")
            time.sleep(0.5)
        raise TimeoutError(f"no {marker!r} after {timeout_s}s:\n{log_tail(self.log_path)}")

    def wait_idle(self, timeout: float = 120) -> None:
        """Until the scheduler has no running or queued request (its idle memory check then runs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # the loads query waits on a scheduler that, on 2 cores beside other servers, can lag
                loads = requests.get(
                    f"{self.url}/v1/loads?include=core", headers=self.headers, timeout=30
                ).json()["loads"]
            except requests.Timeout:
                continue
            if all(load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0 for load in loads):
                time.sleep(1)  # let a few idle loops (and their checks) pass
                return
            time.sleep(0.5)
        raise TimeoutError(f"server still busy after {timeout}s")

    def _move_to(self, port: int) -> None:
        if "--port" in self.argv:
            self.argv[self.argv.index("--port") + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM to the server, which drains and shuts its own children down, then the group
        is killed; ``graceful=False`` kills the group at once (SGLang's drain and shutdown take
        5-30 s)."""
        if self.proc is None:
            return
        if graceful and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever child outlived it
        except ProcessLookupError:
            pass
        self.proc.wait()
