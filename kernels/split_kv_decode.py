"""Split-KV decode attention over SGLang's token-slot KV layout (selection and sparse kernels).

Mirrors SGLang's triton decode kernel (sglang/kernels/ops/attention/decode_attention.py): stage 1
gives each (request, KV head, split) program one slice of the request's tokens and all query heads
of that KV group; it writes a partial output and its log-sum-exp. Stage 2 merges the splits by LSE
(or, over few splits, the last of a group's stage-1 programs to finish does: no second launch).
Differences: tokens are addressed by logical position through `req_to_token` (a ``KVView``'s
table; optionally through a per-request list of selected pages or tokens), every split always
writes (an empty one writes LSE = -inf), the final LSE is returned, and stage 1 can also store the
scaled logits q·k for scoring. Lengths stay on the device and grids depend on shapes only: launches
are CUDA-graph safe. The tile step is kernels/tile.py's, shared with ART's kernel.
"""

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .kv_view import KVView
from .tile import (
    empty_state,
    fold_tile,
    load_query,
    raise_max,
    store_split,
    tile_logits,
    tile_values,
)

_BLOCK_N = 32  # the split granularity, like SGLang's MIN_BLOCK_KV
# A grid of about this many programs per SM hides memory latency; a fixed split count left most
# SMs idle at small batches (8 splits x 2 KV heads = 16 programs on 132 SMs at batch 1).
PROGRAMS_PER_SM = 4
# Over a short list (a sparse layer's 1k-token selection) fewer, longer splits are faster; whole-
# cache reads gain nothing past four programs per SM (benchmarks.kernel_bench --parts tune).
SHORT_LIST_PROGRAMS_PER_SM = 2
MAX_KV_SPLITS = 128
# Up to this many splits the last program of a (request, KV head) to finish merges them itself,
# where its launch says so, sparing stage 2's launch; with more splits the merge costs what that
# launch did or more (benchmarks.kernel_bench --parts tune).
MAX_MERGED_SPLITS = 4
# Triton's interpreter multiplies bf16 tl.dot operands as raw uint16 bits (triton 3.8), so under it
# the dots run on fp32 copies; compiled kernels keep native-dtype tensor-core dots.
_DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Stage1Launch:
    """Stage 1's tile and launch: tokens per inner step (a multiple of _BLOCK_N), warps,
    software-pipeline stages, and whether the last split's program merges the splits (at up to
    MAX_MERGED_SPLITS; else stage 2's launch does). benchmarks.kernel_bench --parts tune measures
    the choices."""

    block_n: int
    num_warps: int
    num_stages: int
    merge_in_last_split: bool = True


# The fastest launches of benchmarks.kernel_bench --parts tune: over the whole cache (selection
# layers) 64-token tiles, over scattered selected pages 32-token tiles, both with 3 stages. The
# merge's registers slow the whole-cache loop, so over the whole cache stage 2 merges.
STAGE1_WHOLE = Stage1Launch(block_n=64, num_warps=4, num_stages=3, merge_in_last_split=False)
STAGE1_SELECTED = Stage1Launch(block_n=32, num_warps=4, num_stages=3)
# A selection split over few programs (a large batch: one split per request and KV head) gives
# each a long run of tokens, which 64-token tiles read faster; short splits waste less of 32-token
# tiles (benchmarks.kernel_bench --parts tune, its sparse kinds at 1 to 256 requests).
STAGE1_SELECTED_LONG = Stage1Launch(block_n=64, num_warps=4, num_stages=3)
LONG_SPLIT_TOKENS = 1024


