"""Policy registry: name -> policy class."""

from __future__ import annotations

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
