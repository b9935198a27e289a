"""Building a validated policy from its name and parameters: one registered policy, a mix of
several (``A,B``: each request chooses one) or a composition (``BASE+TOP``: ``delta+art``,
``lethe+tidal``; the top policy's parameters under its name, the base's beside them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sglang_ext.policies.base import KVPolicy, PolicyConfigError
from sglang_ext.policies.mix import build_mix
from sglang_ext.policies.registry import policy_class, policy_names


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> KVPolicy:
    if "," in name:  # several, each request choosing one: A,B,...
        return build_mix(name, dict(params or {}), build_policy)
    if "+" in name:  # a composition: the last policy reads what the ones before it keep
        base_name, _, top_name = name.rpartition("+")
        params = dict(params or {})
        top_params = params.pop(top_name, {})
        if not isinstance(top_params, dict):
            raise PolicyConfigError(f"{name}.{top_name}", f"expected an object of {top_name}'s "
                                    "parameters")  # fmt: skip
        return build_policy(top_name, top_params).over(build_policy(base_name, params))
    cls = policy_class(name)
    params = dict(params or {})
    known = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in known:
            if not known:
                raise PolicyConfigError(f"{name}.{key}", f"policy {name!r} takes no parameters")
            raise PolicyConfigError(f"{name}.{key}", "unknown parameter", known)
    return cls(**params)


def composition_names() -> list[str]:
    """Every ``BASE+TOP`` of two registered policies that builds at their defaults."""
    names = []
    for base in policy_names():
        for top in policy_names():
            try:
                build_policy(f"{base}+{top}")
            except PolicyConfigError:
                continue
            names.append(f"{base}+{top}")
    return names
