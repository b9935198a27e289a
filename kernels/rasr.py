"""Lethe's decode attention: each layer attends to its own retained tokens and accumulates their
RASR scores (Recency-Aware Selective Retention, Lethe Eq. 5):

    s_t = gamma * s_{t-1} + sum over query heads of the attention probability the token receives.

A layer's retained set is a per-request list of entries with one score each. On CUDA a layer
attends over a table of KV rows (``shared_retained_decode``): the split-KV kernel over the list
(it also stores each attended token's scaled logit, by list entry), then one fused kernel turns
the logits into probabilities, sums them over heads and updates the scores in place. Lengths stay
on the device and grids depend on shapes only, so decode keeps its CUDA graph.

The table: when every layer keeps the same list of logical positions (one retained set: Lethe
with ``per_layer`` false, or under a selection), their KV slots are gathered once per step
(``gather_retained_slots``) and every layer attends over them; under per-layer memory each
layer's list holds its entries' global rows of the pool's one buffer
(``policies.lethe.layer_memory``) and is the table itself.

Under a selection composed over the eviction (``policies.eviction_selection``), a sparse layer
attends only to its selection among the retained entries; ``accumulate_selected`` then decays
every entry's score and adds the probabilities the selected ones received."""

import torch
import triton
import triton.language as tl

from .kv_view import KVView
from .split_kv_decode import SplitKVWorkspace, attend_positions_ref, split_kv_decode

_BLOCK_J = 128  # retained entries per block of the scoring and gathering programs
# Programs per batch entry, each striding over the entry's blocks: a program per block of the
# context-wide rows would leave thousands idle per layer. 16 rather than 8 keeps the SMs busy in
# a policy mix too, whose other members' rows leave about half the programs idle.
_PROGRAMS_PER_ENTRY = 16
# Selected units ``accumulate_selected`` counts at a time to find where a block's were gathered.
_SELECTED_BLOCK = 256


