"""Split-KV decode attention over SGLang's token-slot KV layout (selection and sparse kernels).

Mirrors SGLang's triton decode kernel (sglang/kernels/ops/attention/decode_attention.py): stage 1
gives each (request, KV head, split) program one slice of the request's tokens and all query heads
of that KV group; it writes a partial output and its log-sum-exp. Stage 2 merges the splits by LSE.
Differences: tokens are addressed by logical position through `req_to_token` (optionally through a
per-request list of selected pages or tokens), every split always writes (an empty one writes
LSE = -inf), the final LSE is returned, and stage 1 can also store the scaled logits q·k for
scoring. Lengths stay on the device and grids depend on shapes only: launches are CUDA-graph safe.
"""

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

_BLOCK_N = 32  # the split granularity, like SGLang's MIN_BLOCK_KV
# A grid of about this many programs per SM hides memory latency; a fixed split count left most
# SMs idle at small batches (8 splits x 2 KV heads = 16 programs on 132 SMs at batch 1).
PROGRAMS_PER_SM = 4
# Over a short list (a sparse layer's 1k-token selection) fewer, longer splits are faster:
# measured (kernel_bench --parts tune, H200, 2026-11-26) 8 splits at batch 32 take 15.0 µs where
# the 16 of four programs per SM take 19.2; whole-cache reads are flat from 4 programs per SM on.
SHORT_LIST_PROGRAMS_PER_SM = 2
MAX_KV_SPLITS = 128
_MAX_ROW_SPLITS = tl.constexpr(MAX_KV_SPLITS)
# Triton's interpreter multiplies bf16 tl.dot operands as raw uint16 bits (triton 3.8), so under it
# the dots run on fp32 copies; compiled kernels keep native-dtype tensor-core dots.
_DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Stage1Launch:
    """Stage 1's tile and launch: tokens per inner step (a multiple of _BLOCK_N), warps and
    software-pipeline stages (benchmarks.kernel_bench --parts tune measures the choices)."""

    block_n: int
    num_warps: int
    num_stages: int


# Measured on an H100 (kernel_bench --parts tune, qwen1.5b shape, 32k, batch 1 and 64): over the
# whole cache (selection layers) 64-token tiles and 3 stages are 20% faster at batch 64 than
# (32, 4, 2); over scattered selected pages 32-token tiles with 3 stages are best.
STAGE1_WHOLE = Stage1Launch(block_n=64, num_warps=4, num_stages=3)
STAGE1_SELECTED = Stage1Launch(block_n=32, num_warps=4, num_stages=3)


@triton.jit
def _balanced_plan(
    SeqLens, NumSelected, batch, target, SELECTED_SPAN: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, MAX_ROW_SPLITS: tl.constexpr,
):
    """The balanced split order, recomputed by every program of both stages from the batch's
    lengths on the device: about ``target`` splits over all rows, each row's as long as its
    tokens need (an empty row none), at most MAX_ROW_SPLITS a row. Returns per row [BLOCK_B]:
    its tokens, tokens per split (a multiple of BLOCK_N), splits and their inclusive end in the
    flat order. The splits sum to at most target + batch (each row rounds up once)."""
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < batch
    if SELECTED_SPAN > 0:
        lengths = tl.load(NumSelected + offs_b, mask=in_batch, other=0).to(tl.int32)
        lengths = lengths * SELECTED_SPAN
    else:
        lengths = tl.load(SeqLens + offs_b, mask=in_batch, other=0).to(tl.int32)
    total = tl.sum(lengths, 0)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(total, target), BLOCK_N) * BLOCK_N, BLOCK_N)
    row_floor = tl.cdiv(tl.cdiv(lengths, MAX_ROW_SPLITS), BLOCK_N) * BLOCK_N
    splits = tl.cdiv(lengths, tl.maximum(row_floor, chunk))
    per_split = tl.cdiv(tl.cdiv(lengths, tl.maximum(splits, 1)), BLOCK_N) * BLOCK_N
    return lengths, per_split, splits, tl.cumsum(splits, 0)


@triton.jit
def _pick(values, offs_b, row):
    return tl.sum(tl.where(offs_b == row, values, 0), 0)


