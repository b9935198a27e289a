"""A server of several policies (``--policy lethe,delta,tidal,full``): each request decodes under
the one it names (``custom_params.kv_policy.name``, the first by default), with its own
parameters, and requests of different policies share one decode batch and its CUDA graph.

Each member policy keeps its own runtime (its decode functions, buffers, request state and
rounds), built on the backend's context with what the mix shares (``DecodeInputs``). A decode
step gives every member a view of the whole batch in which the other members' requests are one
token long (``MemberView``): its kernels run once over the batch, read, score and select almost nothing for
those rows, and its output for them is dropped. Per layer the members' outputs are merged by each
row's member (masks made once per step on the device; no host sync); members that run the
engine's own full attention at a layer share one call of it, with the real batch, reading only
their rows where the engine can (``DecodeContext.base_decode_rows``: fa3), else every row. On
CUDA, members that read only a slot table at a layer (Lethe's retained set, DELTA's and Tidal's
sparse layers) keep their tables in one storage (``SharedSlotTables``), and one split-KV call
reads each row from its own member's table there. So a row reads what it reads under its own
policy; the mix adds, where members differ otherwise, each member's launches over the whole batch
and a merge per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.kernels.sparse_decode import SharedSlotTables
from sglang_ext.policies.base import (
    DecodeContext,
    DecodeFn,
    DecodeInputs,
    KVPolicy,
    PolicyConfigError,
)
from sglang_ext.policies.runtime import (
    EngineOps,
    PolicyRuntime,
    RequestReport,
    RequestState,
    RuntimeStats,
    StepPlan,
    StepRequest,
)

SEPARATOR = ","


@dataclasses.dataclass(frozen=True)
class PolicyMix(KVPolicy):
    """Several policies served together; the first is a request's default."""

    members: tuple[KVPolicy, ...]

    @property
    def name(self) -> str:  # type: ignore[override]
        return SEPARATOR.join(m.name for m in self.members)

    def validate(self) -> None:
        names = [m.name for m in self.members]
        if len(names) < 2:
            raise PolicyConfigError("policy", "a mix lists at least two policies")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise PolicyConfigError("policy", f"lists {', '.join(repeated)} twice")

    def request_choices(self) -> dict[str, KVPolicy | None]:
        return {m.name: m for m in self.members}

    def for_model(self, ctx: DecodeContext) -> PolicyMix:
        return dataclasses.replace(self, members=tuple(m.for_model(ctx) for m in self.members))

    def runtime(self, ctx: DecodeContext, shared: DecodeInputs | None = None) -> MixRuntime:
        if shared is not None:
            raise PolicyConfigError("policy", "a policy mix is not a member of another")
        return MixRuntime(self, ctx)

    def evicts(self) -> bool:
        return any(m.evicts() for m in self.members)

    def reads_tiles(self) -> bool:
        return any(m.reads_tiles() for m in self.members)

    def pools_layer_rows(self) -> bool:
        return any(m.pools_layer_rows() for m in self.members)

    def server_defaults(self) -> dict[str, str | None]:
        defaults: dict[str, str | None] = {}
        for member in self.members:
            defaults.update(member.server_defaults())
        return defaults

    def request_state_bytes(
        self, num_layers: int, num_q_heads: int, num_kv_heads: int, context_len: int
    ) -> int:
        # each member's runtime owns its own state
        heads = (num_q_heads, num_kv_heads)
        return sum(m.request_state_bytes(num_layers, *heads, context_len) for m in self.members)

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        # a batch whose requests name the members in turn (the benchmarks' mixed batches); each
        # request's report counts its own member's
        counts = [m.attended_tokens(seq_len, num_layers) for m in self.members]
        return sum(counts) / len(counts)

    def budget(self) -> str:
        return "; ".join(f"{m.name}: {m.budget()}" for m in self.members if m.budget())

    def schema(self) -> dict[str, Any]:
        return {m.name: m.schema() for m in self.members}

    def describe(self) -> dict[str, Any]:
        own = {m.name: {k: v for k, v in m.describe().items() if k != "name"} for m in self.members}
        return {"name": self.name, **own}


