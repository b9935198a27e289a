"""CPU runtime for the SGLang engine: what a host without CUDA needs to serve.

On such a host SGLang runs with ``SGLANG_USE_CPU_ENGINE=1``, torch_native attention, pytorch
sampling and no CUDA graphs, and needs an importable ``sgl_kernel`` although no op of it is called
for the models we serve (the CUDA wheel cannot load without libcuda). On a CUDA host all of this
is inactive.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

STUBS_DIR = Path(__file__).resolve().parent / "stubs"

# SGLang server flags the CPU engine needs (None: a switch); a flag the user passed wins.
SERVER_FLAGS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--disable-cuda-graph": None,
    # an idle scheduler otherwise polls its sockets in a busy loop, a core that the busy servers of
    # a small host lose (four idle test servers on 2 cores slowed the fifth's decode several-fold)
    "--sleep-on-idle": None,
}


@functools.lru_cache(maxsize=1)
def is_cuda_host() -> bool:
    return torch.cuda.is_available()


def runtime_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an SGLang process needs on this host (a copy; ``base`` defaults to os.environ).

    Child processes started with this environment (servers, spawned schedulers) import the
    sgl_kernel stand-in before any real one, since the real one cannot load here.
    """
    env = dict(os.environ if base is None else base)
    if is_cuda_host():
        return env
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(STUBS_DIR) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(STUBS_DIR), *paths])
    return env


def activate() -> bool:
    """Set up this process (and the ones it spawns) for the CPU engine. Returns whether it did."""
    if is_cuda_host():
        return False
    os.environ.update(runtime_env())
    if str(STUBS_DIR) not in sys.path:
        sys.path.insert(0, str(STUBS_DIR))
    return True


def server_flags() -> dict[str, str | None]:
    """SERVER_FLAGS on a host without CUDA; nothing on a CUDA host."""
    return {} if is_cuda_host() else dict(SERVER_FLAGS)


def as_argv(flags: dict[str, str | None]) -> list[str]:
    return [part for flag, value in flags.items() for part in ([flag] if value is None else [flag, value])]
