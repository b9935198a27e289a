"""ART (Attention Run-time Termination) decode attention: stop reading KV tiles once the running
output is stable in scale and direction.

Each (request, KV head, split) program walks its share of a traversal order tile by tile
(``tile_tokens`` virtual tokens, ``TILE`` = 32 by default, the kernel's inner step), updating the
online-softmax output as usual. After each tile it probes the running output of its query heads
(every ``probe_stride``-th head dimension) and compares it with the probe after the previous tile:
d_scale = ||x_t - x_{t-1}||, d_direction = 1 - cos(x_t, x_{t-1}) (ART Eq. 2). A tile is stable
when every query head of the KV group has d_scale < tau and d_direction < phi; after
``patience`` consecutive stable tiles the program stops (Eq. 3, Algorithm 1). patience 0
never stops (the paper's p = infinity), and then no probe is taken. The first ``always_read``
virtual tokens (the base policy's sinks, placed at the head of the order) are read before any
stop. A larger tile makes each step's loads larger and probes rarer (the detector's cost), and a
stop coarser (a split reads whole tiles).

Traversal order: implicit recent-first over the whole cache (positions 0 .. always_read-1, then
seq_len-1 down to always_read), or an explicit per-request list of entries (pages or tokens of a
base policy's selection, most important first), as split_kv_decode's ``selected``.

Splits, and why: split s of S reads tiles s, s+S, s+2S... of the order (strided, so every split
starts near the head of the order) and stops on its own. A split needs 1 + patience tiles before it
can stop, so a request uses only as many of the launch's splits as hold at least ``SHARE_PER_STOP``
times that each (``active_splits``; the others read nothing): a short request is read by fewer,
longer splits that can stop, a long one by all of them. No program waits for another, so launches
stay graph-safe and parallel, and the splits are merged by log-sum-exp as in any split-KV decode (a
split that stopped contributes the mass it read). A split alone cannot tell that its tiles are
negligible next to the others' (its own output, normalised by its own mass, keeps moving), so its
probe is taken on its output merged with the head tile of the order (tile 0: the sinks and most
recent tokens, or the most important entries), which every split s > 0 reads once more for that
purpose only: the probe's mass is then at most the whole traversal's, so a tile's measured change
over-estimates its change to the final output (conservative), and splits whose tiles carry no mass
next to the head stop after ``patience`` tiles. All query heads of a KV group share their tiles, so
a program stops only when all of its heads are stable.
"""

import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from .kv_view import KVView
from .split_kv_decode import SplitKVWorkspace, merge_splits
from .tile import (
    empty_state,
    fold_tile,
    load_query,
    raise_max,
    store_split,
    tile_logits,
    tile_values,
)