def build_mix(name: str, params: dict[str, Any], build) -> PolicyMix:
    """``A,B,...`` from its parameters: each member's under its name."""
    names = name.split(SEPARATOR)
    unknown = [key for key in params if key not in names]
    if unknown:
        raise PolicyConfigError(unknown[0], f"not a policy of {name}: a mix's parameters go "
                                "under each policy's name", names)  # fmt: skip
    members = []
    for member in names:
        own = params.get(member, {})
        if not isinstance(own, dict):
            raise PolicyConfigError(member, f"expected an object of {member}'s parameters")
        members.append(build(member, own))
    return PolicyMix(members=tuple(members))


class MemberView:
    """A decode batch as one member of a mix sees it: its own rows as they are, every other row
    one token long, on the device and on the host (None where the host's lengths are unknown);
    everything else is the batch's."""

    __slots__ = ("_batch", "seq_lens", "seq_lens_cpu")

    def __init__(self, batch, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor | None):
        self._batch, self.seq_lens, self.seq_lens_cpu = batch, seq_lens, seq_lens_cpu

    def __getattr__(self, name: str):
        return getattr(self._batch, name)


@dataclasses.dataclass(frozen=True)
class MixPlan(StepPlan):
    parts: tuple[StepPlan, ...] = ()  # each member's plan for its own requests


@dataclasses.dataclass(frozen=True)
class _LayerGroup:
    decode: DecodeFn
    members: tuple[int, ...]
    engine_full: bool  # the engine's own full attention: called with the real batch
    mask: int  # row of MixRuntime.group_masks: the rows whose output this call gives
    tables: bool = False  # one call over the members' slot tables: called with the real batch


