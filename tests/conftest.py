import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter, which must be on before any module
# (sglang, a kernel) first imports triton: here, before the tests are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang_ext import model  # noqa: E402


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The embedded SmolLM2 model, converted once (into the user's cache unless overridden)."""
    return model.default_model_path()


@pytest.fixture(scope="session")
def strict_env() -> dict[str, str]:
    """Environment for engine processes: SGLang's idle and busy KV conservation checks raise on a leak."""
    from benchmarks.engine_process import engine_env

    env = engine_env()
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    # One torch thread per server: tests run two engines side by side on a 2-core machine, and
    # oversubscribed OpenMP threads slow decoding a hundredfold.
    env["OMP_NUM_THREADS"] = "1"
    return env


def pytest_collection_modifyitems(config, items):
    # Fast tests first: a broken unit fails the run before the engine spends minutes starting.
    items.sort(key=lambda item: item.get_closest_marker("engine") is not None)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