TILE = 32  # tokens per tile by default (``tile_tokens``)
TILE_TOKENS = (16, 32, 64, 128)  # the tile sizes the kernel is built for
# A split's share holds at least this many times the 1 + patience tiles it needs to stop
SHARE_PER_STOP = 2
ART_COLUMNS = ("tau", "phi", "patience")  # a request's own values (request_columns)
_DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_tile(
    q, K, V, req_row, Order, order_row, tile, length, seq_len, always_read, sm_scale,
    e_max, e_sum, acc, kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    mask_h, offs_d, mask_d,
    BLOCK_N: tl.constexpr, ORDER_SPAN: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """One tile of the order folded into an online-softmax state (e_max, e_sum, acc)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_order = offs_n < length
    if ORDER_SPAN > 0:
        entry = tl.load(Order + order_row + offs_n // ORDER_SPAN, mask=in_order, other=0)
        pos = entry * ORDER_SPAN + offs_n % ORDER_SPAN
    else:
        pos = tl.where(offs_n < always_read, offs_n, seq_len - 1 - (offs_n - always_read))
    valid = in_order & (pos < seq_len) & (pos >= 0)
    slot = tl.load(req_row + pos, mask=valid, other=0).to(tl.int64)
    qk = tile_logits(
        q, K, slot, valid, kv_head, stride_k_slot, stride_k_head, mask_h, offs_d, mask_d,
        sm_scale, DOT_IN_FP32,
    )  # fmt: skip
    v = tile_values(V, slot, valid, kv_head, stride_v_slot, stride_v_head, offs_d, mask_d)
    return fold_tile(e_max, e_sum, acc, qk, v, DOT_IN_FP32)


@triton.jit
def _art_stage1(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Order,
    NumOrder,
    MidO,
    MidLse,
    TilesRead,
    TileCounts,
    sm_scale,
    tau,
    phi,
    patience,
    RequestTau,
    RequestPhi,
    RequestPatience,
    always_read,
    stride_qb,
    stride_qh,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_r2t,
    stride_order,
    stride_mid_b,
    stride_mid_h,
    stride_mid_s,
    stride_lse_b,
    stride_lse_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ORDER_SPAN: tl.constexpr,
    PROBE_STRIDE: tl.constexpr,
    COUNT_TILES: tl.constexpr,
    PER_REQUEST: tl.constexpr,
    SHARE_PER_STOP: tl.constexpr,
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
    probe = mask_d & (offs_d % PROBE_STRIDE == 0)

    seq_len = tl.load(SeqLens + batch)
    req_pool_idx = tl.load(ReqPoolIdx + batch).to(tl.int64)
    req_row = ReqToToken + req_pool_idx * stride_r2t
    if PER_REQUEST:  # this request's own (tau, phi, patience), a column each by its row
        tau = tl.load(RequestTau + req_pool_idx)
        phi = tl.load(RequestPhi + req_pool_idx)
        patience = tl.load(RequestPatience + req_pool_idx)
    order_row = batch * stride_order
    if ORDER_SPAN > 0:
        length = tl.load(NumOrder + batch) * ORDER_SPAN
    else:
        length = seq_len
    num_tiles = tl.cdiv(length, BLOCK_N)
    # active_splits: fewer, longer splits for a short request, so that they can stop
    active = tl.minimum(tl.maximum(num_tiles // (SHARE_PER_STOP * (1 + patience)), 1), NUM_SPLITS)
    # int32 like the split id: a loop-carried tile must keep one type (int64 seq_lens made it 64)
    active = tl.where(patience > 0, active, NUM_SPLITS).to(tl.int32)

    q = load_query(Q, K, batch, heads, stride_qb, stride_qh, mask_h, offs_d, mask_d, DOT_IN_FP32)

    # The head tile, for the probe only (split 0 reads it as its own first tile).
    ref_max, ref_sum, ref_acc = empty_state(BLOCK_H, BLOCK_D)
    if (split > 0) & (split < active) & (patience > 0) & (num_tiles > split):
        ref_max, ref_sum, ref_acc = _attend_tile(
            q, K, V, req_row, Order, order_row, 0, length, seq_len, always_read, sm_scale,
            ref_max, ref_sum, ref_acc, kv_head, stride_k_slot, stride_k_head, stride_v_slot,
            stride_v_head, mask_h, offs_d, mask_d,
            BLOCK_N=BLOCK_N, ORDER_SPAN=ORDER_SPAN, DOT_IN_FP32=DOT_IN_FP32,
        )  # fmt: skip

    e_max, e_sum, acc = empty_state(BLOCK_H, BLOCK_D)
    prev_x = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    stable = 0
    read = 0
    tile = split
    go = (tile < num_tiles) & (split < active)
    while go:
        e_max, e_sum, acc = _attend_tile(
            q, K, V, req_row, Order, order_row, tile, length, seq_len, always_read, sm_scale,
            e_max, e_sum, acc, kv_head, stride_k_slot, stride_k_head, stride_v_slot,
            stride_v_head, mask_h, offs_d, mask_d,
            BLOCK_N=BLOCK_N, ORDER_SPAN=ORDER_SPAN, DOT_IN_FP32=DOT_IN_FP32,
        )  # fmt: skip
        read += 1
        stop = tile < 0  # a device False: the branch below may set it
        if patience > 0:  # else nothing stops: no probe
            # The probe: the running output merged with the head tile; its change (Eq. 2).
            _, shift, own = raise_max(e_max, ref_max)
            head = tl.exp(ref_max - shift)
            mass = e_sum * own + ref_sum * head
            merged = (acc * own[:, None] + ref_acc * head[:, None]) / tl.where(mass > 0, mass, 1.0)[:, None]
            x = tl.where(probe[None, :], merged, 0.0)
            d_scale = tl.sqrt(tl.sum((x - prev_x) * (x - prev_x), 1))
            norms = tl.sqrt(tl.sum(x * x, 1)) * tl.sqrt(tl.sum(prev_x * prev_x, 1))
            cosine = tl.sum(x * prev_x, 1) / tl.maximum(norms, 1e-30)
            head_stable = ((d_scale < tau) & (1.0 - cosine < phi)) | (offs_h >= GROUP)
            all_stable = (tl.min(head_stable.to(tl.int32), 0) == 1) & (read > 1)
            stable = tl.where(all_stable, stable + 1, 0)
            prev_x = x
            past_sinks = (tile + active) * BLOCK_N >= always_read  # none left in this share
            stop = (stable >= patience) & past_sinks
        tile += active
        go = (tile < num_tiles) & (stop == 0)

    tl.store(TilesRead + (batch * tl.num_programs(1) + kv_head) * NUM_SPLITS + split, read)
    if COUNT_TILES:
        share = tl.where(split < active, tl.maximum(num_tiles - split + active - 1, 0) // active, 0)
        tl.atomic_add(TileCounts, read.to(tl.int64))
        tl.atomic_add(TileCounts + 1, share.to(tl.int64))
    store_split(
        MidO, MidLse, e_max, e_sum, acc, batch, heads, split, stride_mid_b, stride_mid_h,
        stride_mid_s, stride_lse_b, stride_lse_h, mask_h, offs_d, mask_d,
    )  # fmt: skip


def art_decode(
    q: torch.Tensor,
    kv: KVView,
    sm_scale: float,
    *,
    tau: float,
    phi: float,
    patience: int,
    always_read: int = 0,
    probe_stride: int = 1,
    order: torch.Tensor | None = None,
    num_order: torch.Tensor | None = None,
    order_span: int = 1,
    num_kv_splits: int = 8,
    tile_tokens: int = TILE,
    workspace: SplitKVWorkspace | None = None,
    out: torch.Tensor | None = None,
    tiles_read: torch.Tensor | None = None,
    tile_counts: torch.Tensor | None = None,
    request_columns: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ART decode of q [batch, q_heads, dim] over ``kv`` (module docstring). Without ``order``:
    recent-first over each request's whole cache after its first ``always_read`` tokens. With
    ``order`` ([batch, max_entries] int32, most important first) and ``num_order`` ([batch]
    int32): entry j covers positions order[b, j] * order_span + r, r < order_span.

    Returns (out [batch, q_heads, dim] in q's dtype, tiles_read [batch, kv_heads, splits] int32:
    the tiles each program read). ``tile_counts`` (int64 [2]), when given, accumulates on the
    device [tiles read, tiles the order holds] over all programs: what metrics report.
    ``request_columns`` ({"tau", "phi": float32, "patience": int32} [request slots], contiguous),
    when given, hold each request's own values by its row of the table (``kv.rows``), in place of
    the scalars. A
    ``workspace`` made with ``num_splits=num_kv_splits`` and a ``tiles_read`` buffer ([batch or
    more, kv_heads, splits] int32) supply the scratch, so the call allocates nothing."""
    if tile_tokens not in TILE_TOKENS:
        raise ValueError(f"tile_tokens must be one of {TILE_TOKENS}, got {tile_tokens}")
    batch, num_q_heads, head_dim = q.shape
    k_buffer, v_buffer, table, lengths = kv.k, kv.v, kv.table, kv.lengths
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    dev = q.device
    if workspace is not None:
        splits, mid_out, mid_lse, lse = workspace.views(batch)
        assert splits == num_kv_splits, "the workspace is made for another split count"
    else:
        f32 = {"dtype": torch.float32, "device": dev}
        mid_out = torch.empty(batch, num_q_heads, num_kv_splits, head_dim, **f32)
        mid_lse = torch.empty(batch, num_q_heads, num_kv_splits, **f32)
        lse = torch.empty(batch, num_q_heads, **f32)
    out = torch.empty_like(q) if out is None else out
    if tiles_read is None:
        tiles_read = torch.empty(batch, num_kv_heads, num_kv_splits, dtype=torch.int32, device=dev)
    tiles_read = tiles_read[:batch]
    explicit = order is not None
    order_arg = order if explicit else lengths  # unread placeholders keep the signature fixed
    columns = [q] * 3 if request_columns is None else [request_columns[n] for n in ART_COLUMNS]
    block_d = triton.next_power_of_2(head_dim)
    _art_stage1[(batch, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, table, kv.rows, lengths,
        order_arg, num_order if explicit else lengths, mid_out, mid_lse, tiles_read,
        tiles_read if tile_counts is None else tile_counts, sm_scale, tau, phi, patience,
        *columns, always_read,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), table.stride(0), order_arg.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=tile_tokens,
        NUM_SPLITS=num_kv_splits, ORDER_SPAN=order_span if explicit else 0,
        PROBE_STRIDE=probe_stride, COUNT_TILES=tile_counts is not None,
        PER_REQUEST=request_columns is not None, SHARE_PER_STOP=SHARE_PER_STOP,
        DOT_IN_FP32=_DOT_IN_FP32, num_warps=4, num_stages=2,
    )  # fmt: skip
    merge_splits(mid_out, mid_lse, out, lse)
    return out, tiles_read


def active_splits(num_tiles: int, patience: int, num_splits: int) -> int:
    """How many of ``num_splits`` splits read a request of ``num_tiles`` tiles: each share holds
    SHARE_PER_STOP × (1 + patience) tiles or more where it can, all of them when nothing stops."""
    if patience <= 0:
        return num_splits
    return min(max(num_tiles // (SHARE_PER_STOP * (1 + patience)), 1), num_splits)


def traversal_positions(
    seq_len: int,
    always_read: int,
    order: torch.Tensor | None = None,
    order_span: int = 1,
) -> torch.Tensor:
    """The logical positions one request is read in, as art_decode walks them (-1: a padded
    position past seq_len, read as nothing)."""
    if order is None:
        n = torch.arange(seq_len)
        return torch.where(n < always_read, n, seq_len - 1 - (n - always_read))
    offsets = torch.arange(order_span)
    pos = (order.long()[:, None] * order_span + offsets).flatten()
    return torch.where(pos < seq_len, pos, -1)


def art_decode_ref(
    q: torch.Tensor,
    kv: KVView,
    sm_scale: float,
    *,
    tau: float,
    phi: float,
    patience: int,
    always_read: int = 0,
    probe_stride: int = 1,
    order: torch.Tensor | None = None,
    num_order: torch.Tensor | None = None,
    order_span: int = 1,
    num_kv_splits: int = 8,
    tile_tokens: int = TILE,
    tile_counts: torch.Tensor | None = None,
    request_columns: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of art_decode (same arguments and returns; fp32), and the CPU engine's path:
    every split's running output after each of its tiles is computed at once (cumulative sums
    under one max), then each split stops where the stability rule first holds."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    tiles_read = torch.zeros(batch, num_kv_heads, num_kv_splits, dtype=torch.int32)
    probe = torch.arange(head_dim, device=q.device) % probe_stride == 0
    tiles_in_order = 0
    own = None
    if request_columns is not None:
        own = list(zip(*(request_columns[name].cpu().tolist() for name in ART_COLUMNS)))
    for b, (row, seq_len) in enumerate(zip(kv.rows[:batch].tolist(), kv.lengths[:batch].tolist())):
        if own is not None:
            tau, phi, patience = own[row][0], own[row][1], int(own[row][2])
        entries = None if order is None else order[b, : int(num_order[b])].cpu()
        positions = traversal_positions(seq_len, always_read, entries, order_span).to(q.device)
        num_tiles = -(-positions.numel() // tile_tokens)
        tiles_in_order += num_tiles * num_kv_heads
        if num_tiles == 0:
            continue
        splits = active_splits(num_tiles, patience, num_kv_splits)
        per_split = -(-num_tiles // splits)
        # [splits, per_split, tile]: split s holds tiles s, s + splits, ... (-1: nothing)
        padded = torch.full((per_split * splits * tile_tokens,), -1, device=q.device)
        padded[: positions.numel()] = positions
        by_split = padded.view(per_split, splits, tile_tokens).transpose(0, 1)
        tile_exists = (torch.arange(per_split)[None, :] * splits + torch.arange(splits)[:, None]) < num_tiles
        valid = by_split >= 0
        slots = kv.table[row, by_split.clamp_min(0)].long()
        for g in range(num_kv_heads):
            heads = slice(g * group, (g + 1) * group)
            k = kv.k[slots, g].float()  # [splits, per_split, tile, dim]
            v = kv.v[slots, g].float()
            logits = torch.einsum("hd,sptd->hspt", q[b, heads].float(), k) * sm_scale
            logits = logits.masked_fill(~valid, float("-inf"))
            top = logits.amax(dim=(1, 2, 3), keepdim=True).clamp_min(-1e30)
            weights = torch.exp(logits - top)  # [heads, splits, per_split, tile]
            mass = weights.sum(-1).cumsum(-1)  # [heads, splits, per_split]: after each tile
            acc = torch.einsum("hspt,sptd->hspd", weights, v).cumsum(2)
            # the probe: each split's output merged with the order's head tile (splits > 0)
            with_head = torch.arange(splits, device=q.device) > 0
            with_head &= patience > 0
            head_mass = weights[:, 0, 0].sum(-1)  # [heads]
            head_acc = torch.einsum("ht,td->hd", weights[:, 0, 0], v[0, 0])
            probe_mass = mass + head_mass[:, None, None] * with_head[None, :, None]
            probe_acc = acc + head_acc[:, None, None] * with_head[None, :, None, None]
            x = (probe_acc / probe_mass.clamp_min(1e-30)[..., None])[..., probe]
            x = torch.where(probe_mass[..., None] > 0, x, 0.0)
            prev = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], dim=2)
            d_scale = (x - prev).norm(dim=-1)
            cosine = (x * prev).sum(-1) / (x.norm(dim=-1) * prev.norm(dim=-1)).clamp_min(1e-30)
            stable = ((d_scale < tau) & (1 - cosine < phi)).all(dim=0)  # [splits, per_split]
            stable[:, 0] = False
            read = tile_exists.sum(-1).clone()
            count = torch.zeros(splits, dtype=torch.int64)
            stopped = torch.zeros(splits, dtype=torch.bool)
            for t in range(per_split):
                count = torch.where(stable[:, t].cpu(), count + 1, 0)
                tile_index = torch.arange(splits) + t * splits
                past_sinks = (tile_index + splits) * tile_tokens >= always_read
                stop = (patience > 0) & (count >= patience) & past_sinks & ~stopped & tile_exists[:, t]
                read = torch.where(stop, t + 1, read)
                stopped |= stop
            tiles_read[b, g, :splits] = read.int()
            last = (read - 1).clamp_min(0).to(q.device)
            took = read.to(q.device) > 0
            split_mass = mass.gather(2, last.view(1, splits, 1).expand(group, -1, -1))[..., 0] * took
            split_acc = acc[:, torch.arange(splits), last] * took[None, :, None]
            total = split_mass.sum(1)
            out[b, heads] = torch.where(
                total[:, None] > 0, split_acc.sum(1) / total.clamp_min(1e-30)[:, None], 0.0
            ).to(q.dtype)
    if tile_counts is not None:
        tile_counts += torch.tensor([int(tiles_read.sum()), tiles_in_order], device=tile_counts.device)
    return out, tiles_read
