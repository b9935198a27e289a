"""The server's policy: parsed from ``--policy``/``--policy-config`` and carried to every engine
process through one environment variable (spawned scheduler processes inherit the environment)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from sglang_ext.policies import KVPolicy, PolicyConfigError, build_policy

POLICY_ENV = "SGLANG_EXT_POLICY"


def parse_policy_config(text: str | None) -> dict[str, Any]:
    """``--policy-config`` value: a JSON object, or ``@path`` to a file holding one."""
    if not text:
        return {}
    source = ""
    if text.startswith("@"):
        path = Path(text[1:])
        source = f" in {path}"
        try:
            text = path.read_text()
        except OSError as err:
            raise PolicyConfigError("--policy-config", f"cannot read {path}: {err.strerror}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise PolicyConfigError("--policy-config", f"invalid JSON{source}: {err}") from None
    if not isinstance(value, dict):
        raise PolicyConfigError("--policy-config", f"expected a JSON object, got {type(value).__name__}")
    return value


def policy_from_flags(name: str, config_text: str | None) -> KVPolicy:
    return build_policy(name, parse_policy_config(config_text))


def export_policy(policy: KVPolicy) -> None:
    params = {k: v for k, v in policy.describe().items() if k != "name"}
    os.environ[POLICY_ENV] = json.dumps({"name": policy.name, "params": params})
    active_policy.cache_clear()


@functools.lru_cache(maxsize=1)
def active_policy() -> KVPolicy | None:
    """The policy this process serves with, or None when it runs as vanilla SGLang."""
    spec = os.environ.get(POLICY_ENV)
    if not spec:
        return None
    spec = json.loads(spec)
    return build_policy(spec["name"], spec.get("params"))
