"""``full``: every layer attends to the whole KV cache, exactly as vanilla SGLang does."""

import dataclasses

from sglang_ext.policies.base import KVPolicy
from sglang_ext.policies.registry import register_policy


@register_policy
@dataclasses.dataclass(frozen=True)
class FullAttention(KVPolicy):
    name = "full"