@triton.jit
def _stage1(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Selected,
    SelectedRows,
    NumSelected,
    MidO,
    MidLse,
    Logits,
    LogitsRowStart,
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
    num_splits,
    num_rows,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SELECTED_SPAN: tl.constexpr,
    INDIRECT_ROWS: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    RAGGED_LOGITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BALANCED: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if BALANCED:  # program 0-axis p is the p-th split of the flat order; num_splits its target
        flat = tl.program_id(0)
        offs_b = tl.arange(0, BLOCK_B)
        lengths, per_splits, splits, ends = _balanced_plan(
            SeqLens, NumSelected, num_rows, num_splits, SELECTED_SPAN, BLOCK_N, BLOCK_B,
            _MAX_ROW_SPLITS,
        )  # fmt: skip
        row = tl.sum((ends <= flat).to(tl.int32), 0)  # rows whose splits all come before p
        has_work = row < num_rows
        row = tl.minimum(row, num_rows - 1)
        split = flat - (_pick(ends, offs_b, row) - _pick(splits, offs_b, row))
        per_split = _pick(per_splits, offs_b, row)
        batch = row.to(tl.int64)
        mid_row = flat.to(tl.int64)
    else:
        batch = tl.program_id(0).to(tl.int64)
        split = tl.program_id(2)
        has_work = split < num_splits  # every program of the fixed grid
        mid_row = batch

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
        if INDIRECT_ROWS:  # entry b's selection is row SelectedRows[b] of Selected
            selected_row = Selected + tl.load(SelectedRows + batch).to(tl.int64) * stride_sel
        else:
            selected_row = Selected + batch * stride_sel
    else:
        length = seq_len
    if not BALANCED:
        per_split = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = per_split * split
    if STORE_LOGITS:
        # a ragged row starts at its offset in one long row per head; a dense one at its stride
        if RAGGED_LOGITS:
            logits_row = tl.load(LogitsRowStart + batch)
            logits_end = logits_len - logits_row
        else:
            logits_row = batch * stride_lg_b
            logits_end = logits_len
    end = tl.where(has_work, tl.minimum(start + per_split, length), start)

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
            entry = tl.load(selected_row + offs_n // SELECTED_SPAN, mask=in_split, other=0)
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
                Logits + logits_row + heads[:, None] * stride_lg_h + pos[None, :],
                qk,
                mask=mask_h[:, None] & valid[None, :] & (pos[None, :] < logits_end),
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

    mid_split = 0 if BALANCED else split
    mid = mid_row * stride_mid_b + heads * stride_mid_h + mid_split * stride_mid_s
    has_tokens = e_sum > 0
    tl.store(
        MidO + mid[:, None] + offs_d[None, :],
        acc / tl.where(has_tokens, e_sum, 1.0)[:, None],
        mask=mask_h[:, None] & mask_d[None, :] & has_work,
    )
    lse = tl.where(has_tokens, e_max + tl.log(tl.where(has_tokens, e_sum, 1.0)), float("-inf"))
    lse_at = MidLse + mid_row * stride_lse_b + heads * stride_lse_h + mid_split
    tl.store(lse_at, lse, mask=mask_h & has_work)


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
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
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


@triton.jit
def _stage2_balanced(
    MidO,
    MidLse,
    Out,
    Lse,
    SeqLens,
    NumSelected,
    num_rows,
    target,
    stride_mid_p,
    stride_mid_h,
    stride_lse_p,
    stride_lse_h,
    stride_ob,
    stride_oh,
    num_heads,
    SELECTED_SPAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Stage 2 of the balanced order: a row's splits are consecutive in the flat order, as
    many as its tokens needed; merged BLOCK_S at a time by a running LSE."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_B)
    _, _, splits, ends = _balanced_plan(
        SeqLens, NumSelected, num_rows, target, SELECTED_SPAN, BLOCK_N, BLOCK_B, _MAX_ROW_SPLITS
    )
    count = _pick(splits, offs_b, row)
    first = _pick(ends, offs_b, row) - count
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, count, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < count
        at = (first + offs_s).to(tl.int64)
        split_lse = tl.load(
            MidLse + at * stride_lse_p + head * stride_lse_h, mask=mask_s, other=float("-inf")
        )
        split_out = tl.load(
            MidO + at[:, None] * stride_mid_p + head * stride_mid_h + offs_d[None, :],
            mask=mask_s[:, None] & mask_d[None, :],
            other=0.0,
        )
        new_top = tl.maximum(top, tl.max(split_lse, 0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(top - shift)
        weight = tl.exp(split_lse - shift)
        acc = acc * rescale + tl.sum(weight[:, None] * split_out, 0)
        total = total * rescale + tl.sum(weight, 0)
        top = new_top
    safe_total = tl.where(total > 0, total, 1.0)
    tl.store(
        Out + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        (acc / safe_total).to(Out.dtype.element_ty),
        mask=mask_d,
    )
    tl.store(
        Lse + row * num_heads + head, tl.where(total > 0, top + tl.log(safe_total), float("-inf"))
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU: any small grid
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits_for(
    batch: int, num_kv_heads: int, max_tokens: int, device, programs_per_sm: int = PROGRAMS_PER_SM
) -> int:
    """Splits per (request, KV head): ``programs_per_sm`` programs on every SM, none narrower
    than one block of ``max_tokens`` (the most a request attends to), a power of two (few compiled
    variants). It depends on shapes only, so a CUDA graph captured for a batch size keeps it."""
    wanted = triton.cdiv(programs_per_sm * _num_sms(torch.device(device)), batch * num_kv_heads)
    useful = triton.cdiv(max_tokens, _BLOCK_N)
    return min(triton.next_power_of_2(max(1, min(wanted, useful))), MAX_KV_SPLITS)


def balanced_target(num_kv_heads: int, device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per KV head the balanced order aims at: ``programs_per_sm`` programs on every SM
    over the whole batch, however its tokens fall on its rows."""
    return triton.cdiv(programs_per_sm * _num_sms(torch.device(device)), num_kv_heads)


class SplitKVWorkspace:
    """split_kv_decode's scratch for one layer shape, owned up front: each split's partial output
    and LSE for batches up to ``max_batch``, and the merged LSE. A call takes views of it, so
    decode allocates nothing. By default the splits are balanced: the batch's tokens are cut
    into about ``balanced_target`` equal splits on the device, each row getting as many as its
    length needs (a mix's rows differ by far: a Lethe row's retained third, a DELTA row's
    selection, another member's one-token rows). ``balanced=False`` gives every row the same
    count, ``num_kv_splits_for``'s (``programs_per_sm`` is its), or ``num_splits`` at every
    batch (ART's kernel takes its count as a compile-time constant)."""

    def __init__(
        self, max_batch, num_q_heads, num_kv_heads, head_dim, max_tokens, device, num_splits=None,
        programs_per_sm=PROGRAMS_PER_SM, balanced=None,
    ):  # fmt: skip
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.max_tokens, self.device = max_tokens, torch.device(device)
        self.balanced = num_splits is None if balanced is None else balanced
        assert not (self.balanced and num_splits), "a balanced order picks each row's count"
        if self.balanced:
            self.target = balanced_target(num_kv_heads, device, programs_per_sm)
            # one entry per split of the flat order: at most target + batch (see _balanced_plan)
            self.splits = [0] + [1] * max_batch
            most = self.target + max_batch
        else:
            per_sm = programs_per_sm
            self.splits = [0] + [
                num_splits or num_kv_splits_for(b, num_kv_heads, max_tokens, device, per_sm)
                for b in range(1, max_batch + 1)
            ]
            most = max(b * splits for b, splits in enumerate(self.splits))
        f32 = {"dtype": torch.float32, "device": self.device}
        self._mid_out = torch.empty(most * num_q_heads * head_dim, **f32)
        self._mid_lse = torch.empty(most * num_q_heads, **f32)
        self._lse = torch.empty(max_batch * num_q_heads, **f32)

    def views(self, batch: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(splits, mid_out [entries, q_heads, splits, dim], mid_lse [entries, q_heads, splits],
        lse [batch, q_heads]) for a batch of ``batch`` requests: an entry per request and
        ``splits`` per row, or, balanced, an entry per split of the flat order, ``splits`` 1."""
        splits, heads = self.splits[batch], self.num_q_heads
        entries = self.target + batch if self.balanced else batch
        mid_out = self._mid_out[: entries * heads * splits * self.head_dim]
        mid_lse = self._mid_lse[: entries * heads * splits]
        return (
            splits,
            mid_out.view(entries, heads, splits, self.head_dim),
            mid_lse.view(entries, heads, splits),
            self._lse[: batch * heads].view(batch, heads),
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
    selected_rows: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    logits_row_start: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    workspace: SplitKVWorkspace | None = None,
    out: torch.Tensor | None = None,
    launch: Stage1Launch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [batch, q_heads, dim] over each request's cache.

    Returns (out [batch, q_heads, dim] in q's dtype, lse [batch, q_heads] fp32). With `selected`
    ([rows, max_selected] int32) and `num_selected` ([batch] int32), request b attends only to the
    logical positions selected[r, j] * selected_span + s (j < num_selected[b], s < selected_span,
    position < seq_len), where r = selected_rows[b] (int64 [batch]) or, without it, b. With `logits`
    ([batch, q_heads, logits_len] fp32), the scaled q·k of every attended position below logits_len
    is stored there; other entries are left untouched. With `logits_row_start` ([batch] int64) the
    rows are ragged: `logits` is [q_heads, capacity] and request b's position p is at column
    logits_row_start[b] + p (stored below capacity). A `workspace` supplies the scratch and its
    split order (balanced by default); without one the splits are fixed, `num_kv_splits` per row
    (by default num_kv_splits_for's choice).
    `launch` defaults to STAGE1_SELECTED with a selection, else STAGE1_WHOLE.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_q_heads % num_kv_heads == 0 and v_buffer.shape[-1] == head_dim == k_buffer.shape[-1]
    group = num_q_heads // num_kv_heads
    sparse = selected is not None
    launch = launch or (STAGE1_SELECTED if sparse else STAGE1_WHOLE)
    if workspace is not None:
        assert num_kv_splits is None, "the workspace fixes the split count"
        num_kv_splits, mid_out, mid_lse, lse = workspace.views(batch)
    else:
        if num_kv_splits is None:
            most = selected.shape[1] * selected_span if sparse else req_to_token.shape[1]
            num_kv_splits = num_kv_splits_for(batch, num_kv_heads, most, q.device)
        f32 = {"dtype": torch.float32, "device": q.device}
        mid_out = torch.empty(batch, num_q_heads, num_kv_splits, head_dim, **f32)
        mid_lse = torch.empty(batch, num_q_heads, num_kv_splits, **f32)
        lse = torch.empty(batch, num_q_heads, **f32)
    out = torch.empty_like(q) if out is None else out
    selected_arg = selected if sparse else seq_lens  # unread placeholders keep the signature fixed
    rows_arg = selected_rows if selected_rows is not None else seq_lens
    logits_arg = logits if logits is not None else mid_lse
    ragged = logits_row_start is not None
    lg_stride_b, lg_stride_h = (0, logits_arg.stride(0)) if ragged else logits_arg.stride()[:2]

    block_d = triton.next_power_of_2(head_dim)
    balanced = workspace is not None and workspace.balanced
    if balanced:  # num_kv_splits (1) is the entries' width; the kernels get the target
        num_kv_splits, grid = workspace.target, (mid_out.shape[0], num_kv_heads, 1)
    else:
        grid = (batch, num_kv_heads, num_kv_splits)
    block_b = triton.next_power_of_2(batch)
    _stage1[grid](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        selected_arg, rows_arg, num_selected if sparse else seq_lens, mid_out, mid_lse, logits_arg,
        logits_row_start if ragged else seq_lens, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0), selected_arg.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        lg_stride_b, lg_stride_h, logits_arg.shape[-1], num_kv_splits, batch,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=launch.block_n,
        SELECTED_SPAN=selected_span if sparse else 0, INDIRECT_ROWS=selected_rows is not None,
        STORE_LOGITS=logits is not None, RAGGED_LOGITS=ragged, DOT_IN_FP32=_DOT_IN_FP32,
        BALANCED=balanced, BLOCK_B=block_b,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if not balanced:
        merge_splits(mid_out, mid_lse, out, lse)
        return out, lse
    _stage2_balanced[(batch, num_q_heads)](
        mid_out, mid_lse, out, lse, seq_lens, num_selected if sparse else seq_lens, batch,
        num_kv_splits, mid_out.stride(0), mid_out.stride(1), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_q_heads,
        SELECTED_SPAN=selected_span if sparse else 0, BLOCK_N=launch.block_n, BLOCK_B=block_b,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=16, num_warps=4,
    )  # fmt: skip
    return out, lse


def merge_splits(mid_out, mid_lse, out, lse) -> None:
    """Stage 2: out [batch, heads, dim] and lse [batch, heads] from the splits' partial outputs
    mid_out [batch, heads, splits, dim] and LSEs mid_lse [batch, heads, splits]."""
    batch, num_q_heads, num_splits, head_dim = mid_out.shape
    block_s = triton.next_power_of_2(num_splits)
    _stage2[(batch, num_q_heads)](
        mid_out, mid_lse, out, lse,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_q_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=block_s,
        num_warps=8 if block_s >= 64 else 4,
    )  # fmt: skip


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
