import json
import subprocess
import sys
import time

import pytest

from sglang_ext import config
from sglang_ext.policies import PolicyConfigError


def test_policy_config_accepts_inline_json_and_files(tmp_path):
    assert config.parse_policy_config(None) == {}
    assert config.parse_policy_config('{"a": 1}') == {"a": 1}
    path = tmp_path / "p.json"
    path.write_text('{"b": [1, 2]}')
    assert config.parse_policy_config(f"@{path}") == {"b": [1, 2]}


@pytest.mark.parametrize(
    "text, fragment",
    [("{bad", "invalid JSON"), ("[1]", "expected a JSON object"), ("@/no/such.json", "cannot read")],
)
def test_bad_policy_config_names_the_flag(text, fragment):
    with pytest.raises(PolicyConfigError) as err:
        config.parse_policy_config(text)
    assert err.value.field == "--policy-config"
    assert fragment in str(err.value)


def test_exported_policy_is_what_engine_processes_build(monkeypatch):
    monkeypatch.delenv(config.POLICY_ENV, raising=False)
    config.active_policy.cache_clear()
    assert config.active_policy() is None
    config.export_policy(config.policy_from_flags("full", "{}"))
    assert json.loads(config.os.environ[config.POLICY_ENV]) == {"name": "full", "params": {}}
    assert config.active_policy().name == "full"
    mix = config.policy_from_flags("lethe,delta+art", '{"delta+art": {"art": {"tau": 0.5}}}')
    config.export_policy(mix)
    assert config.active_policy() == mix and config.active_policy().members[1].art.tau == 0.5
    composed = config.policy_from_flags(
        "lethe+tidal,full", '{"lethe+tidal": {"max_kv_ratio": 0.2, "tidal": {"budget_tokens": 64}}}'
    )
    config.export_policy(composed)
    assert config.active_policy() == composed
    monkeypatch.delenv(config.POLICY_ENV)
    config.active_policy.cache_clear()


def test_a_served_policy_that_does_not_build_stops_the_engine_process(monkeypatch):
    from sglang_ext import plugin

    # SGLang's plugin loader logs an exception and serves vanilla; a SystemExit stops it
    spec = {"name": "lethe", "params": {"lethe": {"max_kv_ratio": 0.2}}}
    monkeypatch.setenv(config.POLICY_ENV, json.dumps(spec))
    config.active_policy.cache_clear()
    with pytest.raises(SystemExit, match="does not build here: lethe.lethe: unknown parameter"):
        plugin.register()
    monkeypatch.delenv(config.POLICY_ENV)
    config.active_policy.cache_clear()


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--policy", "nope"], ["argument --policy:", "unknown policy 'nope'", "valid: art, delta, full"]),
        (["--policy-config", "{bad"], ["argument --policy-config:", "invalid JSON"]),
        (
            ["--policy", "full", "--policy-config", '{"budget": 3}'],
            ["argument --policy-config:", "field full.budget", "takes no parameters"],
        ),
        (
            ["--policy", "delta", "--policy-config", '{"recent_pages": 9, "budget_pages": 8}'],
            ["argument --policy-config:", "field delta.recent_pages", "budget_pages=8"],
        ),
        (["--policy", "delta,delta"], ["argument --policy:", "lists delta twice"]),
        (
            ["--policy", "lethe,delta", "--policy-config", '{"tidal": {}}'],
            ["argument --policy-config:", "field tidal", "not a policy of lethe,delta"],
        ),
        (
            ["--attention-backend", "flex_attention"],
            ["argument --attention-backend:", "valid: fa3, flashinfer, triton, torch_native"],
        ),
    ],
)
def test_launcher_fails_fast_on_bad_flags(args, fragments, tmp_path):
    start = time.monotonic()
    env = dict(config.os.environ, SGLANG_EXT_MODEL_CACHE=str(tmp_path))  # must not convert a model
    done = subprocess.run(
        [sys.executable, "-m", "sglang_ext.launch", "--model-path", "unused", *args],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr
    assert time.monotonic() - start < 60
    assert not any(tmp_path.iterdir())
