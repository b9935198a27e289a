"""The engine's view a policy builds its decode from (``DecodeContext``), what its runtime hands
that decode (``DecodeInputs``) and what the policy gives back to run (``DecodeProgram``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.kernels.kv_view import KVView
from sglang_ext.kernels.split_kv_decode import SplitKVWorkspace

# forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs) -> attention output
DecodeFn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """The attention tensor-parallel ranks of this process's model, each holding some of the query
    heads. A policy whose decision reads scores over all heads combines them here, so that every
    rank decides alike; every rank must call the same combinations in the same order."""

    rank: int
    size: int
    # x -> [size, *x.shape]: every rank's x, in rank order (SGLang's group all-gather; CUDA graphs
    # capture it)
    gather: Callable[[torch.Tensor], torch.Tensor]

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(x).amax(0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Summed in rank order on every rank, so every rank gets the same bits."""
        return self.gather(x).sum(0)

    def agree(self, x: torch.Tensor, what: str) -> None:
        """Raise when the ranks hold different ``x`` (a host sync: for rare decisions)."""
        gathered = self.gather(x)
        if not bool((gathered == gathered[:1]).all()):
            raise RuntimeError(f"sglang_ext: tensor-parallel ranks disagree on {what}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeContext:
    """A read-only view of the engine, given to a policy at start-up to build its decode.
    Keyword-only: a field inserted before another must not shift a positional caller's values."""

    num_layers: int
    base_decode: DecodeFn  # the engine's own full attention (writes the new token's K/V itself)
    write_kv: Callable[..., None]  # write_kv(layer, forward_batch, k, v): store the new token's K/V
    kv_pool: Any  # SGLang's token_to_kv_pool: get_key_buffer(layer_id) -> [slots, kv_heads, dim]
    req_to_token: Any  # [request slots, max context] int32: cache slot of each request's tokens
    max_batch_size: int  # no decode batch is larger: per-batch state is allocated once this size
    device: Any  # torch.device of the KV cache
    # base_decode_rows(rows) -> the engine's full attention reading only the rows a bool
    # [max_batch_size] mask marks (written before each step's layers), the others one token,
    # their output unspecified; None where the engine's plan fixes every row's length
    base_decode_rows: Callable[[Any], DecodeFn] | None = None
    model_fingerprint: dict[str, Any] | None = None  # policies.calibration.model_fingerprint
    ranks: RankGroup | None = None  # under attention tensor parallelism; None on one rank
    # the slot the engine never allocates (its padding slot): a req_to_token entry pointing
    # there is never a real token's
    padding_slot: int = 0
    # This rank's query heads and the head size: decode scratch is sized from them at start-up
    num_q_heads: int | None = None
    head_dim: int | None = None
    kv_pool_tokens: int | None = None  # the KV pool's token slots (None: unknown)

    def batch_tokens_bound(self) -> int:
        """The most tokens a decode batch holds in all without shared prefixes: the KV pool's,
        or every request slot at full context where the pool's size is unknown."""
        return self.kv_pool_tokens or self.max_batch_size * self.req_to_token.shape[1]

    def head_shape(self) -> tuple[int, int, int] | None:
        """(query heads, KV heads, head size) of this rank's attention, for decode scratch owned
        up front; None off CUDA (the torch references need none) or where the heads are unknown."""
        if torch.device(self.device).type != "cuda" or self.num_q_heads is None:
            return None
        return self.num_q_heads, self.kv_pool.get_key_buffer(0).shape[1], self.head_dim

    def split_workspace(self, max_tokens: int, num_splits: int | None = None):
        """Scratch of the split-KV kernel (kernels.split_kv_decode) for requests attending to up
        to ``max_tokens`` tokens (or ``num_splits`` splits at every batch size), sized for the
        largest batch; None where ``head_shape`` is (the kernel then allocates)."""
        heads = self.head_shape()
        if heads is None:
            return None
        return SplitKVWorkspace(
            self.max_batch_size, *heads, max_tokens, self.device, num_splits
        )


@dataclasses.dataclass(frozen=True)
class RetainedKV:
    """The KV an evicting policy holds this step, for a policy composed over it to read instead
    of each request's whole row: batch entry b's tokens at the slots ``table[rows[b],
    :lengths[b]]`` (gathered once per step, before the layers; the caller's tensors)."""

    kv_pool: Any
    table: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor

    def view(self, layer_id: int) -> KVView:
        pool = self.kv_pool
        return KVView(
            pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id), self.table,
            self.rows, self.lengths,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """What a policy's runtime owns and hands the decode it builds, beyond the engine's view."""

    # each request slot's own values of the policy's per-request decode parameters
    # (policies.request_table.RequestTable, a named column each); None when it has none
    request_table: Any = None
    # int64 [2] on the device: [tiles read, tiles in the traversal] of ART's reads (metrics)
    tile_counts: Any = None
    # ART (policies.art.Art) when it reads for this policy (BASE+art): sparse layers read their
    # selection through it, importance-first
    art: Any = None
    # a policy mix member's share of the mix's slot tables (kernels.sparse_decode.TableShare):
    # a policy that reads a slot table takes this one; None: its own
    table_share: Any = None
    # the KV an evicting policy under this one keeps (EVICTION+SELECTION): what it reads
    retained: RetainedKV | None = None


@dataclasses.dataclass(frozen=True)
class DecodeProgram:
    """What a policy's decode needs run, built once at start-up; the engine adapter drives it."""

    layers: list[DecodeFn]  # one decode function per layer
    # device work once per decode step before its layers, each f(forward_batch): static in shape
    # and free of host syncs, as CUDA graphs record it
    step_setups: tuple[Callable[[Any], None], ...] = ()
    # on the host before each decode step, each f(total_tokens): make room for a batch holding
    # that many tokens in all; False when the step must then run eagerly (what CUDA graphs
    # recorded is too small for it)
    reservations: tuple[Callable[[int], bool], ...] = ()
    # layer -> kernels.sparse_decode.TableRead where the layer is only attention over the table
    # of ``DecodeInputs.table_share``: a mix reads its members' tables in one call there
    table_reads: dict[int, Any] = dataclasses.field(default_factory=dict)
