"""``delta``: DELTA (arXiv 2510.09883), page selection refreshed at a few Δ-layers.

Layers in ``full_layers`` attend to the whole cache (the engine's own decode). A Δ-layer attends to
the whole cache too, scores each 16-token page, and selects the last ``recent_pages`` pages plus
the top ``budget_pages - recent_pages`` others by score; every other layer after it, up to the next
Δ-layer, attends only to those pages. The selection is made anew at every decode step.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import torch

from sglang_ext.kernels.page_select import select_pages
from sglang_ext.policies.base import DecodeContext, DecodeFn, KVPolicy, PolicyConfigError
from sglang_ext.policies.registry import register_policy

logger = logging.getLogger(__name__)

PAGE_SIZE = 16  # tokens per page; the selection kernel's page scores are fixed to it


class LayerRole(str, enum.Enum):
    FULL = "full"  # the engine's full attention
    SELECT = "select"  # Δ-layer: full attention, then a new page selection
    SPARSE = "sparse"  # attention over the latest Δ-layer's pages only


@register_policy
@dataclasses.dataclass(frozen=True)
class DeltaPolicy(KVPolicy):
    name = "delta"
    full_layers: list[int] = dataclasses.field(default_factory=lambda: [0, 1])
    delta_layers: list[int] = dataclasses.field(default_factory=lambda: [2, 14, 22])
    budget_pages: int = 64
    recent_pages: int = 8

    def validate(self) -> None:
        if self.budget_pages < 1:
            self._error("budget_pages", f"must be >= 1, got {self.budget_pages}")
        if not 0 <= self.recent_pages <= self.budget_pages:
            self._error(
                "recent_pages",
                f"must be in [0, budget_pages={self.budget_pages}], got {self.recent_pages}",
            )
        for field in ("full_layers", "delta_layers"):
            layers = getattr(self, field)
            if any(layer < 0 for layer in layers):
                self._error(field, f"layer ids must be >= 0, got {list(layers)}")
            if len(set(layers)) != len(layers):
                self._error(field, f"lists a layer twice: {list(layers)}")
        if not self.delta_layers:
            self._error("delta_layers", "needs at least one Δ-layer")
        delta_layers = list(self.delta_layers)
        if delta_layers != sorted(delta_layers):
            self._error("delta_layers", f"must be in ascending order, got {delta_layers}")
        both = sorted(set(self.full_layers) & set(self.delta_layers))
        if both:
            self._error("full_layers", f"layers {both} are Δ-layers too")
        unselected = sorted(set(range(self.delta_layers[0])) - set(self.full_layers))
        if unselected:
            self._error(
                "full_layers",
                f"layers {unselected} come before the first Δ-layer ({self.delta_layers[0]}), "
                "so no pages are selected for them yet: list them here",
            )

    def layer_roles(self, num_layers: int) -> list[LayerRole]:
        """The role of each of the model's layers; a layer id past its depth is an error."""
        for field in ("full_layers", "delta_layers"):
            beyond = [layer for layer in getattr(self, field) if layer >= num_layers]
            if beyond:
                self._error(field, f"layers {beyond} are beyond the model's {num_layers} layers")
        roles = [LayerRole.SPARSE] * num_layers
        for layer in self.full_layers:
            roles[layer] = LayerRole.FULL
        for layer in self.delta_layers:
            roles[layer] = LayerRole.SELECT
        return roles

    def decode_fns(self, ctx: DecodeContext) -> list[DecodeFn]:
        decoder = DeltaDecoder(self, ctx)
        by_role = {
            LayerRole.FULL: ctx.base_decode,
            LayerRole.SELECT: decoder.select_decode,
            LayerRole.SPARSE: decoder.sparse_decode,
        }
        return [by_role[role] for role in self.layer_roles(ctx.num_layers)]

    def _error(self, field: str, message: str):
        raise PolicyConfigError(f"{self.name}.{field}", message)


class DeltaDecoder:
    """Decode of Δ- and sparse layers for one attention backend, and the selection they share.

    The selection lives in buffers sized for the largest batch, allocated once; a batch uses
    their first rows. Decode reads nothing back to the host (but for one log line per server),
    so a CUDA graph can capture it.
    """

    def __init__(self, policy: DeltaPolicy, ctx: DecodeContext):
        self.ctx = ctx
        self.budget_pages, self.recent_pages = policy.budget_pages, policy.recent_pages
        self.selected = torch.zeros(
            ctx.max_batch_size, policy.budget_pages, dtype=torch.int32, device=ctx.device
        )
        self.num_selected = torch.zeros(ctx.max_batch_size, dtype=torch.int32, device=ctx.device)
        self._selection_attention, self._sparse_attention = _attention_impls(ctx.device)
        self._first_trim_unlogged = True

    def select_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q, cache = self._begin(q, k, v, layer, forward_batch, save_kv_cache)
        out, _, page_scores = self._selection_attention(*cache, sm_scale=layer.scaling)
        selected, num_selected = select_pages(
            page_scores, forward_batch.seq_lens, self.budget_pages, self.recent_pages, PAGE_SIZE
        )
        batch = q.shape[0]
        self.selected[:batch].copy_(selected)
        self.num_selected[:batch].copy_(num_selected)
        if self._first_trim_unlogged and self._trims(forward_batch):
            self._log_selection(layer.layer_id, forward_batch.seq_lens, num_selected)
        return out.view(batch, -1)

    def sparse_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q, cache = self._begin(q, k, v, layer, forward_batch, save_kv_cache)
        batch = q.shape[0]
        out = self._sparse_attention(
            *cache,
            self.selected[:batch],
            self.num_selected[:batch],
            sm_scale=layer.scaling,
            page_size=PAGE_SIZE,
        )
        return out.view(batch, -1)

    def _begin(self, q, k, v, layer, forward_batch, save_kv_cache):
        """Store the new token's K/V; return q as [batch, heads, dim] and the cache arguments."""
        if save_kv_cache and k is not None and v is not None:
            self.ctx.write_kv(layer, forward_batch, k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        pool = self.ctx.kv_pool
        cache = (
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            self.ctx.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
        )
        return q, cache

    def _trims(self, forward_batch) -> bool:
        """Whether a request of the batch has more pages than the budget (judged on the host copy
        of seq_lens: no device sync)."""
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None or int(seq_lens.max()) <= self.budget_pages * PAGE_SIZE:
            return False
        return not (self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _log_selection(self, layer_id, seq_lens, num_selected):
        # Once per server, as evidence that selection takes effect; its read-back syncs once.
        self._first_trim_unlogged = False
        num_pages = (seq_lens + PAGE_SIZE - 1) // PAGE_SIZE
        logger.info(
            "sglang_ext: delta layer %d first selected fewer pages than a request has: %s of %s",
            layer_id, num_selected.tolist(), num_pages.tolist(),
        )  # fmt: skip


def _attention_impls(device) -> tuple:
    """(selection attention, sparse attention): Triton kernels on CUDA, torch references elsewhere
    (the Triton interpreter is far too slow to serve with)."""
    from sglang_ext.kernels import selection_attention as sa
    from sglang_ext.kernels import sparse_decode as sd

    if torch.device(device).type == "cuda":
        return sa.delta_selection_attention, sd.sparse_decode_attention

    def selection_attention_ref(*cache, sm_scale):
        out, token_scores = sa.selection_attention_ref(*cache, sm_scale=sm_scale)
        return out, token_scores, sa.page_scores_ref(token_scores, PAGE_SIZE)

    return selection_attention_ref, sd.sparse_decode_attention_ref

