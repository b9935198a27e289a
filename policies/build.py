"""Building a validated policy from its name and parameters: one registered policy, a mix of
several (``A,B``: each request chooses one) or a composition (``BASE+art``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sglang_ext.policies.art import compose
from sglang_ext.policies.base import KVPolicy, PolicyConfigError
from sglang_ext.policies.mix import build_mix
from sglang_ext.policies.registry import policy_class


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> KVPolicy:
    if "," in name:  # several, each request choosing one: A,B,...
        return build_mix(name, dict(params or {}), build_policy)
    if "+" in name:  # a composition: BASE+art
        return compose(name, dict(params or {}), build_policy)
    cls = policy_class(name)
    params = dict(params or {})
    known = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in known:
            if not known:
                raise PolicyConfigError(f"{name}.{key}", f"policy {name!r} takes no parameters")
            raise PolicyConfigError(f"{name}.{key}", "unknown parameter", known)
    return cls(**params)