class MixRuntime(PolicyRuntime):
    """The members' runtimes in one attention backend, each request routed to its member's."""

    def __init__(self, policy: PolicyMix, ctx: DecodeContext):
        self.policy, self.ctx = policy, ctx
        self.index = {m.name: i for i, m in enumerate(policy.members)}
        heads = ctx.head_shape()  # None off CUDA: the members read no slot tables there
        self.tables = None if heads is None else SharedSlotTables(
            len(policy.members), ctx.max_batch_size, ctx.device, heads
        )  # fmt: skip
        shares = [None] * len(policy.members) if heads is None else self.tables.shares
        # one counter of ART's tiles for all the members that read through it (metrics)
        self.tile_counts = (
            torch.zeros(2, dtype=torch.int64, device=ctx.device) if policy.reads_tiles() else None
        )
        self.members = [
            m.runtime(ctx, DecodeInputs(tile_counts=self.tile_counts, table_share=share))
            for m, share in zip(policy.members, shares, strict=True)
        ]
        if self.tables is not None:
            self.tables.allocate()
        rows = ctx.req_to_token.shape[0]
        # each request slot's member, written at its prefill; read per step on the device
        self.member_of_slot = torch.zeros(rows, dtype=torch.int64, device=ctx.device)
        self._member_ids = torch.arange(len(self.members), device=ctx.device)[:, None]
        self.member_masks = torch.zeros(
            len(self.members), ctx.max_batch_size, dtype=torch.bool, device=ctx.device
        )
        self._one = torch.ones((), dtype=torch.int64, device=ctx.device)
        self._member_seq_lens = {  # SGLang's seq_lens are int64, int32 in some graph runners
            dtype: torch.ones(len(self.members), ctx.max_batch_size, dtype=dtype, device=ctx.device)
            for dtype in (torch.int64, torch.int32)
        }
        self._views: list[MemberView] = []
        self._host_members: torch.Tensor | None = None  # each row's member, this decode step
        self._prefilling: list[int] = []  # members whose prefill plan runs now
        self.graphable = True
        unions: list[tuple[int, ...]] = []
        self.layers = [self._layer_groups(layer, unions) for layer in range(ctx.num_layers)]
        self.group_masks = torch.zeros(
            len(unions), ctx.max_batch_size, dtype=torch.bool, device=ctx.device
        )
        self._unions = [torch.tensor(ids, device=ctx.device) for ids in unions]
        self._rows_decodes: dict[int, Any] = {}  # union -> the engine's decode of its rows
        self.decode_fns = [self._layer_decode(groups) for groups in self.layers]
        self._reads_tables = any(g.tables for groups in self.layers for g in groups)

    def _layer_groups(self, layer: int, unions: list) -> list[_LayerGroup]:
        groups = []
        by_fn: dict[int, list[int]] = {}
        fns = [member.decode_fns[layer] for member in self.members]
        readers = self._table_readers(layer)
        if readers:
            reads = [self.members[i].table_reads[layer] for i in readers]
            decode = self._tables_decode(reads)
            groups.append(_LayerGroup(decode, readers, engine_full=False, mask=-1, tables=True))
        for i, fn in enumerate(fns):
            if i not in readers:
                by_fn.setdefault(id(fn), []).append(i)
        for ids in by_fn.values():
            engine_full = fns[ids[0]] is self.ctx.base_decode
            groups.append(_LayerGroup(fns[ids[0]], tuple(ids), engine_full, mask=-1))
        for i, group in enumerate(groups):  # each group's mask: the union of its members' rows
            if group.members not in unions:
                unions.append(group.members)
            groups[i] = dataclasses.replace(group, mask=unions.index(group.members))
        # the engine's own attention first: it stores the new token's K/V as on its own
        return sorted(groups, key=lambda g: not g.engine_full)

    def _table_readers(self, layer: int) -> tuple[int, ...]:
        """The members that read only their slot tables at ``layer``, where one call reads them
        all: two or more, at most one of them keeping logits (the call stores one kind)."""
        readers = tuple(i for i, m in enumerate(self.members) if layer in m.table_reads)
        scoring = [i for i in readers if self.members[i].table_reads[layer].logits is not None]
        return readers if len(readers) >= 2 and len(scoring) <= 1 else ()

    def _tables_decode(self, reads) -> DecodeFn:
        """One split-KV call over the members' slot tables, each row reading its own member's
        (SharedSlotTables.route, per step); then each member's work on its LSE."""
        tables, write_kv, pool = self.tables, self.ctx.write_kv, self.ctx.kv_pool
        logits = next((read.logits for read in reads if read.logits is not None), None)
        afters = [read.after for read in reads if read.after is not None]

        def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if save_kv_cache and k is not None and v is not None:
                write_kv(layer, forward_batch, k, v)
            q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            batch, lid = q.shape[0], layer.layer_id
            out, lse = tables.attend(
                q, KVView.of_layer(pool, lid, self.ctx.req_to_token, forward_batch),
                layer.scaling, logits=None if logits is None else logits[:batch],
            )  # fmt: skip
            for after in afters:
                after(lse, batch)
            return out.view(batch, -1)

        return decode

    def _layer_decode(self, groups: list[_LayerGroup]) -> DecodeFn:
        if len(groups) == 1 and groups[0].engine_full:
            return groups[0].decode

        calls = [(self._group_decode(group), group) for group in groups]

        def decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            out = None
            for group_decode, group in calls:
                whole = group.engine_full or group.tables
                view = forward_batch if whole else self._views[group.members[0]]
                part = group_decode(q, k, v, layer, view, save_kv_cache and out is None, **kwargs)
                if out is None:  # a fresh tensor of the first call's: the others merge into it
                    out = part
                else:
                    mask = self.group_masks[group.mask, : out.shape[0], None]
                    torch.where(mask, part, out, out=out)
            return out

        return decode

    def _group_decode(self, group: _LayerGroup) -> DecodeFn:
        rows_decode = self.ctx.base_decode_rows
        if not group.engine_full or rows_decode is None:
            return group.decode
        if group.mask not in self._rows_decodes:  # one per union: its lengths are made per layer
            self._rows_decodes[group.mask] = rows_decode(self.group_masks[group.mask])
        return self._rows_decodes[group.mask]

    @property
    def stats(self) -> RuntimeStats:
        summed = RuntimeStats()
        for member in self.members:
            for field in dataclasses.fields(RuntimeStats):
                value = getattr(summed, field.name) + getattr(member.stats, field.name)
                setattr(summed, field.name, value)
        return summed

    # requests ---------------------------------------------------------------------------------
    def member_of(self, state_or_policy) -> PolicyRuntime:
        policy = getattr(state_or_policy, "policy", state_or_policy)
        return self.members[self.index[policy.name]]

    def new_request(self, own: KVPolicy | None, previous: RequestState | None) -> RequestState:
        return self.member_of(own).new_request(own, previous)

    def admission_tokens(self, state: RequestState | None, total_tokens: int) -> int:
        if state is None:
            return total_tokens
        return self.member_of(state).admission_tokens(state, total_tokens)

    # per step ---------------------------------------------------------------------------------
    def _by_member(self, requests: list[StepRequest]) -> list[list[StepRequest]]:
        split: list[list[StepRequest]] = [[] for _ in self.members]
        for request in requests:
            split[self.index[request.state.policy.name]].append(request)
        return split

    def plan_step(self, requests: list[StepRequest], decode: bool) -> StepPlan:
        plans = [
            member.plan_step(own, decode)
            for member, own in zip(self.members, self._by_member(requests), strict=True)
        ]
        rounds = [r for plan in plans for r in plan.rounds]
        return MixPlan(decode, requests, rounds=rounds, parts=tuple(plans))

    def run_plan(self, plan: MixPlan, forward_batch, engine: EngineOps) -> None:
        plans = plan.parts
        self._prefilling = [] if plan.decode else [i for i, p in enumerate(plans) if p.requests]
        self._host_members = None
        if plan.decode:
            self._host_members = torch.empty(len(plan.requests), dtype=torch.int64)
            for request in plan.requests:
                self._host_members[request.index] = self.index[request.state.policy.name]
        if not plan.decode and plan.requests:
            rows = torch.tensor([r.row for r in plan.requests], dtype=torch.int64)
            ids = torch.tensor([self.index[r.state.policy.name] for r in plan.requests])
            self.member_of_slot[rows.to(self.ctx.device)] = ids.to(self.ctx.device)
        for member, own in zip(self.members, plans, strict=True):
            member.run_plan(own, forward_batch, engine)
        self.graphable = all(member.graphable for member in self.members)

    def prepare_decode(self, forward_batch) -> None:
        batch = forward_batch.seq_lens.shape[0]
        masks = self.member_masks[:, :batch]
        member = self.member_of_slot[forward_batch.req_pool_indices.long()]
        torch.eq(member[None, :], self._member_ids, out=masks)
        if self._reads_tables:
            self.tables.route(member)
        for union, ids in enumerate(self._unions):
            torch.any(masks.index_select(0, ids), dim=0, out=self.group_masks[union, :batch])
        seq_lens = self._member_seq_lens[forward_batch.seq_lens.dtype][:, :batch]
        torch.where(masks, forward_batch.seq_lens[None, :], self._one, out=seq_lens)
        host = forward_batch.seq_lens_cpu
        members = self._host_members
        if host is None or members is None or members.shape[0] != batch:
            host_lens = [None] * len(self.members)  # a graph's capture, or no plan this step
        else:
            host_lens = [torch.where(members == i, host, 1) for i in range(len(self.members))]
        self._views = [
            MemberView(forward_batch, seq_lens[i], host_lens[i]) for i in range(len(self.members))
        ]
        for runtime, view in zip(self.members, self._views, strict=True):
            runtime.prepare_decode(view)

    def after_extend(self, q, layer, forward_batch) -> None:
        for i in self._prefilling:
            self.members[i].after_extend(q, layer, forward_batch)

    def relieve_memory(self, requests: list[StepRequest], engine: EngineOps) -> int:
        split = zip(self.members, self._by_member(requests), strict=True)
        return sum(member.relieve_memory(own, engine) for member, own in split)

    # reports ----------------------------------------------------------------------------------
    def report(self, request: StepRequest, extend: bool) -> RequestReport:
        return self.member_of(request.state).report(request, extend)

    def held_per_layer(self, request: StepRequest) -> tuple[int, ...] | None:
        return self.member_of(request.state).held_per_layer(request)
