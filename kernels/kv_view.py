"""What every decode-attention entry point here reads: one layer's KV buffers and where each
batch entry's tokens lie in them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class KVView:
    """One layer's KV cache as a decode batch reads it, in SGLang's token-slot layout: ``k`` and
    ``v`` [slots, KV heads, head dim], and batch entry b's tokens at the slots
    ``table[rows[b], :lengths[b]]``, by logical position. Over SGLang's pool the table is
    req_to_token, the rows req_pool_indices and the lengths seq_lens (``of_layer``); a slot table
    gathered for the batch reads the same buffers (``through``). The fields are the caller's
    tensors, never copies: a CUDA graph that recorded a call replays with their storage, and
    ``rows`` and ``lengths`` may be longer than the batch (a kernel reads its batch's first
    entries)."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor  # [table rows, max tokens] int32: each row's token slots
    rows: torch.Tensor  # [>= batch] int32 or int64: each batch entry's row of the table
    lengths: torch.Tensor  # [>= batch] int32: each batch entry's tokens

    @classmethod
    def of_layer(cls, pool, layer_id: int, req_to_token: torch.Tensor, forward_batch) -> KVView:
        """Layer ``layer_id`` of SGLang's KV pool as a decode batch (its ForwardBatch) reads it."""
        return cls(
            pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id), req_to_token,
            forward_batch.req_pool_indices, forward_batch.seq_lens,
        )  # fmt: skip

    def through(self, table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> KVView:
        """The same buffers, each batch entry's tokens read through another table."""
        return KVView(self.k, self.v, table, rows, lengths)