def selected_launch(max_entries: int, num_splits: int) -> Stage1Launch:
    """Stage 1's launch over a selection of up to ``max_entries`` tokens in ``num_splits``."""
    long = max_entries >= LONG_SPLIT_TOKENS * num_splits
    return STAGE1_SELECTED_LONG if long else STAGE1_SELECTED


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
    Out,
    Lse,
    Arrivals,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_r2t,
    stride_r2t_head,
    stride_len_b,
    stride_len_head,
    stride_sel,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    stride_lg_b,
    stride_lg_h,
    stride_ob,
    stride_oh,
    logits_len,
    num_splits,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SELECTED_SPAN: tl.constexpr,
    INDIRECT_ROWS: tl.constexpr,
    LENGTH_AT_ROW: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    RAGGED_LOGITS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
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

    row = tl.load(ReqPoolIdx + batch).to(tl.int64)
    # a table per KV head (lists per KV head) has a head stride, and lengths per head; a table
    # every head reads has stride 0
    if LENGTH_AT_ROW:  # lengths by table row: several tables in one storage (SharedSlotTables)
        seq_len = tl.load(SeqLens + row * stride_len_b + kv_head * stride_len_head)
    else:
        seq_len = tl.load(SeqLens + batch * stride_len_b + kv_head * stride_len_head)
    req_row = ReqToToken + row * stride_r2t + kv_head * stride_r2t_head
    # Virtual token n is logical position n, or token n % SPAN of selected entry n // SPAN.
    if SELECTED_SPAN > 0:
        length = tl.load(NumSelected + batch) * SELECTED_SPAN
        if INDIRECT_ROWS:  # entry b's selection is row SelectedRows[b] of Selected
            selected_row = Selected + tl.load(SelectedRows + batch).to(tl.int64) * stride_sel
        else:
            selected_row = Selected + batch * stride_sel
    else:
        length = seq_len
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
    end = tl.minimum(start + per_split, length)

    q = load_query(Q, K, batch, heads, stride_qb, stride_qh, mask_h, offs_d, mask_d, DOT_IN_FP32)

    e_max, e_sum, acc = empty_state(BLOCK_H, BLOCK_D)
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

        qk = tile_logits(
            q, K, slot, valid, kv_head, stride_k_slot, stride_k_head, mask_h, offs_d, mask_d,
            sm_scale, DOT_IN_FP32,
        )  # fmt: skip
        if STORE_LOGITS:
            tl.store(
                Logits + logits_row + heads[:, None] * stride_lg_h + pos[None, :],
                qk,
                mask=mask_h[:, None] & valid[None, :] & (pos[None, :] < logits_end),
            )

        v = tile_values(V, slot, valid, kv_head, stride_v_slot, stride_v_head, offs_d, mask_d)
        e_max, e_sum, acc = fold_tile(e_max, e_sum, acc, qk, v, DOT_IN_FP32)

    store_split(
        MidO, MidLse, e_max, e_sum, acc, batch, heads, split, stride_mid_b, stride_mid_h,
        stride_mid_s, stride_lse_b, stride_lse_h, mask_h, offs_d, mask_d,
    )  # fmt: skip
    if MERGE_SPLITS > 0:
        # Every warp's partial is stored before the count is released (at GPU scope); the
        # program that brings the count to the split count reads all of them after acquiring it.
        tl.debug_barrier()
        arrival = Arrivals + batch * num_kv_heads + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == MERGE_SPLITS - 1:
            _merge_group(
                MidO, MidLse, Out, Lse, batch, kv_head, stride_mid_b, stride_mid_h, stride_mid_s,
                stride_lse_b, stride_lse_h, stride_ob, stride_oh, num_kv_heads * GROUP,
                MERGE_SPLITS, GROUP, BLOCK_G, HEAD_DIM, BLOCK_D,
            )  # fmt: skip
            tl.store(arrival, 0)  # ready for the next call (a replayed graph's too)


