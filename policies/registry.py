"""Policy registry: name -> policy class, and building a validated policy from a config dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sglang_ext.policies.base import KVPolicy, PolicyConfigError

_POLICIES: dict[str, type[KVPolicy]] = {}


def register_policy(cls: type[KVPolicy]) -> type[KVPolicy]:
    if cls.name in _POLICIES and _POLICIES[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def policy_class(name: str) -> type[KVPolicy]:
    try:
        return _POLICIES[name]
    except KeyError:
        raise PolicyConfigError("policy", f"unknown policy {name!r}", policy_names()) from None


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> KVPolicy:
    if "," in name:  # several, each request choosing one: A,B,...
        from sglang_ext.policies.mix import build_mix

        return build_mix(name, dict(params or {}), build_policy)
    if "+" in name:  # a composition: BASE+art
        from sglang_ext.policies.art import compose

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
