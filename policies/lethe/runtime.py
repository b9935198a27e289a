"""Lethe inside the engine: per-layer retained lists, pruning rounds, freed slots back to the pool.

It runs any ``EvictionPolicy`` (``policy``: Lethe; ``scorers``: SnapKV, TOVA, H2O), asking the
policy, never its type, for the scores' decay and prefill seed, when rounds run and what they keep.

State, per SGLang request slot (a row of ``req_to_token``) and per list (a layer's, or with
``per_kv_head`` a (layer, KV head)'s: list ``layer * lists_per_layer + head``), on the device:
``positions`` (the retained logical positions, in the order the policy's rounds leave them:
``EvictionPolicy.list_order``), ``count`` and ``scores`` (RASR). A
prefill resets a row to every position it holds; each decode step appends the new token to every
layer's list (once per step, ``prepare_decode``); a layer's decode attention reads only its list
(``kernels.rasr``). Without per-layer lists (``per_layer`` false, or under a selection composed
over Lethe) every layer's list is the same, so on CUDA the step gathers its KV slots once and
every layer attends over that table. With per-layer
lists, memory is per layer (``layer_memory``): every entry also holds its K/V row (``layer_rows``,
a global row of the pool's one buffer), rounds pack a request's kept entries into as few slots as
hold them, and a layer attends over its entries' rows.

Memory: SGLang keeps its own view of a request (``seq_lens``, ``req_to_token``, the true
positions for RoPE) unchanged; a slot freed by a round leaves a hole, ``DecodeContext.padding_slot``
(SGLang's padding slot: never allocated, so a hole is never attended and never a real slot), in
the request's ``req_to_token`` row. The engine adapter (``sglang_ext.engine.memory``) drops holes
when SGLang frees a request, keeps its conservation check exact and its radix cache away from
rows with holes.

Radix cache: a request's first ``protected_len`` positions belong to the radix tree (a prefix
matched at admission, shared); a layer may stop attending to them, but their slots are never
freed under this request.

A round reads its request's lists back to the host (syncs), like SGLang's own retraction does;
decode steps without a round stay free of host syncs and keep their CUDA graph.

Tensor parallelism: each attention-TP rank scores its own query heads, so its ``scores`` are its
share of the request's (prefill seeds are combined over the ranks and stored as a 1/size share).
A round sums the ranks' shares first (``DecodeContext.ranks``): every rank then keeps and frees
the same tokens, as one rank with all the heads would, and checks that it does. With lists per
KV head a rank holds its own heads' lists, whole: nothing is summed, each rank cuts its own, and
the packing agrees on the slots (the ranks' entries per slot summed, the most slots any head
needs), so every rank frees the slots one rank with all the heads would.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Any

import torch

from sglang_ext.kernels import rasr
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.kernels.sparse_decode import TableRead
from sglang_ext.policies.context import DecodeInputs, DecodeProgram
from sglang_ext.policies.lethe.layer_memory import pack_rows, pooled_buffers
from sglang_ext.policies.runtime import (
    EngineOps,
    PolicyRuntime,
    RequestState,
    StepPlan,
    StepRequest,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LetheRequest:
    """What Lethe keeps of one request beyond ``RequestState``."""

    threshold: int  # L_evict: a round runs once the retained KV passes it
    # the retained KV at which its scores are zeroed, so that its next round sees only the
    # queries from there on (EvictionPolicy.observed_steps); None: not before that round
    reset_at: int | None = None
    retained_per_list: list[int] = dataclasses.field(default_factory=list)  # after the last round
    round_length: int = 0  # the positions the last round covered (each step appends one more)


def _longest_list(lethe: LetheRequest, length: int) -> int:
    """The most entries any layer of a request of ``length`` positions holds: its longest list
    after its last round plus every token decoded since (each layer appends each)."""
    if not lethe.retained_per_list:
        return length
    return max(lethe.retained_per_list) + length - lethe.round_length


@dataclasses.dataclass(frozen=True)
class _Extending:
    """The prefill being run, from the host: its requests' rows, lengths and batch positions."""

    rows: list[int]
    seq_lens: list[int]
    indices: list[int]


