"""Attention backends that hand each layer's decode to the served policy's runtime.

They subclass SGLang's own backends (fa3, SGLang's default on Hopper and ours there; flashinfer,
the default on other CUDA GPUs; triton; torch_native on CPU) and are registered under the same
names (SGLang's ``register_attention_backend``), because SGLang branches on the backend's name in
many places (CUDA graphs, which index kernels run on CPU); a new name would silently change those
decisions. They are registered only when a policy is served.

Per batch the backend runs SGLang's own metadata setup, then the runtime's ``prepare_decode``:
eagerly, or inside the CUDA graph (``init_forward_metadata_in_graph``, recorded at capture).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from sglang_ext.engine.kernel_warmup import build_sampling_kernels
from sglang_ext.engine.targets import EngineAdapterError
from sglang_ext.policies import DecodeContext, KVPolicy, RankGroup
from sglang_ext.policies.calibration import model_fingerprint
from sglang_ext.policies.runtime import PolicyRuntime

logger = logging.getLogger(__name__)

HOLE_SLOT = 0  # SGLang's padding slot, never allocated: marks an evicted position in req_to_token
_RUNTIMES: list[PolicyRuntime] = []  # this process's, for the scheduler's admission


def process_runtime() -> PolicyRuntime | None:
    """The runtime of this process's attention backend (None before it is built)."""
    return _RUNTIMES[0] if _RUNTIMES else None


def runtime_of(model_runner) -> PolicyRuntime | None:
    return getattr(model_runner.attn_backend, "policy_runtime", None)


