"""The engine adapter: nothing of ours in an SGLang process without a policy, every hook in place
with one, and an SGLang that lacks a hooked target stops start-up. Each case loads SGLang's
plugins in a fresh process, as its engine processes do."""

import json
import subprocess
import sys

import pytest
from sglang_ext import engine, plugin
from sglang_ext.config import POLICY_ENV, active_policy
from sglang_ext.engine import targets
from benchmarks.engine_process import engine_env

# Loads SGLang's plugins as an engine process does, then reports what each hooked target and
# attention backend resolves to now.
INSPECT = """
import json, pkgutil
from importlib.metadata import entry_points
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang_ext.engine import targets

load_plugins()
resolved = {t: pkgutil.resolve_name(t) for t in targets.ALL}
print(json.dumps({
    "plugin_installed": any(ep.value.startswith("sglang_ext") for ep in entry_points(group="sglang.srt.plugins")),
    "wrapped": sorted(t for t, f in resolved.items() if hasattr(f, "__wrapped__")),
    "ours": sorted(t for t, f in resolved.items() if getattr(f, "__module__", "").startswith("sglang_ext")),
    "registered": sorted(HookRegistry._hooks),
    "backends": {n: ATTENTION_BACKENDS[n].__module__ for n in ("fa3", "flashinfer", "triton", "torch_native")},
}))
"""


def inspect_process(policy: str | None, params: dict | None = None) -> dict:
    env = engine_env()
    if policy is not None:
        env[POLICY_ENV] = json.dumps({"name": policy, "params": params or {}})
    done = subprocess.run(
        [sys.executable, "-c", INSPECT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_a_policy_sglang_runs_exactly_as_it_ships():
    seen = inspect_process(None)
    assert seen["plugin_installed"]  # SGLang did run our plugin
    assert seen["registered"] == [] and seen["wrapped"] == [] and seen["ours"] == []
    assert all(module.startswith("sglang.") for module in seen["backends"].values())


def test_lethe_hooks_every_target_and_serves_through_our_backends():
    # per-layer lists (the default): per-layer memory, so the KV pool's layers are allocated as
    # one buffer too
    seen = inspect_process("lethe")
    assert seen["registered"] == sorted(targets.ALL)
    # functions are wrapped; the admission class is replaced by our subclass
    assert seen["wrapped"] == sorted(set(targets.ALL) - {targets.PREFILL_ADDER})
    assert seen["ours"] == [targets.PREFILL_ADDER]
    assert set(seen["backends"].values()) == {"sglang_ext.engine.backends"}
    # one retained set: SGLang's pool allocates its layers as it ships
    one_set = inspect_process("lethe", {"per_layer": False})
    assert one_set["registered"] == sorted(set(targets.ALL) - {targets.KV_POOL_BUFFERS})


def test_a_policy_that_does_not_evict_leaves_sglangs_memory_accounting_alone():
    seen = inspect_process("delta")
    memory = {targets.FREE, targets.UNCACHED_SIZES, targets.CACHE_UNFINISHED,
              targets.PREFILL_ADDER, targets.CHECK_DECODE_MEM, targets.SCHEDULE_PREFILL,
              targets.KV_POOL_BUFFERS}  # fmt: skip
    assert seen["registered"] == sorted(set(targets.ALL) - memory)


def test_a_missing_target_names_it_and_the_pinned_version():
    with pytest.raises(targets.EngineAdapterError) as error:
        targets.verify([targets.FORWARD, "sglang.srt.managers.nowhere.Scheduler.step"])
    assert "sglang.srt.managers.nowhere.Scheduler.step" in str(error.value)
    assert targets.FORWARD not in str(error.value)
    assert f"sglang=={engine.PINNED_SGLANG}" in str(error.value)


def test_a_missing_target_stops_the_engine_process(monkeypatch):
    monkeypatch.setenv(POLICY_ENV, json.dumps({"name": "lethe", "params": {}}))
    active_policy.cache_clear()
    monkeypatch.setattr(targets, "ALL", (*targets.ALL, "sglang.srt.gone.ModelRunner.forward"))
    try:
        with pytest.raises(SystemExit) as stop:  # SGLang's plugin loader catches only Exception
            plugin.register()
    finally:
        active_policy.cache_clear()
    assert "sglang.srt.gone.ModelRunner.forward" in str(stop.value.code)
    assert engine.registered_targets() == []  # nothing was registered before the check


def test_sampling_kernels_are_built_for_flashinfer_sampling_only_and_loudly(monkeypatch):
    from sglang_ext.engine import kernel_warmup

    monkeypatch.setattr(kernel_warmup, "SAMPLING_MODULE", "no_such_flashinfer.get_sampling_module")
    kernel_warmup.build_sampling_kernels("pytorch")  # the CPU engine's: nothing to build or import
    with pytest.raises(engine.EngineAdapterError, match="--sampling-backend flashinfer: .*missing"):
        kernel_warmup.build_sampling_kernels("flashinfer")
    # with FlashInfer sampling, the builder SGLang's sampler would call first is called at start-up
    monkeypatch.setattr(kernel_warmup, "SAMPLING_MODULE", f"{__name__}.{_record_build.__name__}")
    BUILDS.clear()
    kernel_warmup.build_sampling_kernels("flashinfer")
    assert BUILDS == ["sampling"]


BUILDS: list[str] = []


def _record_build() -> None:
    BUILDS.append("sampling")