@triton.jit
def _merge_group(
    MidO, MidLse, Out, Lse, batch, kv_head, stride_mid_b, stride_mid_h, stride_mid_s,
    stride_lse_b, stride_lse_h, stride_ob, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Stage 2 for one KV group's query heads, by stage 1's last program: _stage2's merge, but
    over a compile-time split count (_stage2 takes up to MAX_KV_SPLITS at run time, a program per
    query head). The loop is unrolled so that every split's loads are in flight at once (a loop
    over them waited on each); they bypass L1 (.cg), which may hold lines from before the other
    programs' stores."""
    offs_h = tl.arange(0, BLOCK_G)  # the group's heads only: BLOCK_H pads them for tl.dot
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_row = MidLse + batch * stride_lse_b + heads * stride_lse_h
    out_rows = MidO + batch * stride_mid_b + heads[:, None] * stride_mid_h + offs_d[None, :]
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    merged = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_SPLITS):  # online, as over tokens: an empty split weighs 0
        split_lse = tl.load(lse_row + s, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
        split_out = tl.load(
            out_rows + s * stride_mid_s, mask=mask_hd, other=0.0, cache_modifier=".cg"
        )
        new_top, shift, rescale = raise_max(top, split_lse)
        weight = tl.exp(split_lse - shift)
        merged = merged * rescale[:, None] + weight[:, None] * split_out
        total = total * rescale + weight
        top = new_top
    safe_total = tl.where(total > 0, total, 1.0)
    tl.store(
        Out + batch * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        (merged / safe_total[:, None]).to(Out.dtype.element_ty),
        mask=mask_hd,
    )
    lse = tl.where(total > 0, top + tl.log(safe_total), float("-inf"))
    tl.store(Lse + batch * num_heads + heads, lse, mask=mask_h)


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


class SplitKVWorkspace:
    """split_kv_decode's scratch for one layer shape, owned up front: each split's partial output
    and LSE for batches up to ``max_batch`` at the split counts ``num_kv_splits_for`` picks, and
    the merged LSE. A call takes views of it, so decode allocates nothing. ``num_splits`` fixes
    one split count for every batch (ART's kernel takes its count as a compile-time constant);
    ``programs_per_sm`` is num_kv_splits_for's."""

    def __init__(
        self, max_batch, num_q_heads, num_kv_heads, head_dim, max_tokens, device, num_splits=None,
        programs_per_sm=PROGRAMS_PER_SM,
    ):  # fmt: skip
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.max_tokens, self.device = max_tokens, torch.device(device)
        self.splits = [0] + [
            num_splits or num_kv_splits_for(b, num_kv_heads, max_tokens, device, programs_per_sm)
            for b in range(1, max_batch + 1)
        ]
        most = max(b * splits for b, splits in enumerate(self.splits))
        f32 = {"dtype": torch.float32, "device": self.device}
        self._mid_out = torch.empty(most * num_q_heads * head_dim, **f32)
        self._mid_lse = torch.empty(most * num_q_heads, **f32)
        self._lse = torch.empty(max_batch * num_q_heads, **f32)
        # splits finished per (request, KV head), back to 0 after each call's merge
        self._arrivals = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)

    def views(self, batch: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(splits, mid_out [batch, q_heads, splits, dim], mid_lse [batch, q_heads, splits],
        lse [batch, q_heads]) for a batch of ``batch`` requests."""
        splits, heads = self.splits[batch], self.num_q_heads
        mid_out = self._mid_out[: batch * heads * splits * self.head_dim]
        mid_lse = self._mid_lse[: batch * heads * splits]
        return (
            splits,
            mid_out.view(batch, heads, splits, self.head_dim),
            mid_lse.view(batch, heads, splits),
            self._lse[: batch * heads].view(batch, heads),
        )

    def arrivals(self, batch: int) -> torch.Tensor:
        """The merge's counters for a batch of ``batch`` requests (int32 [batch, KV heads])."""
        return self._arrivals[: batch * self.num_kv_heads].view(batch, self.num_kv_heads)


def split_kv_decode(
    q: torch.Tensor,
    kv: KVView,
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
    lengths_by_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q [batch, q_heads, dim] over each request's tokens in ``kv``.

    Returns (out [batch, q_heads, dim] in q's dtype, lse [batch, q_heads] fp32). With `selected`
    ([rows, max_selected] int32) and `num_selected` ([batch] int32), request b attends only to the
    logical positions selected[r, j] * selected_span + s (j < num_selected[b], s < selected_span,
    position < its length), where r = selected_rows[b] (int64 [batch]) or, without it, b. With
    `logits` ([batch, q_heads, logits_len] fp32), the scaled q·k of every attended position below
    logits_len is stored there; other entries are left untouched. With `logits_row_start`
    ([batch] int64) the rows are ragged: `logits` is [q_heads, capacity] and request b's position
    p is at column logits_row_start[b] + p (stored below capacity). `num_kv_splits` defaults to
    num_kv_splits_for's choice (the workspace's, with one); a `workspace` supplies the scratch.
    `launch` defaults to STAGE1_SELECTED with a selection, else STAGE1_WHOLE. With
    `lengths_by_row` request b's length is kv.lengths[kv.rows[b]], not kv.lengths[b]. A table
    per KV head (``kv.table`` [rows, KV heads, n], ``kv.lengths`` [>= batch, KV heads]): KV head
    h of request b reads its own row ``kv.table[kv.rows[b], h]`` and length ``kv.lengths[b, h]``.
    """
    batch, num_q_heads, head_dim = q.shape
    k_buffer, v_buffer, table, rows, lengths = kv.k, kv.v, kv.table, kv.rows, kv.lengths
    num_kv_heads = k_buffer.shape[1]
    assert num_q_heads % num_kv_heads == 0 and v_buffer.shape[-1] == head_dim == k_buffer.shape[-1]
    group = num_q_heads // num_kv_heads
    sparse = selected is not None
    launch = launch or (STAGE1_SELECTED if sparse else STAGE1_WHOLE)
    if workspace is not None:
        assert num_kv_splits is None, "the workspace fixes the split count"
        num_kv_splits, mid_out, mid_lse, lse = workspace.views(batch)
        arrivals = workspace.arrivals(batch)
    else:
        if num_kv_splits is None:
            most = selected.shape[1] * selected_span if sparse else table.shape[1]
            num_kv_splits = num_kv_splits_for(batch, num_kv_heads, most, q.device)
        f32 = {"dtype": torch.float32, "device": q.device}
        mid_out = torch.empty(batch, num_q_heads, num_kv_splits, head_dim, **f32)
        mid_lse = torch.empty(batch, num_q_heads, num_kv_splits, **f32)
        lse = torch.empty(batch, num_q_heads, **f32)
        arrivals = torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    if num_kv_splits == 1:  # stage 1 writes the result: nothing to merge
        mid_out, mid_lse = out.unsqueeze(2), lse.unsqueeze(2)
    merge_in_last = launch.merge_in_last_split and 1 < num_kv_splits <= MAX_MERGED_SPLITS
    selected_arg = selected if sparse else lengths  # unread placeholders keep the signature fixed
    rows_arg = selected_rows if selected_rows is not None else lengths
    logits_arg = logits if logits is not None else mid_lse
    ragged = logits_row_start is not None
    lg_stride_b, lg_stride_h = (0, logits_arg.stride(0)) if ragged else logits_arg.stride()[:2]

    block_d = triton.next_power_of_2(head_dim)
    _stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, table, rows, lengths,
        selected_arg, rows_arg, num_selected if sparse else lengths, mid_out, mid_lse, logits_arg,
        logits_row_start if ragged else lengths, out, lse, arrivals, sm_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), table.stride(0),
        table.stride(1) if table.dim() == 3 else 0, lengths.stride(0),
        lengths.stride(1) if lengths.dim() == 2 else 0, selected_arg.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        lg_stride_b, lg_stride_h, out.stride(0), out.stride(1), logits_arg.shape[-1],
        num_kv_splits, num_kv_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=launch.block_n,
        SELECTED_SPAN=selected_span if sparse else 0, INDIRECT_ROWS=selected_rows is not None,
        LENGTH_AT_ROW=lengths_by_row, STORE_LOGITS=logits is not None, RAGGED_LOGITS=ragged,
        MERGE_SPLITS=num_kv_splits if merge_in_last else 0, DOT_IN_FP32=_DOT_IN_FP32,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_kv_splits > 1 and not merge_in_last:
        merge_splits(mid_out, mid_lse, out, lse)
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
