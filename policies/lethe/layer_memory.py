"""Per-layer KV memory in SGLang's one-slot-per-token pool (Lethe's per-layer lists).

SGLang gives a token one slot, and the slot one row in every layer's K and V buffers. When layers
keep different tokens, a slot freed only once no layer keeps its token makes memory follow the
union of the layers' retained sets. Here a layer's retained entry is instead a *row*: any layer's
row of a slot its request holds (``global row = buffer layer * slots + slot``, the pool's layers
being one buffer: ``sglang_ext.engine.memory``), so after a round the request's kept entries of
all layers are packed into as few of its slots as hold them, ``ceil(sum of the layers' retained
entries / layers)``, and the rest go back to the pool. A layer's decode reads its entries' rows
through the whole-pool view (``pooled_buffers``).

Lists per KV head (``Lethe.per_kv_head``): each (layer, KV head) keeps a list, and an entry
addresses its head of a row, so the heads of one row hold different tokens; a head's entries are
packed into that head of the request's rows, and the request holds the most any head's lists
need, ``max over heads of ceil(sum of that head's lists' entries / layers)``.

Packing moves as little as it can: the slots that already hold the most kept entries stay, and
only entries in the slots given back are copied, into the free rows of the slots that stay, of
their own layer first (source and destination rows never overlap). Radix-owned slots (a shared
prefix) are never packed into, moved out of, or freed.
"""

from __future__ import annotations

import dataclasses

import torch


class PoolLayoutError(RuntimeError):
    """The KV pool's layers are not one buffer, so a row of one is not addressable from another."""


@dataclasses.dataclass(frozen=True)
class PooledBuffers:
    """Every layer's K and V rows as one [layers * slots, heads, dim] view each."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: int  # rows per layer: global row = layer * slots + slot


def pooled_buffers(kv_pool, num_layers: int) -> PooledBuffers:
    """The whole-pool views of ``kv_pool``'s per-layer buffers, which must be consecutive views of
    one tensor each (else PoolLayoutError)."""
    views = []
    for get in (kv_pool.get_key_buffer, kv_pool.get_value_buffer):
        layers = [get(layer) for layer in range(num_layers)]
        first = layers[0]
        size = first.numel() * first.element_size()
        consecutive = all(
            buf.shape == first.shape
            and buf.is_contiguous()
            and buf.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and buf.data_ptr() == first.data_ptr() + layer * size
            for layer, buf in enumerate(layers)
        )
        if not consecutive:
            raise PoolLayoutError(
                "per-layer KV memory needs the KV pool's layers in one buffer "
                "(sglang_ext.engine.memory.layers_in_one_buffer did not allocate this pool)"
            )
        shape = (num_layers * first.shape[0], *first.shape[1:])
        views.append(first.as_strided(shape, first.stride()))
    return PooledBuffers(views[0], views[1], slots=views[0].shape[0] // num_layers)


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packing's outcome for a batch of requests."""

    entries: torch.Tensor  # [requests, layers, n]: each entry's row after the moves
    slots: torch.Tensor  # [requests, positions]: the given-back slots now the hole
    freed: torch.Tensor  # int64: the slots given back, request after request
    freed_counts: list[int]  # per request


