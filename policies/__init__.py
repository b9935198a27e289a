"""KV-cache policies behind one interface (``KVPolicy``) and one registry."""

from sglang_ext.policies import full  # noqa: F401  (registers the policy)
from sglang_ext.policies.base import KVPolicy, PolicyConfigError
from sglang_ext.policies.registry import build_policy, policy_class, policy_names, register_policy

__all__ = [
    "KVPolicy",
    "PolicyConfigError",
    "build_policy",
    "policy_class",
    "policy_names",
    "register_policy",
]