# A batched round's requests x layers x positions at most: its int64 scratch tensors stay at
# 32 MiB each (18 requests of 8k tokens under 28 layers; one of 128k).
ROUND_ENTRIES = 1 << 22


@dataclasses.dataclass(frozen=True)
class _RoundBatch:
    """Requests of one policy pruned together, and where each may give slots back."""

    policy: Any
    requests: list[StepRequest]
    lengths: list[int]  # the positions each request's round covers
    rows: torch.Tensor  # their req_to_token rows
    slots: torch.Tensor  # [requests, max length]: req_to_token over their rounds (a copy)
    own: torch.Tensor  # bool, as slots: inside its round, past its radix prefix, not a hole

    @classmethod
    def of(cls, policy, members: list[tuple[StepRequest, int]], ctx) -> _RoundBatch:
        requests, lengths = [r for r, _ in members], [n for _, n in members]
        device = ctx.req_to_token.device
        rows = torch.tensor([r.row for r in requests], device=device)
        slots = ctx.req_to_token[rows, : max(lengths)]
        column = torch.arange(slots.shape[1], device=device)
        bounds = torch.tensor([[r.protected_len, n] for r, n in members], device=device)
        own = (column >= bounds[:, :1]) & (column < bounds[:, 1:]) & (slots != ctx.padding_slot)
        return cls(policy, requests, lengths, rows, slots, own)


@dataclasses.dataclass(frozen=True)
class _RoundOutcome:
    stays: torch.Tensor  # [requests, layers, n] bool: the list entries kept
    freed: torch.Tensor  # int64: the slots given back, request after request
    freed_counts: list[int]  # per request
    entries: torch.Tensor | None  # per-layer memory: each entry's row after packing


