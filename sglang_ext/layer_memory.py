"""Per-layer KV memory in SGLang's one-slot-per-token pool (Lethe's per-layer lists).

SGLang gives a token one slot, and the slot one row in every layer's K and V buffers. When layers
keep different tokens, a slot freed only once no layer keeps its token makes memory follow the
union of the layers' retained sets. Here a layer's retained entry is instead a *row*: any layer's
row of a slot its request holds (``global row = buffer layer * slots + slot``, the pool's layers
being one buffer: ``sglang_ext.engine.memory``), so after a round the request's kept entries of
all layers are packed into as few of its slots as hold them, ``ceil(sum of the layers' retained
entries / layers)``, and the rest go back to the pool. A layer's decode reads its entries' rows
through the whole-pool view (``pooled_buffers``).

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


def pack_rows(
    buffers: PooledBuffers,
    entries: torch.Tensor,
    stays: torch.Tensor,
    req_slots: torch.Tensor,
    protected_len: int,
    hole_slot: int,
) -> torch.Tensor:
    """Pack one request's kept entries into as few of its own slots as hold them; returns the
    slots given back (int64).

    ``entries`` [layers, n] int32: each list entry's global row, rewritten in place for the entries
    that move; ``stays`` [layers, n] bool: which entries the round keeps (the others are dropped);
    ``req_slots``: the request's ``req_to_token`` row over the positions the round covers, whose
    given-back slots become ``hole_slot`` in place; its first ``protected_len`` positions are
    radix-owned. K/V rows are copied on the device; a few host reads per round."""
    num_layers = entries.shape[0]
    device = entries.device
    own = req_slots != hole_slot
    own[:protected_len] = False  # radix-owned
    own_at = own.nonzero().squeeze(1)
    own_slots = req_slots[own_at].long()
    if own_slots.numel() == 0:  # everything it holds is radix-owned
        return own_slots
    by_slot, order = torch.sort(own_slots)
    slot_of = entries.long() % buffers.slots
    found = torch.searchsorted(by_slot, slot_of).clamp(max=by_slot.numel() - 1)
    is_own = stays & (by_slot[found] == slot_of)
    own_index = order[found]  # entry -> index into own_slots (meaningful where is_own)
    kept_per_slot = torch.zeros(own_slots.numel(), dtype=torch.int64, device=device)
    kept_per_slot.index_add_(0, own_index[is_own], torch.ones_like(own_index[is_own]))
    needed = -(-int(kept_per_slot.sum()) // num_layers)
    if needed == 0:  # no layer keeps anything of its own slots: all go back
        req_slots[own_at] = hole_slot
        return own_slots
    stay_slot = torch.zeros(own_slots.numel(), dtype=torch.bool, device=device)
    stay_slot[torch.topk(kept_per_slot, needed, sorted=False).indices] = True
    movers = is_own & ~stay_slot[own_index]
    settled = is_own & stay_slot[own_index]
    # rows of the slots that stay, [buffer layer, slot that stays]: which hold a kept entry
    rank = torch.cumsum(stay_slot.long(), 0) - 1
    taken = torch.zeros(num_layers, needed, dtype=torch.bool, device=device)
    taken[entries.long()[settled] // buffers.slots, rank[own_index[settled]]] = True
    targets = _free_rows_for(movers, taken)[movers]
    staying_slots = own_slots[stay_slot]
    sources = entries[movers].long()
    layer, column = targets // needed, targets % needed
    destinations = layer * buffers.slots + staying_slots[column]
    buffers.keys[destinations] = buffers.keys[sources]
    buffers.values[destinations] = buffers.values[sources]
    entries[movers] = destinations.to(entries.dtype)
    req_slots[own_at[~stay_slot]] = hole_slot
    return own_slots[~stay_slot]


def _free_rows_for(movers: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """A free row (``layer * columns + column`` of ``taken`` [layers, columns], False: free) for
    every mover ([layers, n] bool, by the layer whose list holds it), its own layer's rows
    first: a layer's decode then reads rows of its own buffer, as before the round, wherever
    they suffice (always when the layers keep equally many). The rest take the rows left over,
    in order. Meaningful where ``movers``."""
    layers, columns = taken.shape
    free = ~taken
    free_columns = torch.argsort(taken.to(torch.int8), dim=1, stable=True)  # free ones first
    free_count, mover_count = free.sum(1, keepdim=True), movers.sum(1, keepdim=True)
    mover_rank = torch.cumsum(movers.long(), 1) - 1
    at_home = movers & (mover_rank < free_count)
    home_column = free_columns.gather(1, mover_rank.clamp(0, columns - 1))
    layer = torch.arange(layers, device=taken.device)[:, None]
    targets = torch.where(at_home, layer * columns + home_column, 0)
    left = free & (torch.cumsum(free.long(), 1) - 1 >= torch.minimum(mover_count, free_count))
    spare = left.flatten().nonzero().squeeze(1)
    away = movers & ~at_home
    targets[away] = spare[: int(away.sum())]
    return targets
