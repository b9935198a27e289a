import pytest

from sglang_ext import launch
from sglang_ext.platform import cpu
from sglang_ext.policies import build_policy


@pytest.fixture
def cpu_host(monkeypatch):
    monkeypatch.setattr(cpu, "is_cuda_host", lambda: False)


@pytest.fixture
def cuda_host(monkeypatch):
    monkeypatch.setattr(cpu, "is_cuda_host", lambda: True)


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_fill_what_the_user_left_out(cpu_host):
    argv = launch.sglang_argv(["--model-path", "m", "--port", "1234"])
    assert _value(argv, "--host") == "127.0.0.1"
    assert _value(argv, "--device") == "cpu"
    assert _value(argv, "--attention-backend") == "torch_native"
    assert _value(argv, "--sampling-backend") == "pytorch"
    assert "--disable-cuda-graph" in argv
    assert _value(argv, "--max-total-tokens") == str(launch.CPU_DEFAULT_MAX_TOTAL_TOKENS)


def test_user_flags_win_in_both_spellings(cpu_host):
    argv = launch.sglang_argv(["--model", "m", "--host=0.0.0.0", "--mem-fraction-static", "0.5"])
    assert argv.count("--host=0.0.0.0") == 1 and "--host" not in argv
    assert "--model-path" not in argv
    assert "--max-total-tokens" not in argv


def _gpu(monkeypatch, tmp_path, major: int, fa3_library: bool):
    """A CUDA GPU of compute capability ``major`` whose sgl_kernel does (not) ship FA3's library."""
    import importlib.machinery
    import importlib.util

    import torch

    package = tmp_path / "sgl_kernel"
    package.mkdir()
    if fa3_library:
        (package / "flash_ops.abi3.so").write_bytes(b"")
    spec = importlib.machinery.ModuleSpec("sgl_kernel", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == "sgl_kernel" else find_spec(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))


def test_cuda_host_defaults_to_fa3_on_hopper_and_no_cpu_flags(cuda_host, monkeypatch, tmp_path):
    _gpu(monkeypatch, tmp_path, major=9, fa3_library=True)
    argv = launch.sglang_argv(["--model-path", "m"])
    assert _value(argv, "--attention-backend") == "fa3"
    assert "--device" not in argv and "--disable-cuda-graph" not in argv
    assert _value(launch.sglang_argv(["--attention-backend", "triton"]), "--attention-backend") == "triton"


@pytest.mark.parametrize(("major", "fa3_library"), [(9, False), (8, True), (10, True)])
def test_cuda_host_defaults_to_flashinfer_without_hoppers_fa3(cuda_host, monkeypatch, tmp_path, major, fa3_library):
    _gpu(monkeypatch, tmp_path, major, fa3_library)
    assert _value(launch.sglang_argv(["--model-path", "m"]), "--attention-backend") == "flashinfer"


def test_embedded_model_is_the_default(cpu_host, monkeypatch, tmp_path):
    import sglang_ext.model as model

    monkeypatch.setattr(model, "default_model_path", lambda: tmp_path)
    assert _value(launch.sglang_argv([]), "--model-path") == str(tmp_path)


def _refused(argv, policy="full"):
    with pytest.raises(SystemExit) as exit_info:
        launch._check_engine_flags(launch.build_parser(), argv, build_policy(policy))
    return exit_info.value.code


def test_decode_backend_override_is_checked(cpu_host):
    launch._check_engine_flags(launch.build_parser(), ["--attention-backend", "torch_native"], build_policy("full"))
    assert _refused(["--attention-backend", "torch_native", "--decode-attention-backend", "flex_attention"]) == 2
    for wrapped in ("fa3", "flashinfer", "triton"):
        launch._check_engine_flags(launch.build_parser(), ["--attention-backend", wrapped], build_policy("delta"))


def test_flags_under_which_a_policy_would_not_run_exit_2_naming_the_flag(capsys):
    # a hybrid prefill/decode pair: SGLang wraps both, and our decode half would go unseen
    assert _refused(["--attention-backend", "triton", "--prefill-attention-backend", "fa3"]) == 2
    assert "--prefill-attention-backend" in capsys.readouterr().err
    # lethe leaves holes of single slots
    assert _refused(["--attention-backend", "triton", "--page-size", "16"], "lethe") == 2
    assert "--page-size" in capsys.readouterr().err
    delta_argv = ["--attention-backend", "triton", "--page-size", "16"]
    launch._check_engine_flags(launch.build_parser(), delta_argv, build_policy("delta"))


def test_the_embedded_model_is_served_under_its_name(cpu_host, monkeypatch, tmp_path):
    import sglang_ext.model as model

    monkeypatch.setattr(model, "default_model_path", lambda: tmp_path)
    assert _value(launch.sglang_argv([]), "--served-model-name") == model.MODEL_NAME
    assert "--served-model-name" not in launch.sglang_argv(["--model-path", "other"])


def test_lethe_adds_its_server_defaults_unless_given(cpu_host):
    lethe = build_policy("lethe")
    argv = launch.sglang_argv(["--model-path", "m"], lethe)
    assert "--disable-prefill-cuda-graph" in argv
    # its request slots are sized by memory in the engine (engine.memory), not capped here
    assert not any(arg.startswith("--max-running-requests") for arg in argv)
    argv = launch.sglang_argv(["--model-path", "m", "--disable-prefill-cuda-graph"], lethe)
    assert argv.count("--disable-prefill-cuda-graph") == 1
