"""Entry point of SGLang's ``sglang.srt.plugins`` group; SGLang runs it in every engine process."""

from __future__ import annotations


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    from sglang_ext.backend import POLICY_BASES, policy_backend_factory

    for name in POLICY_BASES:
        current = ATTENTION_BACKENDS[name]
        if hasattr(current, "sglang_ext_stock"):
            continue
        register_attention_backend(name)(policy_backend_factory(name, current))
