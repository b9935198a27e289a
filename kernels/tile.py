"""The online-softmax tile step every decode-attention kernel here is built of.

A program holds the query heads of one KV group ([BLOCK_H, BLOCK_D], padded heads masked) and a
running state per head: the max of the logits seen (e_max), the sum of their exponentials
shifted by it (e_sum) and the output so weighted (acc [BLOCK_H, BLOCK_D]), all fp32. Each tile of
token slots adds its logits (``tile_logits``) and values (``tile_values``) to it
(``fold_tile``); a split stores its normalised output and LSE (``store_split``) for the merge,
which joins the splits' states by the same rescaling (``raise_max``).
Triton inlines these helpers into each kernel: they compile as if written there.
"""

import triton
import triton.language as tl


@triton.jit
def load_query(
    Q, K, batch, heads, stride_qb, stride_qh, mask_h, offs_d, mask_d, DOT_IN_FP32: tl.constexpr
):
    """The program's query heads, in the dtype its dots take: K's, or fp32 under the interpreter
    (DOT_IN_FP32)."""
    q = tl.load(
        Q + batch * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(K.dtype.element_ty)
    return q


@triton.jit
def empty_state(BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """(e_max, e_sum, acc) before any token: -inf, 0, 0."""
    e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    e_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    return e_max, e_sum, acc


@triton.jit
def tile_logits(
    q, K, slot, valid, kv_head, stride_k_slot, stride_k_head, mask_h, offs_d, mask_d, sm_scale,
    DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    """The scaled q·k [BLOCK_H, BLOCK_N] of the tokens at KV ``slot`` (int64 [BLOCK_N]); -inf
    in a padded head's row and an invalid token's column (its K is not read)."""
    k = tl.load(
        K + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None],
        mask=valid[None, :] & mask_d[:, None],
        other=0.0,
    )
    if DOT_IN_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, k) * sm_scale
    qk = tl.where(mask_h[:, None] & valid[None, :], qk, float("-inf"))
    return qk


@triton.jit
def tile_values(V, slot, valid, kv_head, stride_v_slot, stride_v_head, offs_d, mask_d):
    """The values [BLOCK_N, BLOCK_D] of the tokens at KV ``slot``; 0 for an invalid token."""
    v = tl.load(
        V + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
        mask=valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    return v


@triton.jit
def raise_max(e_max, tile_max):
    """(new max, shift, rescale) of a running max ``e_max`` joined by values of max
    ``tile_max``: the values' exponentials are taken shifted by ``shift`` and the state so far is
    scaled by ``rescale`` = exp(e_max - shift)."""
    new_max = tl.maximum(e_max, tile_max)
    # A row with no valid token yet keeps max -inf; shift by 0 then so exp() gives 0, not NaN.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(e_max - shift)
    return new_max, shift, rescale


@triton.jit
def fold_tile(e_max, e_sum, acc, qk, v, DOT_IN_FP32: tl.constexpr):
    """The online-softmax update by one tile's logits ``qk`` and values ``v``: the state
    rescaled by exp(old max - new max), the tile's exp(qk - new max) added to the sum and its
    product with v to the output. A fully masked tile (qk all -inf) leaves the state as it was."""
    new_max, shift, rescale = raise_max(e_max, tl.max(qk, 1))
    p = tl.exp(qk - shift[:, None])
    if DOT_IN_FP32:
        acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    e_sum = e_sum * rescale + tl.sum(p, 1)
    return new_max, e_sum, acc


@triton.jit
def store_split(
    MidO, MidLse, e_max, e_sum, acc, batch, heads, split, stride_mid_b, stride_mid_h,
    stride_mid_s, stride_lse_b, stride_lse_h, mask_h, offs_d, mask_d,
):  # fmt: skip
    """A split's output (acc / e_sum) and LSE for the merge; a split that saw no token stores
    0 and LSE -inf, which weighs nothing there."""
    mid = batch * stride_mid_b + heads * stride_mid_h + split * stride_mid_s
    has_tokens = e_sum > 0
    tl.store(
        MidO + mid[:, None] + offs_d[None, :],
        acc / tl.where(has_tokens, e_sum, 1.0)[:, None],
        mask=mask_h[:, None] & mask_d[None, :],
    )
    lse = tl.where(has_tokens, e_max + tl.log(tl.where(has_tokens, e_sum, 1.0)), float("-inf"))
    tl.store(MidLse + batch * stride_lse_b + heads * stride_lse_h + split, lse, mask=mask_h)