class PolicyDispatchMixin:
    """Per-layer decode dispatch, resolved once at construction: the hot path is a list lookup.

    A subclass names the SGLang backend it extends and how that backend stores a decoded token's
    K/V (``write_decode_kv``), for policy layers that attend with their own kernels, and where it
    can, its decode over some rows only (``decode_rows``, ``DecodeContext.base_decode_rows``).
    """

    decode_rows = None

    def __init__(self, model_runner, policy: KVPolicy, **base_kwargs):
        window = getattr(model_runner, "sliding_window_size", None)
        if window is not None and window > 0:
            raise EngineAdapterError(
                f"--model-path: {model_runner.model_config.model_path} uses sliding-window "
                f"attention (window {window}); sglang_ext policies attend over the whole cache"
            )
        super().__init__(model_runner, **base_kwargs)
        model_config = model_runner.model_config
        device = torch.device(model_runner.device)
        req_to_token = self.req_to_token_pool.req_to_token
        context = DecodeContext(
            num_layers=model_config.num_hidden_layers,
            base_decode=super().forward_decode,
            base_decode_rows=self.decode_rows,
            write_kv=self.write_decode_kv,
            kv_pool=self.token_to_kv_pool,
            req_to_token=req_to_token,
            max_batch_size=self.req_to_token_pool.size,
            device=device,
            model_fingerprint=model_fingerprint(model_config.hf_config),
            ranks=_attention_ranks(),
            padding_slot=HOLE_SLOT,
            num_q_heads=model_config.num_attention_heads // _attention_tp_size(),
            head_dim=model_config.head_dim,
            kv_pool_tokens=self.token_to_kv_pool.size,
        )
        self.kv_policy = policy.for_model(context)
        self.policy_runtime = self.kv_policy.runtime(context)
        self._decode_by_layer = self.policy_runtime.decode_fns
        _RUNTIMES.append(self.policy_runtime)

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self.policy_runtime.prepare_decode(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        super().init_forward_metadata_in_graph(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self.policy_runtime.prepare_decode(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        decode = self._decode_by_layer[layer.layer_id]
        return decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        self.policy_runtime.after_extend(q, layer, forward_batch)
        return out

    def write_decode_kv(self, layer, forward_batch, k, v) -> None:
        raise NotImplementedError


def _attention_tp_size() -> int:
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    return get_attn_tp_group().world_size


def _attention_ranks() -> RankGroup | None:
    """The attention tensor-parallel group, through SGLang's group all-gather (which CUDA graphs
    capture); None on one rank."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    group = get_attn_tp_group()
    if group.world_size == 1:
        return None

    def gather(x: torch.Tensor) -> torch.Tensor:
        return group.all_gather(x.contiguous(), dim=0).view(group.world_size, *x.shape)

    return RankGroup(group.rank_in_group, group.world_size, gather)


@functools.cache
def _triton_backend() -> type:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class PolicyTritonAttnBackend(PolicyDispatchMixin, TritonAttnBackend):
        def write_decode_kv(self, layer, forward_batch, k, v) -> None:
            # as TritonAttnBackend.forward_decode does for a non-MLA model
            meta = self.forward_metadata
            loc = KVWriteLoc(
                forward_batch.out_cache_loc,
                meta.swa_out_cache_loc,
                full_loc=meta.out_cache_loc_full_physical,
            )
            self._set_kv_buffer(forward_batch, layer, loc, k, v, layer.k_scale, layer.v_scale)

    return PolicyTritonAttnBackend


@functools.cache
def _flashinfer_backend() -> type:
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class PolicyFlashInferAttnBackend(PolicyDispatchMixin, FlashInferAttnBackend):
        def __init__(self, model_runner, policy: KVPolicy):
            if model_runner.use_mla_backend:
                raise EngineAdapterError(
                    "--attention-backend flashinfer: sglang_ext policies do not decode MLA models"
                )
            # as SGLang's create_flashinfer_backend does for a non-MLA model
            workspace = {"init_new_workspace": model_runner.init_new_workspace}
            super().__init__(model_runner, policy, **workspace)

        def write_decode_kv(self, layer, forward_batch, k, v) -> None:
            # as FlashInferAttnBackend.forward_decode does
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, *self._kv_write_scales(layer))

    return PolicyFlashInferAttnBackend


@functools.cache
def _fa3_backend() -> type:
    from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class PolicyFlashAttentionBackend(PolicyDispatchMixin, FlashAttentionBackend):
        def __init__(self, model_runner, policy: KVPolicy):
            if model_runner.use_mla_backend:
                raise EngineAdapterError(
                    "--attention-backend fa3: sglang_ext policies do not decode MLA models"
                )
            if model_runner.kv_cache_dtype_str == "mxfp8":
                raise EngineAdapterError(
                    "--kv-cache-dtype mxfp8: sglang_ext policies read bf16/fp16/fp8 KV only"
                )
            if torch.cuda.get_device_capability()[0] not in (8, 9):
                # as SGLang's own fa3 factory checks (FA3 runs on SM 8.x and 9.x)
                raise EngineAdapterError(
                    "--attention-backend fa3: FlashAttention 3 needs an SM 8.x or 9.x GPU; "
                    "use --attention-backend flashinfer"
                )
            super().__init__(model_runner, policy)

        def write_decode_kv(self, layer, forward_batch, k, v) -> None:
            # as FlashAttentionBackend.forward_decode does for a non-MLA, non-mxfp8 model
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)

        def decode_rows(self, rows: torch.Tensor):
            """FA3's decode reading only the rows ``rows`` marks: the others' lengths are 1 for
            the call. The step's split plan (``scheduler_metadata``, made from the true lengths)
            stays, so a marked row's output is bit for bit the whole call's; an unmarked row's
            extra splits are empty tiles."""
            lengths = torch.ones(rows.shape[0], dtype=torch.int32, device=rows.device)
            one = lengths.new_ones(())

            def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                metadata = self.forward_metadata
                true_lengths = metadata.cache_seqlens_int32
                batch = true_lengths.shape[0]
                masked = lengths[:batch]
                torch.where(rows[:batch], true_lengths, one, out=masked)
                metadata.cache_seqlens_int32 = masked
                try:
                    return FlashAttentionBackend.forward_decode(
                        self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs
                    )
                finally:
                    metadata.cache_seqlens_int32 = true_lengths

            return decode

    return PolicyFlashAttentionBackend


@functools.cache
def _torch_native_backend() -> type:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class PolicyTorchNativeAttnBackend(PolicyDispatchMixin, TorchNativeAttnBackend):
        def write_decode_kv(self, layer, forward_batch, k, v) -> None:
            # as TorchNativeAttnBackend.forward_decode does
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    return PolicyTorchNativeAttnBackend


# SGLang backend name -> our subclass of it (imported lazily: the triton module is heavy).
POLICY_BASES: dict[str, Callable[[], type]] = {
    "fa3": _fa3_backend,
    "flashinfer": _flashinfer_backend,
    "triton": _triton_backend,
    "torch_native": _torch_native_backend,
}


def register_backends(policy: KVPolicy) -> None:
    """Serve ``policy`` through our subclass of each backend in POLICY_BASES."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    for name, backend_class in POLICY_BASES.items():

        def create(model_runner, backend_class=backend_class):
            backend = backend_class()(model_runner, policy)
            build_sampling_kernels(model_runner.server_args.sampling_backend)
            described = backend.kv_policy.describe()
            logger.info("sglang_ext: %s decoding with policy %s", type(backend).__name__, described)
            return backend

        register_attention_backend(name)(create)


def default_cuda_backend() -> str:
    """The backend a policy decodes through when the user names none: fa3 on Hopper where
    sgl_kernel ships FlashAttention 3's library (SGLang's own default for these models there, and
    the fastest measured), flashinfer on other CUDA GPUs (SGLang's default there but for
    Blackwell's trtllm_mha, which we do not wrap)."""
    import importlib.util
    from pathlib import Path

    if torch.cuda.get_device_capability()[0] != 9:
        return "flashinfer"
    spec = importlib.util.find_spec("sgl_kernel")
    folders = spec.submodule_search_locations if spec is not None else None
    has_fa3 = any(any(Path(f).glob("flash_ops*.so")) for f in folders or [])
    return "fa3" if has_fa3 else "flashinfer"
