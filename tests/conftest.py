import os
import re
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


# The test tiers (pyproject.toml's markers), set here from the file and the marks a test has:
#   unit    the default: fast, on the CPU; every test of no other tier
#   bench   tests of the benchmark scripts (tests/test_bench_*.py)
#   gpu     needs CUDA, skipped without it: tests/test_engine_gpu*.py, a test or case marked gpu,
#           and one skipped where CUDA is missing (a skipif whose reason names CUDA, a GPU or the
#           Triton interpreter, which runs the kernels where CUDA is missing)
#   engine  starts real SGLang servers: the engine modules' pytestmark, tests/test_engine_gpu*.py
# `-m "not engine"` runs the fast tiers, `-m gpu` the GPU tier; a bare run runs every tier.
OTHER_TIERS = ("bench", "gpu", "engine")  # than unit
SKIPPED_WITHOUT_CUDA = re.compile(r"\bcuda\b|\bgpus?\b|interpreter", re.IGNORECASE)


def _skipped_without_cuda(item) -> bool:
    return any(
        SKIPPED_WITHOUT_CUDA.search(str(mark.kwargs.get("reason", "")))
        for mark in item.iter_markers("skipif")
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name.startswith("test_engine_gpu"):
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.gpu)
        if _skipped_without_cuda(item):
            item.add_marker(pytest.mark.gpu)
        elif item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="the gpu tier needs CUDA"))
        if name.startswith("test_bench_"):
            item.add_marker(pytest.mark.bench)
        if not any(item.get_closest_marker(tier) for tier in OTHER_TIERS):
            item.add_marker(pytest.mark.unit)
    # Engines last: a broken unit fails the run before the engine spends minutes starting.
    items.sort(key=lambda item: item.get_closest_marker("engine") is not None)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
