"""Decode attention over a per-request selection: DELTA's 16-token pages or TidalDecode's tokens.

The selection is a fixed-size `selected` [batch, max_selected] int32 of logical page (or token)
indices plus `num_selected` [batch] int32; entries at or past num_selected[b] are never read, so
buffers keep their shapes from step to step and the launch stays CUDA-graph safe (no host sync).
All query heads of a request share its selection. A selected page may extend past seq_len (the
request's last page); its missing tokens are skipped.

On CUDA a selection is read through a ``SlotTable``: each selection layer gathers its requests'
selected KV slots once, and every sparse layer after it attends over that table with the split-KV
kernel reading the table as its req_to_token, under the launch tuned for selected lists
(``selected_launch``: shorter tiles than the whole-cache launch's where the list is split over
many programs, and the merge by the last split's program; benchmarks.kernel_bench --parts tune).
Several readers' tables may share one storage (``SharedSlotTables``: a policy mix's members), so
that one call reads each batch entry's row from its own reader's table.
"""

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .kv_view import KVView
from .split_kv_decode import (
    SHORT_LIST_PROGRAMS_PER_SM,
    SplitKVWorkspace,
    attend_positions_ref,
    num_kv_splits_for,
    selected_launch,
    split_kv_decode,
)

_GATHER_UNITS = 1024  # selected tokens per block of the gathering program