class LetheRuntime(PolicyRuntime):
    """Lethe's device state for one attention backend, its decode and its rounds. ``eviction``:
    the rule its rounds follow where ``policy`` is more than that rule (a composition)."""

    def __init__(self, policy, ctx, shared: DecodeInputs | None = None, eviction=None):
        self.eviction = policy if eviction is None else eviction
        table_share = None if shared is None else shared.table_share
        rows, cap = ctx.req_to_token.shape
        self.trash_row = rows  # padded batch entries (CUDA graphs) write here, read nothing
        # a list per layer, or per (layer, KV head): list ``layer * lists_per_layer + head``
        self.lists_per_layer = 1
        # under tensor parallelism: the ranks whose scores make one list (a list per layer,
        # scored by every rank's query heads), or that hold lists of their own (per KV head)
        self.summed_ranks, self.list_ranks = ctx.ranks, None
        if self.eviction.per_kv_head_lists():
            self.lists_per_layer = ctx.kv_pool.get_key_buffer(0).shape[1]
            self.summed_ranks, self.list_ranks = None, ctx.ranks
        self.num_lists = ctx.num_layers * self.lists_per_layer
        shape = (self.num_lists, rows + 1, cap)
        self.positions = torch.zeros(shape, dtype=torch.int32, device=ctx.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=ctx.device)
        self.count = torch.zeros(shape[:2], dtype=torch.int32, device=ctx.device)
        self.state_rows = torch.full((ctx.max_batch_size,), rows, dtype=torch.int64, device=ctx.device)
        self._trash = torch.tensor(rows, dtype=torch.int64, device=ctx.device)
        self._lists = torch.arange(self.num_lists, device=ctx.device)[:, None]
        self._arange = torch.arange(cap, dtype=torch.int32, device=ctx.device)
        self._zero_score = torch.zeros((), dtype=torch.float32, device=ctx.device)
        self._logits, self._workspace = None, None  # the kernel's scratch (CUDA only)
        self._slot_table = None  # one list for every layer: its slots, gathered once per step
        self._table_reads: dict[int, TableRead] = {}  # where it reads only a mix's shared table
        if ctx.device.type == "cuda" and ctx.num_q_heads is not None:
            logits_shape = (ctx.max_batch_size, ctx.num_q_heads, cap)
            self._logits = torch.empty(logits_shape, dtype=torch.float32, device=ctx.device)
            self._workspace = ctx.split_workspace(cap)
            if not policy.per_layer_lists():
                self._own_table(ctx, cap, table_share)
        if self._slot_table is None and self.reads_step_table():
            self._own_table(ctx, cap, None)
        self.layer_rows = None  # per-layer memory: each entry's global K/V row
        if policy.pools_layer_rows():
            self.pooled = pooled_buffers(ctx.kv_pool, ctx.num_layers)
            self.layer_rows = torch.zeros(shape, dtype=torch.int32, device=ctx.device)
            layer_of_list = self._lists // self.lists_per_layer
            self._row_offsets = layer_of_list.to(torch.int32) * self.pooled.slots
            self._entry_counts = torch.zeros(
                (self.num_lists, ctx.max_batch_size), dtype=torch.int32, device=ctx.device
            )
            self._layer_tables = [self._layer_table(lid) for lid in range(ctx.num_layers)]
        self._extending = _Extending([], [], [])
        super().__init__(policy, ctx, shared)
        kv_heads = ctx.kv_pool.get_key_buffer(0).shape[1]
        per_slot = self.request_slot_bytes(
            self.eviction, ctx.num_layers, ctx.num_q_heads or 0, kv_heads, cap
        )
        logger.info(
            "sglang_ext: %s state for %d lists x %d request slots x %d positions: %.2f GiB",
            policy.name, self.num_lists, rows, cap, (rows + 1) * per_slot / 2**30,
        )  # fmt: skip

    @staticmethod
    def request_slot_bytes(
        policy, num_layers: int, num_q_heads: int, num_kv_heads: int, width: int
    ) -> int:
        """What ``__init__`` allocates per request slot of ``width`` positions: positions and
        scores per list (and each entry's K/V row with per-layer memory, else the step's slot
        table), and the decode kernel's attention logits per query head (CUDA)."""
        per_entry = 4 + 4 + (4 if policy.pools_layer_rows() else 0)
        lists = num_layers * (num_kv_heads if policy.per_kv_head_lists() else 1)
        own_table = 0 if policy.per_layer_lists() else 4
        return width * (lists * per_entry + own_table + 4 * num_q_heads)

    def build_program(self) -> DecodeProgram:
        return DecodeProgram([self._decode] * self.ctx.num_layers, table_reads=self._table_reads)

    def reads_step_table(self) -> bool:
        """Whether its decode reads the step's retained slots as a table off CUDA too (where
        Lethe's own layers read its lists)."""
        return False

    def eviction_of(self, own):
        """The eviction rule a request decoding under ``own`` (its own parameters) follows."""
        return own

    def _own_table(self, ctx, cap: int, share) -> None:
        """The step's slot table, its own or its share of a mix's (which then attends over it for
        every layer: each layer is only that attention and the scores' update)."""
        if share is None:
            int32 = {"dtype": torch.int32, "device": ctx.device}
            self._slot_table = torch.zeros((ctx.max_batch_size, cap), **int32)
            self._entry_count = torch.zeros(ctx.max_batch_size, **int32)
        else:
            self._slot_table, self._entry_count = share.take(cap)
            for lid in range(ctx.num_layers):
                update = functools.partial(self._update_scores, lid)
                self._table_reads[lid] = TableRead(logits=self._logits, after=update)
        self._table_rows = torch.arange(ctx.max_batch_size, device=ctx.device)

    def _update_scores(self, lid: int, lse: torch.Tensor, batch: int) -> None:
        """RASR's update of layer ``lid`` from a call over the step's table that stored logits."""
        rasr.accumulate(
            self._logits, lse, self._entry_count[:batch], self.state_rows[:batch],
            self.scores[lid], self.eviction.decay,
        )  # fmt: skip

    # requests ---------------------------------------------------------------------------------
    def new_request(self, own, previous: RequestState | None) -> RequestState:
        state = super().new_request(own, previous)
        if own is not None:  # None: it chose full attention, nothing is evicted
            state.policy_state = LetheRequest(threshold=self.eviction_of(own).first_threshold())
        return state

    def admission_tokens(self, state: RequestState | None, total_tokens: int) -> int:
        if state is None or state.policy is None:
            return total_tokens
        return self.eviction_of(state.policy).expected_kv(total_tokens)

    # per step ---------------------------------------------------------------------------------
    def plan_step(self, requests: list[StepRequest], decode: bool) -> StepPlan:
        plan = super().plan_step(requests, decode)
        if not decode:
            return plan
        due = [
            r for r in requests
            if r.state.evicts and r.seq_len - 1 - r.state.evicted > r.state.policy_state.threshold
        ]  # fmt: skip
        return dataclasses.replace(plan, rounds=due)

    def run_plan(self, plan: StepPlan, forward_batch, engine: EngineOps) -> None:
        super().run_plan(plan, forward_batch, engine)
        if not plan.decode:  # its requests only: under a policy mix the batch holds others
            indices = [r.index for r in plan.requests]
            at = torch.tensor(indices, dtype=torch.int64, device=forward_batch.seq_lens.device)
            self.reset_rows(forward_batch.req_pool_indices[at], forward_batch.seq_lens[at])
            self._extending = _Extending(
                [r.row for r in plan.requests], [r.seq_len for r in plan.requests], indices
            )
            return
        self._extending = _Extending([], [], [])  # an extend without a prefill plan seeds nothing
        started = time.perf_counter()
        # over the positions before the token being decoded
        self.prune(plan.rounds, [r.seq_len - 1 for r in plan.rounds], engine)
        self._reset_scores(plan.requests)
        self.stats.seconds += time.perf_counter() - started

    def _reset_scores(self, requests: list[StepRequest]) -> None:
        """Zero the scores of the requests whose next round is to see only the queries from this
        step on (``LetheRequest.reset_at``): a device write before the step's forward."""
        if self.eviction.observed_steps() is None:  # server-wide: none of its requests resets
            return
        due = [
            r for r in requests
            if r.state.evicts and r.state.policy_state.reset_at is not None
            and r.seq_len - 1 - r.state.evicted >= r.state.policy_state.reset_at
        ]  # fmt: skip
        if not due:
            return
        rows = torch.tensor([r.row for r in due], device=self.scores.device)
        self.scores[:, rows] = 0.0
        for request in due:
            request.state.policy_state.reset_at = None

    def prepare_decode(self, forward_batch) -> None:
        """The token being decoded (position seq_len - 1) joins every layer's list; CUDA-graph
        padding (seq_len 1: a real decoding request holds >= 2 tokens) points at the trash row;
        then the program's step setups, which may read the step's table."""
        seq_lens = forward_batch.seq_lens
        batch = seq_lens.shape[0]
        state_rows = self.state_rows[:batch]
        torch.where(seq_lens > 1, forward_batch.req_pool_indices.long(), self._trash, out=state_rows)
        real = state_rows != self.trash_row
        at = torch.where(real, self.count[:, state_rows], 0).long()  # [lists, batch]
        self.positions[self._lists, state_rows, at] = (seq_lens - 1).to(torch.int32)
        # A device zero: a Python scalar would be copied from the host, which CUDA graphs forbid.
        self.scores.index_put_((self._lists, state_rows, at), self._zero_score)
        counts = torch.where(real, at + 1, 0).to(torch.int32)
        self.count[:, state_rows] = counts
        if self.layer_rows is not None:
            new_rows = self._row_offsets + forward_batch.out_cache_loc.to(torch.int32)
            self.layer_rows[self._lists, state_rows, at] = new_rows
            self._entry_counts[:, :batch] = counts
        if self._slot_table is not None:
            on_cuda = self.ctx.device.type == "cuda"
            gather = rasr.gather_retained_slots if on_cuda else rasr.gather_retained_slots_ref
            gather(
                self.ctx.req_to_token, forward_batch.req_pool_indices, self.positions[0],
                self.count[0], state_rows, self._slot_table, self._entry_count,
            )  # fmt: skip
        super().prepare_decode(forward_batch)

    def relieve_memory(self, requests: list[StepRequest], engine: EngineOps) -> int:
        """Rounds now, whatever the thresholds, for each request that holds more than a round
        would leave; ``seq_len`` counts the cached tokens (all in the lists). Slots freed."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()  # the last decode step may still be appending to the lists
        due = [
            r for r in requests
            if r.state.evicts
            and r.seq_len - r.state.evicted - r.protected_len
            > self.eviction_of(r.state.policy).round_cap(r.seq_len)
        ]  # fmt: skip
        before = sum(r.state.evicted for r in due)
        self.prune(due, [r.seq_len for r in due], engine)
        freed = sum(r.state.evicted for r in due) - before
        self.stats.relief_slots += freed
        return freed

    def report(self, request: StepRequest, extend: bool):
        report = super().report(request, extend)
        if not request.state.evicts or extend:
            return report
        lethe = request.state.policy_state
        if self.layer_rows is None or not lethe.retained_per_list:
            return dataclasses.replace(report, attended=float(report.held))
        since = request.seq_len - lethe.round_length  # tokens every list gained since the round
        mean = sum(lethe.retained_per_list) / len(lethe.retained_per_list)
        return dataclasses.replace(report, attended=mean + since)

    def held_per_layer(self, request: StepRequest) -> tuple[int, ...] | None:
        """With lists per KV head, a layer's longest."""
        if self.layer_rows is None or not request.state.evicts:
            return None
        lethe = request.state.policy_state
        if not lethe.retained_per_list:  # no round yet: every layer holds all
            return (request.seq_len,) * self.ctx.num_layers
        since = request.seq_len - lethe.round_length
        per_list = lethe.retained_per_list  # every rank's lists (``_round``)
        heads = len(per_list) // self.ctx.num_layers
        return tuple(max(per_list[i : i + heads]) + since for i in range(0, len(per_list), heads))

    def _decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if save_kv_cache and k is not None and v is not None:
            self.ctx.write_kv(layer, forward_batch, k, v)
        lid = layer.layer_id
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        pool = self.ctx.kv_pool
        if self.layer_rows is not None:
            return self._decode_rows(q, lid, layer.scaling).view(q.shape[0], -1)
        if self._slot_table is not None and q.is_cuda:
            table = (self._slot_table, self._table_rows, self._entry_count)
            out = rasr.shared_retained_decode(
                q, KVView(pool.get_key_buffer(lid), pool.get_value_buffer(lid), *table),
                self.scores[lid], self.state_rows[: q.shape[0]], layer.scaling, self.eviction.decay,
                self._logits, workspace=self._workspace,
            )  # fmt: skip
            return out.view(q.shape[0], -1)
        out = rasr.retained_decode_ref(  # off CUDA: the torch path
            q, KVView.of_layer(pool, lid, self.ctx.req_to_token, forward_batch),
            self.positions[lid], self.count[lid], self.scores[lid], layer.scaling,
            self.eviction.decay, self.state_rows[: q.shape[0]],
        )  # fmt: skip
        return out.view(q.shape[0], -1)

    def _layer_table(self, lid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a layer's lists in the owned state, made once: (each entry's K/V row, the
        entries per batch slot, their scores); with lists per KV head [request slots, KV heads,
        n] views, a table per KV head."""
        if self.lists_per_layer == 1:
            return self.layer_rows[lid], self._entry_counts[lid], self.scores[lid]
        lists = slice(lid * self.lists_per_layer, (lid + 1) * self.lists_per_layer)
        return (
            self.layer_rows[lists].transpose(0, 1),
            self._entry_counts[lists].T,
            self.scores[lists].transpose(0, 1),
        )

    def _decode_rows(self, q, lid: int, scaling: float):
        """Per-layer memory: each entry attends over its layer's entries' rows (each KV head over
        its own list's, with lists per KV head)."""
        state_rows = self.state_rows[: q.shape[0]]
        rows, counts, scores = self._layer_tables[lid]
        kv = KVView(self.pooled.keys, self.pooled.values, rows, state_rows, counts)
        if q.is_cuda:
            return rasr.shared_retained_decode(
                q, kv, scores, state_rows, scaling, self.eviction.decay, self._logits,
                workspace=self._workspace,
            )  # fmt: skip
        return rasr.shared_retained_decode_ref(
            q, kv, scores, state_rows, scaling, self.eviction.decay
        )

    def reset_rows(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A prefill: each row retains every position it holds, with zero scores, each layer's
        entries at their own layer's rows of the request's slots."""
        rows = req_pool_indices.long()
        self.positions[:, rows] = self._arange
        self.scores[:, rows] = 0.0
        self.count[:, rows] = seq_lens.to(torch.int32)
        if self.layer_rows is not None:
            slots = self.ctx.req_to_token[rows]
            self.layer_rows[:, rows] = slots[None] + self._row_offsets[:, :, None]

    def after_extend(self, q, layer, forward_batch) -> None:
        """Seed a prefilled request's scores in this layer: the attention its last
        ``seed_window()`` prompt tokens pay to each of its tokens, summed over heads and those
        queries (Eq. 2), then the policy's ``seed`` (Lethe's pools over neighbours). Its rows were
        reset to every position before the forward; the rows and lengths come from the host
        (``_extending``, once per batch). Under tensor parallelism the batch's sums are combined
        across the ranks in one exchange per layer, before the ``seed``, and stored as this
        rank's 1/size share; with lists per KV head a rank's own heads make its seeds whole."""
        window = self.eviction.seed_window()
        if window == 0 or forward_batch.extend_seq_lens_cpu is None or not self._extending.rows:
            return
        lid, ranks = layer.layer_id, self.summed_ranks
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_buffer = self.ctx.kv_pool.get_key_buffer(lid)
        extend_lens = forward_batch.extend_seq_lens_cpu
        ends = list(itertools.accumulate(extend_lens))
        extending = [
            (row, seq_len, extend_lens[i], ends[i])
            for row, seq_len, i in zip(*dataclasses.astuple(self._extending), strict=True)
        ]
        sums = []
        for row, seq_len, extend_len, end in extending:
            queries = q[end - min(window, extend_len) : end]
            slots = self.ctx.req_to_token[row, :seq_len].long()
            sums.append(rasr.window_scores(
                queries, k_buffer[slots], seq_len, layer.scaling, self.lists_per_layer > 1
            ))  # fmt: skip
        if ranks is not None:
            sums = ranks.sum(torch.cat(sums)).split([seq_len for _, seq_len, _, _ in extending])
        lists = slice(lid * self.lists_per_layer, (lid + 1) * self.lists_per_layer)
        for (row, seq_len, _, _), received in zip(extending, sums, strict=True):
            seed = self.eviction.seed(received)
            self.scores[lists, row, :seq_len] = seed if ranks is None else seed / ranks.size

    def prune(self, requests: list[StepRequest], lengths: list[int], engine: EngineOps) -> None:
        """A pruning round of each request, request i over its first ``lengths[i]`` positions:
        the requests of one policy (the same parameters) together, as many at a time as
        ``ROUND_ENTRIES`` allows, every layer of each at once on the device
        (``Lethe.shrink_layers``, then ``_free_union`` or ``_pack_layers``), with three host reads
        per batch (the lists' lengths, the slots freed, the outcome): a batch costs one round's
        launches."""
        by_policy: dict = {}
        for request, length in zip(requests, lengths, strict=True):
            rule = self.eviction_of(request.state.policy)
            by_policy.setdefault(rule, []).append((request, length))
        for policy, members in by_policy.items():
            batch: list = []
            widest = 0
            for request, length in members:
                # a round's [requests, layers, n] tensors span its longest list, not its length
                longest = _longest_list(request.state.policy_state, length)
                entries = (len(batch) + 1) * max(widest, longest) * self.num_lists
                if batch and entries > ROUND_ENTRIES:
                    self._round(_RoundBatch.of(policy, batch, self.ctx), engine)
                    batch, widest = [], 0
                batch.append((request, length))
                widest = max(widest, longest)
            if batch:
                self._round(_RoundBatch.of(policy, batch, self.ctx), engine)

    def _round(self, batch: _RoundBatch, engine: EngineOps) -> None:
        own, rows, ranks = batch.policy, batch.rows, self.summed_ranks
        counts = self.count[:, rows].T.tolist()  # [requests][layers]
        n = max(max(layer_counts) for layer_counts in counts)
        positions = self.positions[:, rows, :n].transpose(0, 1)  # [requests, layers, n]
        scores = self.scores[:, rows, :n].transpose(0, 1)
        combined = scores if ranks is None else ranks.sum(scores)  # over every rank's heads
        combined = own.round_scores(combined, counts)
        keep, found, salient_plus_recent = own.shrink_layers(
            positions.flatten(0, 1), combined.flatten(0, 1), sum(counts, [])
        )
        packs = self.layer_rows is not None and own.pack_layers
        free = self._pack_layers if packs else self._free_union
        outcome = free(batch, positions, combined, keep.view(positions.shape))
        order = own.list_order(outcome.stays, combined, counts)
        self.positions[:, rows, :n] = positions.gather(2, order).transpose(0, 1)
        if own.observed_steps() is None:
            self.scores[:, rows, :n] = scores.gather(2, order).transpose(0, 1)
        else:  # its next round sees only the queries after this one
            self.scores[:, rows] = 0.0
        if self.layer_rows is not None:
            entries = outcome.entries
            if entries is None:
                entries = self.layer_rows[:, rows, :n].transpose(0, 1)
            self.layer_rows[:, rows, :n] = entries.gather(2, order).transpose(0, 1)
        retained = outcome.stays.sum(2)
        self.count[:, rows] = retained.T.to(torch.int32)
        outcome_by_list = torch.stack(
            [retained, found.view_as(retained).long(), salient_plus_recent.view_as(retained)]
        )
        if self.list_ranks is not None:  # every rank's lists, by layer then KV head
            everyone = self.list_ranks.gather(outcome_by_list)  # [ranks, 3, requests, lists]
            by_layer = everyone.unflatten(3, (self.ctx.num_layers, self.lists_per_layer))
            outcome_by_list = by_layer.permute(1, 2, 3, 0, 4).flatten(2)
        per_list, found, salient_plus_recent = outcome_by_list.tolist()
        available_before = engine.available_slots()
        engine.free_slots(outcome.freed)  # one call: SGLang's free reads its input on the host
        logger.info(
            "sglang_ext: %s rounds of %d requests freed %d slots (available %d -> %d)",
            self.policy.name, len(batch.requests), outcome.freed.numel(), available_before,
            engine.available_slots(),
        )  # fmt: skip
        members = zip(batch.requests, batch.lengths, outcome.freed_counts, strict=True)
        for i, (request, length, freed) in enumerate(members):
            lists = (per_list[i], found[i], salient_plus_recent[i])
            self._close_round(request, length, freed, *lists)
            logger.info(
                "sglang_ext: %s round %d of %s: %d positions, freed %d slots, retained %d "
                "(radix-owned %d), next threshold %d, retained per list %s",
                self.policy.name, request.state.rounds, request.rid, length, freed,
                length - request.state.evicted, request.protected_len,
                request.state.policy_state.threshold, per_list[i],
            )  # fmt: skip

    def _close_round(
        self, request, length: int, freed: int, retained_per_list, found, salient_plus_recent
    ) -> None:
        """A request's host state after its round: what it freed and keeps, its next threshold
        (from each layer's breakpoint, where it found one)."""
        state, lethe = request.state, request.state.policy_state
        rule = self.eviction_of(state.policy)
        breakpoints = [s if f else None for f, s in zip(found, salient_plus_recent, strict=True)]
        state.evicted += freed
        state.rounds += 1
        lethe.retained_per_list, lethe.round_length = retained_per_list, length
        retained = length - state.evicted
        lethe.threshold = rule.next_threshold(lethe.threshold, breakpoints, retained, length)
        # the last ``observed`` queries before the next round: from this retained KV on
        observed = rule.observed_steps()
        reset_at = None if observed is None else lethe.threshold + 1 - observed
        lethe.reset_at = reset_at if reset_at is not None and reset_at > retained else None
        self.stats.rounds += 1
        self.stats.freed_slots += freed

    def _free_union(self, batch: _RoundBatch, positions, scores, keep) -> _RoundOutcome:
        """One retained set per request, capped (``cap_union_layers``): a slot goes back once no
        layer keeps its token, leaving a hole."""
        own, ranks = batch.policy, self.summed_ranks
        kept_by_any = own.cap_union_layers(positions, scores, keep, batch.lengths)
        if ranks is not None:
            ranks.agree(kept_by_any.to(torch.int32), "the tokens a round's requests keep")
        freeable = batch.own & ~kept_by_any
        counts = freeable.sum(1).tolist()
        at = torch.nonzero_static(freeable.flatten(), size=sum(counts)).squeeze(1)
        freed = batch.slots.flatten()[at].to(torch.int64)
        holes = torch.where(freeable, self.ctx.padding_slot, batch.slots)
        self.ctx.req_to_token[batch.rows, : holes.shape[1]] = holes
        last = batch.own.new_tensor(batch.lengths, dtype=torch.int64)[:, None, None] - 1
        at_position = torch.minimum(positions.long(), last).flatten(1)
        stays = keep & kept_by_any.gather(1, at_position).view_as(keep)
        return _RoundOutcome(stays, freed, counts, entries=None)

    def _pack_layers(self, batch: _RoundBatch, positions, scores, keep) -> _RoundOutcome:
        """Per-layer memory: each layer's list capped (``cap_layers``), the kept entries of all
        layers packed into as few of each request's slots as hold them (``pack_rows``)."""
        own, ranks = batch.policy, self.summed_ranks
        layers = keep.shape[1]
        row_lengths = [length for length in batch.lengths for _ in range(layers)]
        first = [request.state.rounds == 0 for request in batch.requests]
        across = None if self.list_ranks is None else self.list_ranks.max
        shared = own.shared_entries(positions, scores, keep, batch.lengths, first, across)
        flat = (t.flatten(0, 1) for t in (positions, scores, keep))
        shared = None if shared is None else shared.flatten(0, 1)
        stays = own.cap_layers(*flat, row_lengths, shared).view_as(keep)
        if ranks is not None:
            ranks.agree(stays.to(torch.int32), "the entries a round's requests keep")
        entries = self.layer_rows[:, batch.rows, : keep.shape[2]].transpose(0, 1)
        # no layer keeps more than its cap, or its sink tokens and recent window past a small cap
        most = max(own.round_cap(length) for length in batch.lengths) + own.sink_tokens
        packed = pack_rows(
            self.pooled, entries, stays, batch.slots, batch.own, self.ctx.padding_slot,
            columns=min(most, batch.slots.shape[1]), heads=self.lists_per_layer,
            ranks=self.list_ranks,
        )  # fmt: skip
        if self.list_ranks is not None:
            self.list_ranks.agree(packed.slots, "the slots a round's requests keep")
        self.ctx.req_to_token[batch.rows, : packed.slots.shape[1]] = packed.slots.to(torch.int32)
        return _RoundOutcome(stays, packed.freed, packed.freed_counts, packed.entries)
