"""Split-KV decode attention over SGLang's token-slot KV layout (selection and sparse kernels).

Mirrors SGLang's triton decode kernel (sglang/kernels/ops/attention/decode_attention.py): stage 1
gives each (request, KV head, split) program one slice of the request's tokens and all query heads
of that KV group; it writes a partial output and its log-sum-exp. Stage 2 merges the splits by LSE.
Differences: tokens are addressed by logical position through `req_to_token` (optionally through a
per-request list of selected pages or tokens), every split always writes (an empty one writes
LSE = -inf), the final LSE is returned, and stage 1 can also store the scaled logits q·k for
scoring. Lengths stay on the device and grids depend on shapes only: launches are CUDA-graph safe.
"""

import os

import torch
import triton
import triton.language as tl

_BLOCK_N = 32  # tokens per inner step; also the split granularity, like SGLang's MIN_BLOCK_KV
# Triton's interpreter multiplies bf16 tl.dot operands as raw uint16 bits (triton 3.8), so under it
# the dots run on fp32 copies; compiled kernels keep native-dtype tensor-core dots.
_DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _stage1(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Selected,
    NumSelected,
    MidO,
    MidLse,
    Logits,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_r2t,
    stride_sel,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    stride_lg_b,
    stride_lg_h,
    logits_len,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SELECTED_SPAN: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(SeqLens + batch)
    req_row = ReqToToken + tl.load(ReqPoolIdx + batch).to(tl.int64) * stride_r2t
    # Virtual token n is logical position n, or token n % SPAN of selected entry n // SPAN.
    if SELECTED_SPAN > 0:
        length = tl.load(NumSelected + batch) * SELECTED_SPAN
    else:
        length = seq_len
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = per_split * split
    end = tl.minimum(start + per_split, length)

    q = tl.load(
        Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(K.dtype.element_ty)

    e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    e_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_split = offs_n < end
        if SELECTED_SPAN > 0:
            entry = tl.load(
                Selected + batch * stride_sel + offs_n // SELECTED_SPAN, mask=in_split, other=0
            )
            pos = entry * SELECTED_SPAN + offs_n % SELECTED_SPAN
        else:
            pos = offs_n
        valid = in_split & (pos < seq_len)  # the last selected page may be partial
        slot = tl.load(req_row + pos, mask=valid, other=0).to(tl.int64)

        k = tl.load(
            K + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None],
            mask=valid[None, :] & mask_d[:, None],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        qk = tl.dot(q, k) * sm_scale
        qk = tl.where(mask_h[:, None] & valid[None, :], qk, float("-inf"))
        if STORE_LOGITS:
            tl.store(
                Logits + batch * stride_lg_b + heads[:, None] * stride_lg_h + pos[None, :],
                qk,
                mask=mask_h[:, None] & valid[None, :] & (pos[None, :] < logits_len),
            )

        v = tl.load(
            V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        )
        new_max = tl.maximum(e_max, tl.max(qk, 1))
        # A row with no valid token yet keeps max -inf; shift by 0 then so exp() gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(e_max - shift)
        p = tl.exp(qk - shift[:, None])
        if DOT_IN_FP32:
            acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        e_sum = e_sum * rescale + tl.sum(p, 1)
        e_max = new_max

    mid = batch * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
    has_tokens = e_sum > 0
    tl.store(
        MidO + mid[:, None] + offs_d[None, :],
        acc / tl.where(has_tokens, e_sum, 1.0)[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    lse = tl.where(has_tokens, e_max + tl.log(tl.where(has_tokens, e_sum, 1.0)), float("-inf"))
    tl.store(MidLse + batch * stride_lse_b + heads * stride_lse_h + split, lse, mask=mask_h)


@triton.jit
def _stage2(
    MidO,
    MidLse,
    Out,
    Lse,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    stride_ob,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM

    lse_row = MidLse + batch * stride_lse_b + head * stride_lse_h
    split_lse = tl.load(lse_row + offs_s, mask=mask_s, other=float("-inf"))
    out_rows = MidO + batch * stride_mid_b + head * stride_mid_h + offs_s[:, None] * stride_mid_s
    split_out = tl.load(
        out_rows + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )
    top = tl.max(split_lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a request with no tokens (padding) outputs 0
    weight = tl.exp(split_lse - top)
    total = tl.sum(weight, 0)
    safe_total = tl.where(total > 0, total, 1.0)
    out = tl.sum(weight[:, None] * split_out, 0) / safe_total
    tl.store(
        Out + batch * stride_ob + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=mask_d,
    )
    tl.store(
        Lse + batch * num_heads + head, tl.where(total > 0, top + tl.log(safe_total), float("-inf"))
    )


def split_kv_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    selected: torch.Tensor | None = None,
    num_selected: torch.Tensor | None = None,
    selected_span: int = 1,
    logits: torch.Tensor | None = None,
    num_kv_splits: int = 8,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [batch, q_heads, dim] over each request's cache.

    Returns (out [batch, q_heads, dim] in q's dtype, lse [batch, q_heads] fp32). With `selected`
    ([batch, max_selected] int32) and `num_selected` ([batch] int32), request b attends only to the
    logical positions selected[b, j] * selected_span + r (j < num_selected[b], r < selected_span,
    position < seq_len). With `logits` ([batch, q_heads, logits_len] fp32), the scaled q·k of every
    attended position below logits_len is stored there; other entries are left untouched.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_q_heads % num_kv_heads == 0 and v_buffer.shape[-1] == head_dim == k_buffer.shape[-1]
    group = num_q_heads // num_kv_heads
    mid_out = torch.empty(
        batch, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(batch, num_q_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    sparse = selected is not None
    selected_arg = selected if sparse else seq_lens  # unread placeholders keep the signature fixed
    logits_arg = logits if logits is not None else mid_lse

    block_d = triton.next_power_of_2(head_dim)
    _stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        selected_arg, num_selected if sparse else seq_lens, mid_out, mid_lse, logits_arg,
        sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), selected_arg.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        logits_arg.stride(0), logits_arg.stride(1), logits_arg.shape[-1],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_BLOCK_N, NUM_SPLITS=num_kv_splits, SELECTED_SPAN=selected_span if sparse else 0,
        STORE_LOGITS=logits is not None, DOT_IN_FP32=_DOT_IN_FP32,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    _stage2[(batch, num_q_heads)](
        mid_out, mid_lse, out, lse,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_q_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), num_warps=4,
    )  # fmt: skip
    return out, lse


def attend_positions_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle for one request: q [q_heads, dim] attends to cache slots `slots` [n] in fp32.

    Returns (out [q_heads, dim] fp32, logits [q_heads, n] fp32, the scaled q·k).
    """
    group = q.shape[0] // k_buffer.shape[1]
    k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, q_heads, dim]
    v = v_buffer[slots].float().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.float(), k) * sm_scale
    out = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v)
    return out, logits