@triton.jit
def _accumulate_kernel(
    Logits,
    Lse,
    EntryCount,
    Rows,
    Scores,
    gamma,
    stride_lg_b,
    stride_lg_h,
    stride_sc_row,
    stride_sc_list,
    stride_ec_b,
    stride_ec_list,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    # program (entry, part, list): a list's scores sum the probabilities of its GROUP query heads
    batch = tl.program_id(0).to(tl.int64)
    head_list = tl.program_id(2)
    row = tl.load(Rows + batch).to(tl.int64)
    count = tl.load(EntryCount + batch * stride_ec_b + head_list * stride_ec_list)
    offs_h = head_list * GROUP + tl.arange(0, BLOCK_HQ)
    mask_h = tl.arange(0, BLOCK_HQ) < GROUP
    lse = tl.load(Lse + batch * NUM_Q_HEADS + offs_h, mask=mask_h, other=0.0)
    row_scores = Scores + row * stride_sc_row + head_list * stride_sc_list
    stride = tl.num_programs(1) * BLOCK_J
    for start in range(tl.program_id(1) * BLOCK_J, count, stride):
        offs_j = start + tl.arange(0, BLOCK_J)
        valid_j = offs_j < count
        logits = tl.load(
            Logits + batch * stride_lg_b + offs_h[:, None] * stride_lg_h + offs_j[None, :],
            mask=mask_h[:, None] & valid_j[None, :],
            other=float("-inf"),
        )
        received = tl.sum(tl.exp(logits - lse[:, None]), 0)
        old = tl.load(row_scores + offs_j, mask=valid_j, other=0.0)
        tl.store(row_scores + offs_j, gamma * old + received, mask=valid_j)


@triton.jit
def _gather_slots_kernel(
    ReqToToken,
    ReqPoolIdx,
    Positions,
    Count,
    Rows,
    SlotTable,
    EntryCount,
    stride_r2t,
    stride_pos_row,
    stride_table,
    BLOCK_J: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + batch).to(tl.int64)
    count = tl.load(Count + row)
    if tl.program_id(1) == 0:
        tl.store(EntryCount + batch, count)
    req_row = ReqToToken + tl.load(ReqPoolIdx + batch).to(tl.int64) * stride_r2t
    stride = tl.num_programs(1) * BLOCK_J
    for start in range(tl.program_id(1) * BLOCK_J, count, stride):
        offs_j = start + tl.arange(0, BLOCK_J)
        valid_j = offs_j < count
        pos = tl.load(Positions + row * stride_pos_row + offs_j, mask=valid_j, other=0)
        slot = tl.load(req_row + pos, mask=valid_j, other=0)
        tl.store(SlotTable + batch * stride_table + offs_j, slot, mask=valid_j)


@triton.jit
def _update_selected_kernel(
    Logits,
    Lse,
    Selected,
    NumSelected,
    EntryCount,
    Rows,
    Scores,
    gamma,
    stride_lg_b,
    stride_lg_h,
    stride_selected,
    stride_sc_row,
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_COUNT: tl.constexpr,
):
    # Programs stride over blocks of a request's entries, each decaying its block and adding
    # what its selected entries received: the units ascend, so the unit at selection index i was
    # gathered at i * SPAN (only the last can be partial) and a block's selected units are the
    # BLOCK_J / SPAN at most after those below it.
    batch = tl.program_id(0).to(tl.int64)
    count = tl.load(EntryCount + batch)
    num = tl.load(NumSelected + batch)
    units = Selected + batch * stride_selected
    row_scores = Scores + tl.load(Rows + batch).to(tl.int64) * stride_sc_row
    offs_h = tl.arange(0, BLOCK_HQ)
    mask_h = offs_h < NUM_Q_HEADS
    lse = tl.load(Lse + batch * NUM_Q_HEADS + offs_h, mask=mask_h, other=0.0)
    WINDOW: tl.constexpr = BLOCK_J // SPAN
    stride = tl.num_programs(1) * BLOCK_J
    for start in range(tl.program_id(1) * BLOCK_J, count, stride):
        offs_j = start + tl.arange(0, BLOCK_J)
        valid_j = offs_j < count
        below = num * 0  # selected units before this block's first
        for at in range(0, num, BLOCK_COUNT):
            offs_c = at + tl.arange(0, BLOCK_COUNT)
            unit = tl.load(units + offs_c, mask=offs_c < num, other=0)
            below += tl.sum(tl.where((offs_c < num) & (unit < start // SPAN), 1, 0), 0)
        offs_w = below + tl.arange(0, WINDOW)
        window = tl.load(units + offs_w, mask=offs_w < num, other=-1)
        match = window[:, None] == (offs_j // SPAN)[None, :]
        chosen = (tl.sum(match.to(tl.int32), 0) > 0) & valid_j
        index = tl.sum(tl.where(match, offs_w[:, None], 0), 0)
        gathered = index * SPAN + offs_j % SPAN
        logits = tl.load(
            Logits + batch * stride_lg_b + offs_h[:, None] * stride_lg_h + gathered[None, :],
            mask=mask_h[:, None] & chosen[None, :],
            other=float("-inf"),
        )
        received = tl.sum(tl.exp(logits - lse[:, None]), 0)
        old = tl.load(row_scores + offs_j, mask=valid_j, other=0.0)
        tl.store(row_scores + offs_j, gamma * old + received, mask=valid_j)


def accumulate(logits, lse, entry_count, rows, scores, gamma) -> None:
    """scores[rows[b], j] = gamma * scores[rows[b], j] + sum over heads of exp(logits[b, :, j] -
    lse[b]), for j < entry_count[b]. Lists per KV head (``scores`` [rows, KV heads, n],
    ``entry_count`` [>= batch, KV heads]): list h sums its query group's heads only."""
    batch, num_q_heads = lse.shape
    per_head = scores.dim() == 3
    lists = scores.shape[1] if per_head else 1
    _accumulate_kernel[(batch, _PROGRAMS_PER_ENTRY, lists)](
        logits, lse, entry_count, rows, scores, gamma,
        logits.stride(0), logits.stride(1), scores.stride(0),
        scores.stride(1) if per_head else 0, entry_count.stride(0),
        entry_count.stride(1) if per_head else 0,
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // lists,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads // lists), BLOCK_J=_BLOCK_J,
    )  # fmt: skip


def accumulate_selected(
    logits, lse, selected, num_selected, page_size: int, entry_count, rows, scores, gamma
) -> None:
    """RASR's update of a layer that attended only to a selection of the retained entries: every
    entry j < entry_count[b] of scores[rows[b]] decays by gamma and, where selected, adds the
    probability it received, summed over heads: exp(logits[b, h, i] - lse[b, h]) with i its index
    in the selection's gathered table (``SlotTable.gather``'s order). The selection is units
    selected[b, :num_selected[b]] of ``page_size`` entries in ascending order, as the choosers
    give it outside ART."""
    batch, num_q_heads = lse.shape
    block_j = max(_BLOCK_J, page_size)
    assert block_j % page_size == 0, "a block of entries holds whole units"
    _update_selected_kernel[(batch, _PROGRAMS_PER_ENTRY)](
        logits, lse, selected, num_selected, entry_count, rows, scores, gamma,
        logits.stride(0), logits.stride(1), selected.stride(0), scores.stride(0),
        NUM_Q_HEADS=num_q_heads, BLOCK_HQ=triton.next_power_of_2(num_q_heads), SPAN=page_size,
        BLOCK_J=block_j, BLOCK_COUNT=_SELECTED_BLOCK,
    )  # fmt: skip


def gather_retained_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor,
    state_rows: torch.Tensor,
    slot_table: torch.Tensor,
    entry_count: torch.Tensor,
) -> None:
    """Once per step, for lists every layer shares: slot_table[b, j] = the KV slot of
    positions[state_rows[b], j] in request req_pool_indices[b] (j < its count), and
    entry_count[b] = that count. slot_table [>= batch, >= longest list] int32 and entry_count
    [>= batch] int32 are the caller's; entries past a count are left as they were."""
    batch = state_rows.shape[0]
    _gather_slots_kernel[(batch, _PROGRAMS_PER_ENTRY)](
        req_to_token, req_pool_indices, positions, count, state_rows, slot_table, entry_count,
        req_to_token.stride(0), positions.stride(0), slot_table.stride(0), BLOCK_J=_BLOCK_J,
    )  # fmt: skip


def gather_retained_slots_ref(
    req_to_token, req_pool_indices, positions, count, state_rows, slot_table, entry_count
) -> None:
    """``gather_retained_slots`` in torch (its oracle, and the CPU path)."""
    batch = state_rows.shape[0]
    counts = count[state_rows]
    entry_count[:batch] = counts
    width = int(positions.shape[1])
    live = torch.arange(width, device=positions.device) < counts[:, None]
    rows = req_pool_indices.long()[:, None]
    slots = req_to_token[rows, positions[state_rows].long().clamp(max=req_to_token.shape[1] - 1)]
    part = slot_table[:batch, :width]
    part.copy_(torch.where(live, slots.to(slot_table.dtype), part))


def shared_retained_decode(
    q: torch.Tensor,
    kv: KVView,
    scores: torch.Tensor,
    state_rows: torch.Tensor,
    sm_scale: float,
    gamma: float,
    logits: torch.Tensor,
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Decode attention of q [batch, q_heads, dim] over a table of KV rows, with the RASR update:
    entry b attends to the rows ``kv.table[kv.rows[b], :kv.lengths[b]]`` of kv.k/kv.v and
    updates scores[state_rows[b], :kv.lengths[b]] in place. The table is the step's
    ``gather_retained_slots`` (rows arange(>= batch), int64; lengths its entry counts) or, under
    per-layer memory, a layer's list of global rows by request slot (rows the state rows, the
    buffers the pool's whole-pool views). ``logits`` a scratch [>= batch, q_heads, >= longest
    list] fp32. Returns out in q's dtype."""
    out, lse = split_kv_decode(q, kv, sm_scale, logits=logits[: q.shape[0]], workspace=workspace)
    accumulate(logits, lse, kv.lengths, state_rows, scores, gamma)
    return out


def shared_retained_decode_ref(
    q: torch.Tensor,
    kv: KVView,
    scores: torch.Tensor,
    state_rows: torch.Tensor,
    sm_scale: float,
    gamma: float,
) -> torch.Tensor:
    """Torch oracle of shared_retained_decode (and the CPU engine's path under per-layer
    memory), fp32; an entry with count 0 (padding) gets zeros. A table per KV head (``kv.table``
    [rows, KV heads, n], ``kv.lengths`` [>= batch, KV heads], ``scores`` [rows, KV heads, n]):
    each KV head's query group attends over its own list of rows, head h of each."""
    batch = q.shape[0]
    out = torch.zeros_like(q)
    if kv.table.dim() == 2:  # every KV head reads the same list: one list of all heads
        table, lengths, scores = kv.table[:, None], kv.lengths[:, None], scores[:, None]
        heads = [(slice(None), slice(None))]  # (KV heads, query heads)
    else:
        table, lengths = kv.table, kv.lengths
        group = q.shape[1] // table.shape[1]
        heads = [
            (slice(h, h + 1), slice(h * group, (h + 1) * group)) for h in range(table.shape[1])
        ]
    rows = zip(kv.rows[:batch].tolist(), lengths[:batch].tolist(), state_rows.tolist())
    for b, (table_row, counts, state_row) in enumerate(rows):
        for h, ((kv_heads, q_heads), n) in enumerate(zip(heads, counts, strict=True)):
            if n == 0:
                continue
            slots = table[table_row, h, :n].long()
            out[b, q_heads] = _attend_and_score(
                q[b, q_heads], kv.k[:, kv_heads], kv.v[:, kv_heads], slots, sm_scale,
                scores[state_row, h, :n], gamma,
            )  # fmt: skip
    return out


def selected_decode_ref(
    q: torch.Tensor,
    kv: KVView,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    page_size: int,
    scores: torch.Tensor,
    state_rows: torch.Tensor,
    sm_scale: float,
    gamma: float,
) -> torch.Tensor:
    """Decode over a selection of each request's retained entries, with the RASR update of
    ``accumulate_selected``: the oracle of a SlotTable's attention storing logits followed by
    ``accumulate_selected``, and the CPU engine's path. Entry b's retained entries are the table
    row ``kv.table[kv.rows[b], :kv.lengths[b]]``, their scores scores[state_rows[b]]; fp32."""
    batch = q.shape[0]
    out = torch.zeros_like(q)
    offsets = torch.arange(page_size, device=q.device)
    each = zip(
        kv.rows[:batch].tolist(), kv.lengths[:batch].tolist(), state_rows.tolist(),
        num_selected[:batch].tolist(),
    )  # fmt: skip
    for b, (table_row, n, state_row, num) in enumerate(each):
        row_scores = scores[state_row, :n]
        row_scores.mul_(gamma)
        entries = (selected[b, :num, None].long() * page_size + offsets).flatten()
        entries = entries[entries < n]
        if entries.numel() == 0:
            continue
        slots = kv.table[table_row, entries].long()
        out_b, logits = attend_positions_ref(q[b], kv.k, kv.v, slots, sm_scale)
        row_scores.index_add_(0, entries, torch.softmax(logits, dim=-1).sum(dim=0))
        out[b] = out_b.to(q.dtype)
    return out


def retained_decode_ref(
    q: torch.Tensor,
    kv: KVView,
    positions: torch.Tensor,
    count: torch.Tensor,
    scores: torch.Tensor,
    sm_scale: float,
    gamma: float,
    state_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode over each request's retained positions (``positions[row, :count[row]]``) through
    ``kv``'s table (SGLang's req_to_token; its lengths are not read): the CPU engine's path with
    one list for every layer, and the oracle of the gathered table (``gather_retained_slots`` +
    ``shared_retained_decode``); fp32 per request, an entry whose state row holds nothing
    (padding) gets zeros. ``state_rows`` default to kv.rows."""
    out = torch.zeros_like(q)
    table_rows = kv.rows[: q.shape[0]]
    rows = table_rows if state_rows is None else state_rows
    for b, (row, slots_row) in enumerate(zip(rows.tolist(), table_rows.tolist())):
        n = int(count[row])
        if n == 0:
            continue
        slots = kv.table[slots_row, positions[row, :n].long()].long()
        kept_scores = scores[row, :n]
        out[b] = _attend_and_score(q[b], kv.k, kv.v, slots, sm_scale, kept_scores, gamma)
    return out


def _attend_and_score(q, k, v, slots, sm_scale: float, scores, gamma: float):
    """One request's attention over ``slots`` of buffers k and v (fp32) and its RASR update of
    ``scores`` (a view of its entries' scores, in place); the output in q's dtype."""
    out, logits = attend_positions_ref(q, k, v, slots, sm_scale)
    scores.mul_(gamma).add_(torch.softmax(logits, dim=-1).sum(dim=0))
    return out.to(q.dtype)


def window_scores(
    queries: torch.Tensor, keys: torch.Tensor, seq_len: int, sm_scale: float,
    per_kv_head: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The attention the last prompt tokens pay to each of a request's tokens, summed over query
    heads and those queries, causal (Lethe Eq. 2 over a prefill's observation window).

    queries [n, q_heads, dim] are the queries of positions seq_len - n .. seq_len - 1; keys
    [seq_len, kv_heads, dim]. Returns [seq_len] fp32, or with ``per_kv_head`` [kv_heads, seq_len]
    (each KV head's query group summed apart). Torch on every device: it runs once per
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
    probabilities = torch.softmax(logits, dim=-1)
    if per_kv_head:
        return probabilities.view(keys.shape[1], -1, seq_len).sum(1)
    return probabilities.sum(dim=(0, 1))


def pool_neighbours(scores: torch.Tensor, pool: int) -> torch.Tensor:
    """Each token's score raised to its ``pool`` neighbours' best, along the last dimension. A
    question attends to a record's key, its answer then needs the value beside it (SnapKV's
    clustering, by max)."""
    if pool <= 1:
        return scores
    rows = scores.reshape(-1, 1, scores.shape[-1])
    pooled = torch.nn.functional.max_pool1d(rows, pool, stride=1, padding=pool // 2)
    return pooled[:, 0, : scores.shape[-1]].view_as(scores)