@triton.jit
def _gather_selected_kernel(
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Selected,
    NumSelected,
    SlotTable,
    EntryCount,
    stride_r2t,
    stride_selected,
    stride_table,
    SPAN: tl.constexpr,
    BLOCK_UNITS: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    req_row = ReqToToken + tl.load(ReqPoolIdx + batch).to(tl.int64) * stride_r2t
    seq_len = tl.load(SeqLens + batch).to(tl.int32)
    num = tl.load(NumSelected + batch)
    offs_s = tl.arange(0, SPAN)
    written = seq_len * 0
    for start in range(0, num, BLOCK_UNITS):
        offs_u = start + tl.arange(0, BLOCK_UNITS)
        unit = tl.load(Selected + batch * stride_selected + offs_u, mask=offs_u < num, other=0)
        first = unit * SPAN
        # the tokens of a unit below seq_len, packed after the units before it
        valid = tl.where(offs_u < num, tl.minimum(tl.maximum(seq_len - first, 0), SPAN), 0)
        at = written + tl.cumsum(valid, 0) - valid
        keep = offs_s[None, :] < valid[:, None]
        slot = tl.load(req_row + first[:, None] + offs_s[None, :], mask=keep, other=0)
        entry = SlotTable + batch * stride_table + at[:, None] + offs_s[None, :]
        tl.store(entry, slot, mask=keep)
        written += tl.sum(valid, 0)
    tl.store(EntryCount + batch, written)


def gather_selected_slots(
    kv: KVView,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    page_size: int,
    slot_table: torch.Tensor,
    entry_count: torch.Tensor,
) -> None:
    """slot_table[b, :entry_count[b]] = the KV slots (in ``kv``'s table) of request b's selected
    tokens below its length, unit by unit in the selection's order; slot_table [>= batch, >=
    max_selected * page_size] int32 and entry_count [>= batch] int32 are the caller's."""
    batch = selected.shape[0]
    _gather_selected_kernel[(batch,)](
        kv.table, kv.rows, kv.lengths, selected, num_selected, slot_table,
        entry_count, kv.table.stride(0), selected.stride(0), slot_table.stride(0),
        SPAN=page_size, BLOCK_UNITS=max(1, _GATHER_UNITS // page_size),
    )  # fmt: skip


def gather_selected_slots_ref(
    kv: KVView, selected: torch.Tensor, num_selected: torch.Tensor, page_size: int
) -> list[torch.Tensor]:
    """Torch oracle of gather_selected_slots: each request's slots, in order."""
    offsets = torch.arange(page_size, device=selected.device)
    slots = []
    for b, (req, seq_len, count) in enumerate(
        zip(kv.rows.tolist(), kv.lengths.tolist(), num_selected.tolist())
    ):
        positions = (selected[b, :count, None].long() * page_size + offsets).flatten()
        slots.append(kv.table[req, positions[positions < seq_len]])
    return slots


class SlotTable:
    """The KV slots of a step's current selection, owned up front: ``gather`` after each
    selection layer, ``attend`` at the sparse layers that follow it. Given ``heads`` (query heads,
    KV heads, head size) it owns its attention's split-KV scratch too, sized for ``max_batch``
    (decode then allocates nothing); without, each ``attend`` allocates it (one-off calls)."""

    def __init__(self, max_batch: int, max_entries: int, device, heads=None, share=None):
        if share is None:
            self.slots = torch.zeros(max_batch, max_entries, dtype=torch.int32, device=device)
            self.count = torch.zeros(max_batch, dtype=torch.int32, device=device)
        else:  # its rows of a SharedSlotTables storage
            self.slots, self.count = share.take(max_entries)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        # A selection is short next to a whole cache: fewer, longer splits read it faster.
        self.workspace = None if heads is None else SplitKVWorkspace(
            max_batch, *heads, max_entries, device, programs_per_sm=SHORT_LIST_PROGRAMS_PER_SM
        )  # fmt: skip

    def gather(self, kv: KVView, selected, num_selected, page_size: int) -> None:
        """The slots of ``kv``'s batch's selection (``gather_selected_slots``)."""
        gather_selected_slots(kv, selected, num_selected, page_size, self.slots, self.count)

    def attend(self, q, kv: KVView, sm_scale: float, out=None) -> torch.Tensor:
        """Attention of q [batch, q_heads, dim] over the gathered selection of ``kv``'s buffers."""
        return self.attend_with_lse(q, kv, sm_scale, out=out)[0]

    def attend_with_lse(self, q, kv: KVView, sm_scale: float, out=None, logits=None):
        """``attend``'s (out, lse); ``logits`` ([>= batch, q_heads, >= entries] fp32) receives
        each gathered entry's scaled q·k, by its index in the table."""
        batch, entries = q.shape[0], self.slots.shape[1]
        if self.workspace is None:
            kv_heads = kv.k.shape[1]
            splits = num_kv_splits_for(
                batch, kv_heads, entries, q.device, SHORT_LIST_PROGRAMS_PER_SM
            )
        else:
            splits = self.workspace.splits[batch]
        return split_kv_decode(
            q, kv.through(self.slots, self.rows[:batch], self.count[:batch]), sm_scale,
            num_kv_splits=None if self.workspace else splits, workspace=self.workspace, out=out,
            launch=selected_launch(entries, splits),
            logits=None if logits is None else logits[:batch],
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TableRead:
    """A layer whose decode is only attention over its reader's table of a SharedSlotTables (its
    K/V stored first): ``logits`` [max batch, q heads, >= longest list] fp32 where the reader
    keeps each entry's scaled q·k, ``after(lse, batch)`` its work on the call's LSE."""

    logits: torch.Tensor | None = None
    after: Callable[[torch.Tensor, int], None] | None = None


class TableShare:
    """One reader's table in a SharedSlotTables: ``take(width)`` gives its ``slots`` [max batch,
    width] and ``count``, indexed by batch entry like a SlotTable's, which hold the shared storage
    once the owner has allocated it (``SharedSlotTables.allocate``: before any decode)."""

    def __init__(self, device):
        self.width = 0  # none taken
        self.slots = torch.empty(0, dtype=torch.int32, device=device)
        self.count = torch.empty(0, dtype=torch.int32, device=device)

    def take(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.width = width
        return self.slots, self.count


class SharedSlotTables:
    """The slot tables of several readers (``shares``, a policy mix's members) in one storage, as
    wide as the widest: ``allocate``, after every reader has taken its share, binds each taken
    share's tensors to its rows. ``route`` points each batch entry at its reader's row once per
    step, ``attend`` reads every entry from its own reader's table in one split-KV call (an
    entry of a reader without a table reads nothing), with scratch it owns for ``heads`` (query
    heads, KV heads, head size)."""

    def __init__(self, readers: int, max_batch: int, device, heads: tuple[int, int, int]):
        self.max_batch, self.device, self.heads = max_batch, torch.device(device), heads
        self.shares = [TableShare(device) for _ in range(readers)]
        self.rows = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._entries = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._first_row = None  # [readers] int64: each reader's first row (past the end: none)
        self._slots = self._count = self.workspace = None

    def allocate(self) -> None:
        taken = [share for share in self.shares if share.width > 0]
        if not taken:
            return
        rows, width = len(taken) * self.max_batch, max(share.width for share in taken)
        int32 = {"dtype": torch.int32, "device": self.device}
        self._slots = torch.zeros(rows, width, **int32)
        self._count = torch.zeros(rows + self.max_batch, **int32)  # a last block of zeros
        first = [rows] * len(self.shares)  # a reader without a table: the block of zeros
        at = 0
        for i, share in enumerate(self.shares):
            if share.width > 0:
                share.slots.set_(self._slots[at : at + self.max_batch])
                share.count.set_(self._count[at : at + self.max_batch])
                first[i], at = at, at + self.max_batch
        self._first_row = torch.tensor(first, dtype=torch.int64, device=self.device)
        self.workspace = SplitKVWorkspace(self.max_batch, *self.heads, width, self.device)

    def route(self, reader_of_entry: torch.Tensor) -> None:
        """Batch entry b reads reader ``reader_of_entry[b]``'s table (int64 [batch], on the
        device: no host sync)."""
        batch = reader_of_entry.shape[0]
        torch.add(self._entries[:batch], self._first_row[reader_of_entry], out=self.rows[:batch])

    def attend(self, q, kv: KVView, sm_scale: float, logits=None):
        """(out, lse) of q [batch, q_heads, dim] over each entry's row of its reader's table, in
        ``kv``'s buffers; ``logits`` as split_kv_decode's. Under the whole-cache launch, unlike a
        SlotTable's: a reader's table may be Lethe's retained set, thousands of entries long."""
        batch = q.shape[0]
        return split_kv_decode(
            q, kv.through(self._slots, self.rows[:batch], self._count), sm_scale,
            logits=logits, workspace=self.workspace, lengths_by_row=True,
        )  # fmt: skip


def sparse_decode_attention(
    q: torch.Tensor,
    kv: KVView,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    sm_scale: float,
    page_size: int = 16,
    table: SlotTable | None = None,
) -> torch.Tensor:
    """Attention of q [batch, q_heads, dim] over the selected pages (page_size=16, DELTA) or
    tokens (page_size=1, TidalDecode), as a sparse layer right after its selection layer computes
    it: gathered into ``table`` (a new one by default), then attended over. Returns out [batch,
    q_heads, dim] in q's dtype; the arithmetic is fp32."""
    if table is None:
        table = SlotTable(q.shape[0], selected.shape[1] * page_size, q.device)
    table.gather(kv, selected, num_selected, page_size)
    return table.attend(q, kv, sm_scale)


def sparse_decode_attention_ref(
    q: torch.Tensor,
    kv: KVView,
    selected: torch.Tensor,
    num_selected: torch.Tensor,
    sm_scale: float,
    page_size: int = 16,
) -> torch.Tensor:
    """Torch oracle of sparse_decode_attention (same arguments; fp32, one request at a time)."""
    out = torch.empty_like(q)
    offsets = torch.arange(page_size, device=q.device)
    for b, (req, seq_len, count) in enumerate(
        zip(kv.rows.tolist(), kv.lengths.tolist(), num_selected.tolist())
    ):
        positions = (selected[b, :count, None].long() * page_size + offsets).flatten()
        positions = positions[positions < seq_len]
        out_b, _ = attend_positions_ref(q[b], kv.k, kv.v, kv.table[req, positions].long(), sm_scale)
        out[b] = out_b.to(q.dtype)
    return out
