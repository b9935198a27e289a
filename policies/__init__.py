"""KV-cache policies behind one interface (``KVPolicy``) and one registry."""

from sglang_ext.policies import art, delta, full, lethe, tidal  # noqa: F401  (registers the policies)
from sglang_ext.policies.base import DecodeContext, KVPolicy, PolicyConfigError, RankGroup
from sglang_ext.policies.build import build_policy
from sglang_ext.policies.registry import policy_class, policy_names, register_policy

__all__ = [
    "DecodeContext",
    "KVPolicy",
    "PolicyConfigError",
    "RankGroup",
    "build_policy",
    "policy_class",
    "policy_names",
    "register_policy",
]
