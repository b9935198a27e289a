"""Attention backends that hand each layer's decode to the active KV policy.

They subclass SGLang's own backends (triton on CUDA, torch_native on CPU) and are registered under
the same names, because SGLang branches on the backend's name in many places (CUDA graphs, which
index kernels run on CPU); a new name would silently change those decisions. Without an active
policy the factories return SGLang's stock backend, so a plain ``sglang.launch_server`` with this
package installed is vanilla SGLang.
"""

from __future__ import annotations

import logging
from typing import Callable

from sglang_ext.config import active_policy
from sglang_ext.policies import KVPolicy

logger = logging.getLogger(__name__)


class PolicyDispatchMixin:
    """Per-layer decode dispatch, resolved once at construction: the hot path is a list lookup."""

    def _attach_policy(self, policy: KVPolicy, num_layers: int) -> None:
        self.kv_policy = policy
        self._decode_by_layer = policy.decode_fns(num_layers, super().forward_decode)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        decode = self._decode_by_layer[layer.layer_id]
        return decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def _policy_backend(base_cls: type) -> type:
    class PolicyBackend(PolicyDispatchMixin, base_cls):
        def __init__(self, model_runner, policy: KVPolicy):
            super().__init__(model_runner)
            self._attach_policy(policy, model_runner.model_config.num_hidden_layers)

    PolicyBackend.__name__ = PolicyBackend.__qualname__ = f"Policy{base_cls.__name__}"
    return PolicyBackend


def _triton_base() -> type:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend


def _torch_native_base() -> type:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend


# SGLang backend name -> its class (imported lazily: the triton module is heavy).
POLICY_BASES: dict[str, Callable[[], type]] = {
    "triton": _triton_base,
    "torch_native": _torch_native_base,
}


def policy_backend_factory(name: str, stock_factory: Callable) -> Callable:
    def create(model_runner):
        policy = active_policy()
        if policy is None:
            return stock_factory(model_runner)
        backend = _policy_backend(POLICY_BASES[name]())(model_runner, policy)
        logger.info("sglang_ext: %s decoding with policy %s", type(backend).__name__, policy.describe())
        return backend

    create.sglang_ext_stock = stock_factory
    return create
