"""Entry point of SGLang's ``sglang.srt.plugins`` group; SGLang runs it in every engine process."""

from __future__ import annotations


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    from sglang_ext import cache_correction, eviction, request_policy, scheduler
    from sglang_ext.backend import POLICY_BASES, policy_backend_factory
    from sglang_ext.config import active_policy
    from sglang_ext.server import metrics, report, validation

    validation.install()
    metrics.install()
    report.install()
    request_policy.install()

    for name in POLICY_BASES:
        current = ATTENTION_BACKENDS[name]
        if hasattr(current, "sglang_ext_stock"):
            continue
        register_attention_backend(name)(policy_backend_factory(name, current))

    policy = active_policy()
    if policy is not None and policy.cache_correction_interval() > 0:
        cache_correction.install(policy.cache_correction_interval())
    if policy is not None and policy.name == "lethe":
        eviction.install(policy)
        scheduler.install(policy)
