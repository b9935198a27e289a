import subprocess
import sys

import pytest

from sglang_ext.platform import cpu

STUB_CHECK = """
import sgl_kernel
from sgl_kernel import silu_and_mul
from sgl_kernel.flash_attn import flash_attn_varlen_func
from sgl_kernel.scalar_type import ScalarType
assert sgl_kernel.IS_STAND_IN
for op in (silu_and_mul, flash_attn_varlen_func, ScalarType.uint4b8):
    try:
        op(1)
    except sgl_kernel.MissingKernelError as err:
        print(err)
    else:
        raise SystemExit("a stand-in op ran")
"""


@pytest.fixture
def cpu_host(monkeypatch):
    monkeypatch.setattr(cpu, "is_cuda_host", lambda: False)


def test_sgl_kernel_stand_in_imports_and_calls_raise_naming_the_op(cpu_host):
    done = subprocess.run(
        [sys.executable, "-c", STUB_CHECK], env=cpu.runtime_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "'sgl_kernel.silu_and_mul' was called" in lines[0]
    assert "'sgl_kernel.flash_attn.flash_attn_varlen_func' was called" in lines[1]
    assert "'sgl_kernel.scalar_type.ScalarType.uint4b8' was called" in lines[2]


def test_runtime_env_selects_the_cpu_engine(cpu_host):
    env = cpu.runtime_env({"PYTHONPATH": "/x"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(cpu.STUBS_DIR), "/x"]
    assert cpu.runtime_env(env) == env  # idempotent


def test_server_flags_select_torch_native_pytorch_sampling_and_no_cuda_graphs(cpu_host):
    assert cpu.as_argv(cpu.server_flags()) == [
        "--device", "cpu", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--disable-cuda-graph", "--sleep-on-idle",
    ]


def test_inactive_on_a_cuda_host(monkeypatch):
    monkeypatch.setattr(cpu, "is_cuda_host", lambda: True)
    assert cpu.runtime_env({"A": "1"}) == {"A": "1"}
    assert cpu.server_flags() == {}
    assert cpu.activate() is False