def pack_rows(
    buffers: PooledBuffers,
    entries: torch.Tensor,
    stays: torch.Tensor,
    slots: torch.Tensor,
    own: torch.Tensor,
    hole_slot: int,
    columns: int,
    heads: int = 1,
    ranks=None,
) -> Packed:
    """Pack each request's kept entries into as few of its own slots as hold them.

    ``entries`` [requests, lists, n] int32: each list entry's global row, a list per layer, or
    with ``heads`` > 1 a list per (layer, KV head) (list ``layer * heads + head``), whose entries
    address that head of their rows (a row's heads then hold different tokens); ``stays`` (same
    shape, bool): which entries the round keeps; ``slots`` [requests, positions]: each request's
    ``req_to_token`` over the positions its round covers (padded), ``own`` where it may give the
    slot back (inside its round, past its radix prefix, not a hole); ``columns`` bounds the slots
    any request keeps (no layer of it keeps more entries). ``ranks`` (a ``RankGroup``): the
    tensor-parallel ranks, each with its own KV heads' lists; they agree on the slots that stay
    (the entries every rank's heads keep in a slot, the most slots any head needs), as one rank
    with every head would. K/V rows are copied on the device; fixed shapes throughout but for
    one host read (how many entries move, how many slots each request gives back), so a batch
    of requests costs one round's launches."""
    requests, lists, n = entries.shape
    num_layers = lists // heads
    width, device = slots.shape[1], entries.device
    slots = slots.long()
    # each entry's position: a request holds a slot at one position only
    by_slot, order = torch.sort(slots, dim=1)
    rows = entries.long().reshape(requests, -1)
    slot_of = rows % buffers.slots
    found = torch.searchsorted(by_slot, slot_of).clamp(max=width - 1)
    at = order.gather(1, found)
    is_own = stays.view(requests, -1) & (by_slot.gather(1, found) == slot_of) & own.gather(1, at)
    kept_per_slot = torch.zeros_like(slots).scatter_add_(1, at, is_own.long())
    kept_per_head = is_own.view(requests, num_layers, heads, n).sum((1, 3))
    needed = ((kept_per_head + num_layers - 1) // num_layers).amax(1, keepdim=True)
    if ranks is not None:  # one exchange: every rank's entries per slot, and needs
        everyone = ranks.gather(torch.cat([kept_per_slot, needed], 1))
        kept_per_slot, needed = everyone[..., :-1].sum(0), everyone[..., -1:].amax(0)
    # the own slots holding the most kept entries stay, each a column of the rows they offer
    ranked = torch.argsort(torch.where(own, kept_per_slot, -1), dim=1, descending=True, stable=True)
    leading = torch.arange(width, device=device) < needed
    stay_slot = torch.zeros_like(own).scatter_(1, ranked, leading)
    column = torch.cumsum(stay_slot.long(), 1) - 1
    settled, movers = is_own & stay_slot.gather(1, at), is_own & ~stay_slot.gather(1, at)
    # taken[request, head, buffer layer, column]: a row's head holding a kept entry, or no row
    # (past needed)
    taken = torch.zeros(requests, heads, num_layers, columns + 1, dtype=torch.bool, device=device)
    request = torch.arange(requests, device=device)[:, None]
    head_of = (torch.arange(lists * n, device=device) // n % heads).expand_as(rows)
    layer_of = torch.where(settled, rows // buffers.slots, 0)
    column_of = torch.where(settled, column.gather(1, at), columns)
    taken[request, head_of, layer_of, column_of] = True
    taken = taken[..., :columns] | ~(torch.arange(columns, device=device) < needed)[:, None, None]
    by_head = (requests, num_layers, heads, n)
    movers_by_head = movers.view(by_head).transpose(1, 2).reshape(-1, num_layers, n).contiguous()
    targets = _free_rows_for(movers_by_head, taken.view(-1, num_layers, columns))
    targets = targets.view(requests, heads, num_layers, n).transpose(1, 2).reshape(requests, -1)
    movers = movers.view_as(stays)
    slot_at_column = torch.zeros(requests, columns + 1, dtype=torch.int64, device=device)
    slot_at_column.scatter_(1, torch.where(stay_slot, column, columns), slots)
    staying_slot = slot_at_column.gather(1, targets % columns)
    destinations = targets // columns * buffers.slots + staying_slot
    given_back = own & ~stay_slot
    moving, *freed_counts = torch.cat([movers.sum().view(1), given_back.sum(1)]).tolist()
    at_mover = torch.nonzero_static(movers.flatten(), size=moving).squeeze(1)
    sources, into = rows.flatten()[at_mover], destinations.flatten()[at_mover]
    if heads == 1:  # a layer's list holds whole rows
        buffers.keys[into] = buffers.keys[sources]
        buffers.values[into] = buffers.values[sources]
    else:  # a head's list holds that head of its rows
        head = head_of.flatten()[at_mover]
        buffers.keys[into, head] = buffers.keys[sources, head]
        buffers.values[into, head] = buffers.values[sources, head]
    freed = slots.flatten()[torch.nonzero_static(given_back.flatten(), size=sum(freed_counts))]
    return Packed(
        entries=torch.where(movers, destinations.view_as(entries).to(entries.dtype), entries),
        slots=torch.where(given_back, hole_slot, slots),
        freed=freed.squeeze(1),
        freed_counts=freed_counts,
    )


def _free_rows_for(movers: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """A free row (``layer * columns + column`` of ``taken`` [requests, layers, columns], False:
    free) for every mover ([requests, layers, n] bool, by the layer whose list holds it), its
    own layer's rows first: a layer's decode then reads rows of its own buffer, as before the
    round, wherever they suffice (always when the layers keep equally many). The rest take
    their request's rows left over, in order. Meaningful where ``movers``."""
    requests, layers, columns = taken.shape
    free = ~taken
    free_columns = torch.argsort(taken.to(torch.int8), dim=2, stable=True)  # free ones first
    free_count, mover_count = free.sum(2, keepdim=True), movers.sum(2, keepdim=True)
    mover_rank = torch.cumsum(movers.long(), 2) - 1
    at_home = movers & (mover_rank < free_count)
    home_column = free_columns.gather(2, mover_rank.clamp(0, columns - 1))
    layer = torch.arange(layers, device=taken.device)[:, None]
    left = free & (torch.cumsum(free.long(), 2) - 1 >= torch.minimum(mover_count, free_count))
    # each request's rows left over, in order first
    spare = torch.argsort((~left).view(requests, -1).to(torch.int8), dim=1, stable=True)
    away = (movers & ~at_home).view(requests, -1)
    away_rank = (torch.cumsum(away.long(), 1) - 1).clamp(0, layers * columns - 1)
    away_row = spare.gather(1, away_rank).view_as(movers)
    return torch.where(at_home, layer * columns + home_column, away_row)
