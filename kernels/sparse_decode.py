"""Decode attention over a per-request selection: DELTA's 16-token pages or TidalDecode's tokens.

The selection is a fixed-size `selected` [batch, max_selected] int32 of logical page (or token)
indices plus `num_selected` [batch] int32; entries at or past num_selected[b] are never read, so
buffers keep their shapes from step to step and the launch stays CUDA-graph safe (no host sync).
All query heads of a request share its selection. A selected page may extend past seq_len (the
request's last page); its missing tokens are skipped.
"""

import torch

from .split_kv_decode import SplitKVWorkspace, attend_positions_ref, split_kv_decode


def sparse_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    sm_scale: float,
    page_size: int = 16,
    num_kv_splits: int | None = None,
    workspace: SplitKVWorkspace | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [batch, q_heads, dim] over the selected pages (page_size=16, DELTA) or
    tokens (page_size=1, TidalDecode). Returns out [batch, q_heads, dim] in q's dtype; the
    arithmetic is fp32. num_kv_splits and workspace as for split_kv_decode."""
    cache = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale)
    selection = {"selected": selected, "num_selected": num_selected, "selected_span": page_size}
    splitting = {"num_kv_splits": num_kv_splits, "workspace": workspace}
    out, _ = split_kv_decode(*cache, **selection, **splitting, out=out)
    return out


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    sm_scale: float,
    page_size: int = 16,
) -> torch.Tensor:
    """Torch oracle of sparse_decode_attention (same arguments; fp32, one request at a time)."""
    out = torch.empty_like(q)
    offsets = torch.arange(page_size, device=q.device)
    for b, (req, seq_len, count) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), num_selected.tolist())
    ):
        positions = (selected[b, :count, None].long() * page_size + offsets).flatten()
        positions = positions[positions < seq_len]
        out_b, _ = attend_positions_ref(
            q[b], k_buffer, v_buffer, req_to_token[req, positions].long(), sm_scale
        )
        out[b] = out_b.to(q.dtype)
    return out
