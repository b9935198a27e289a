"""Lethe's decode attention: each layer attends to its own retained tokens and accumulates their
RASR scores (Recency-Aware Selective Retention, Lethe Eq. 5):

    s_t = gamma * s_{t-1} + sum over query heads of the attention probability the token receives.

A layer's retained set is a per-request list of logical positions in ascending order
(``positions[row, :count[row]]``, rows are SGLang request slots), with one score per entry
(``scores[row, j]`` belongs to ``positions[row, j]``). The attention is the split-KV kernel over
that list (it also stores each attended token's scaled logit); once its LSE is known, one fused
kernel turns the logits into probabilities, sums them over heads and updates the scores in place.
Lengths stay on the device and grids depend on shapes only, so decode keeps its CUDA graph.
"""

import torch
import triton
import triton.language as tl

from .split_kv_decode import SplitKVWorkspace, attend_positions_ref, split_kv_decode

_BLOCK_J = 128  # retained entries per scoring program


@triton.jit
def _accumulate_kernel(
    Logits,
    Lse,
    Positions,
    Count,
    Rows,
    Scores,
    gamma,
    stride_lg_b,
    stride_lg_h,
    stride_pos_row,
    stride_sc_row,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(Rows + batch).to(tl.int64)
    count = tl.load(Count + row)
    offs_j = block * BLOCK_J + tl.arange(0, BLOCK_J)
    valid_j = offs_j < count
    pos = tl.load(Positions + row * stride_pos_row + offs_j, mask=valid_j, other=0)
    offs_h = tl.arange(0, BLOCK_HQ)
    mask_h = offs_h < NUM_Q_HEADS
    lse = tl.load(Lse + batch * NUM_Q_HEADS + offs_h, mask=mask_h, other=0.0)
    logits = tl.load(
        Logits + batch * stride_lg_b + offs_h[:, None] * stride_lg_h + pos[None, :],
        mask=mask_h[:, None] & valid_j[None, :],
        other=float("-inf"),
    )
    received = tl.sum(tl.exp(logits - lse[:, None]), 0)
    old = tl.load(Scores + row * stride_sc_row + offs_j, mask=valid_j, other=0.0)
    tl.store(Scores + row * stride_sc_row + offs_j, gamma * old + received, mask=valid_j)


def retained_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor,
    scores: torch.Tensor,
    sm_scale: float,
    gamma: float,
    logits: torch.Tensor,
    num_kv_splits: int | None = None,
    state_rows: torch.Tensor | None = None,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Decode attention of q [batch, q_heads, dim] over each request's retained positions.

    positions [rows, cap] int32 and count [rows] int32 hold every request slot's retained list;
    scores [rows, cap] fp32 is updated in place for the batch's rows. ``logits`` is a scratch
    buffer [>= batch, q_heads, >= max position + 1] fp32. ``state_rows`` (default
    req_pool_indices) picks each entry's row of positions/count/scores: CUDA-graph padding points
    it at a row with count 0, so padded entries read and score nothing; the kernel reads each
    entry's list in place (no gather of the context-wide rows). ``num_kv_splits`` and
    ``workspace`` as for split_kv_decode. Returns out in q's dtype.
    """
    batch, num_q_heads, _ = q.shape
    rows = req_pool_indices if state_rows is None else state_rows
    out, lse = split_kv_decode(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
        selected=positions, selected_rows=rows, num_selected=count[rows], selected_span=1,
        logits=logits[:batch], num_kv_splits=num_kv_splits, workspace=workspace,
    )  # fmt: skip
    _accumulate_kernel[(batch, triton.cdiv(positions.shape[1], _BLOCK_J))](
        logits, lse, positions, count, rows, scores, gamma,
        logits.stride(0), logits.stride(1), positions.stride(0), scores.stride(0),
        NUM_Q_HEADS=num_q_heads, BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_J=_BLOCK_J,
    )  # fmt: skip
    return out


def retained_decode_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor,
    scores: torch.Tensor,
    sm_scale: float,
    gamma: float,
    state_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch oracle of retained_decode (and the CPU engine's path): per request, fp32; an entry
    whose state row holds nothing (padding) gets zeros."""
    out = torch.zeros_like(q)
    rows = req_pool_indices if state_rows is None else state_rows
    for b, (row, slots_row) in enumerate(zip(rows.tolist(), req_pool_indices.tolist())):
        n = int(count[row])
        if n == 0:
            continue
        kept = positions[row, :n].long()
        out_b, logits = attend_positions_ref(
            q[b], k_buffer, v_buffer, req_to_token[slots_row, kept].long(), sm_scale
        )
        out[b] = out_b.to(q.dtype)
        received = torch.softmax(logits, dim=-1).sum(dim=0)
        scores[row, :n] = gamma * scores[row, :n] + received
    return out


def window_scores(
    queries: torch.Tensor, keys: torch.Tensor, seq_len: int, sm_scale: float
) -> torch.Tensor:
    """The attention the last prompt tokens pay to each of a request's tokens, summed over query
    heads and those queries, causal (Lethe Eq. 2 over a prefill's observation window).

    queries [n, q_heads, dim] are the queries of positions seq_len - n .. seq_len - 1; keys
    [seq_len, kv_heads, dim]. Returns [seq_len] fp32. Torch on every device: it runs once per
    request and layer at prefill, over n x seq_len logits. Under tensor parallelism this is one
    rank's heads' share: sum the ranks' before ``pool_neighbours``.
    """
    n = queries.shape[0]
    group = queries.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", queries.float(), k) * sm_scale
    query_pos = torch.arange(seq_len - n, seq_len, device=queries.device)
    future = torch.arange(seq_len, device=queries.device)[None, :] > query_pos[:, None]
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


def pool_neighbours(scores: torch.Tensor, pool: int) -> torch.Tensor:
    """Each token's score raised to its ``pool`` neighbours' best. A question attends to a
    record's key, its answer then needs the value beside it (SnapKV's clustering, by max)."""
    if pool <= 1:
        return scores
    return torch.nn.functional.max_pool1d(
        scores[None, None], pool, stride=1, padding=pool // 2
    )[0, 0, : scores.shape[0]]
