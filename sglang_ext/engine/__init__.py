"""The engine adapter: every touch point of sglang_ext with SGLang's internals lives here.

- ``targets``: the SGLang functions and classes hooked (through SGLang's ``HookRegistry``), all
  resolved at start-up; a missing one stops the engine naming it and the pinned version;
- ``backends``: our subclasses of SGLang's attention backends (``register_attention_backend``);
- ``steps``: the policy's per-batch planning and per-forward work (scheduler process);
- ``memory``: slot accounting, radix cache and admission under a policy that evicts;
- ``requests``: the one state object we keep on SGLang's ``Req``;
- ``batches``: the ForwardBatch the cache correction builds;
- ``http``: request checks and the per-request report in SGLang's HTTP process.

``install`` runs only when a policy is served (``sglang_ext.plugin``): without one, nothing of
this is registered and SGLang runs exactly as it ships.
"""

from __future__ import annotations

import logging

from sglang_ext.engine.targets import PINNED_SGLANG, EngineAdapterError, verify
from sglang_ext.policies import KVPolicy

__all__ = ["PINNED_SGLANG", "EngineAdapterError", "install", "registered_targets"]

logger = logging.getLogger(__name__)

_registered: list[str] = []  # targets this process hooked, in order


class _Hooks:
    """SGLang's HookRegistry, through which every hook of ours is registered (and recorded)."""

    def register(self, target: str, hook, hook_type) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.register(target, hook, hook_type)
        _registered.append(target)


def install(policy: KVPolicy, apply: bool = False) -> None:
    """Register what serving ``policy`` needs, in this engine process; once per process. SGLang
    applies the hooks after its plugins ran; ``apply`` applies them now (an engine run in-process,
    outside SGLang's plugin loading)."""
    if not _registered:
        _register(policy)
    if apply:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()


def _register(policy: KVPolicy) -> None:
    from sglang_ext.engine import backends, http, memory, requests, steps, targets

    verify(targets.ALL)
    hooks = _Hooks()
    backends.register_backends(policy)
    http.register(hooks, policy)
    steps.register(hooks)
    requests.register(hooks)
    memory.register_request_pool(hooks, policy)
    if policy.evicts():
        memory.register(hooks)
    if policy.pools_layer_rows():
        memory.register_layer_pool(hooks)
    logger.info("sglang_ext: %d SGLang hooks registered for policy %s", len(_registered), policy.name)


def registered_targets() -> list[str]:
    return list(_registered)
