"""``EVICTION+SELECTION`` (``lethe+tidal``, ``lethe+delta``, ``snapkv+tidal``, …): one request
under both policies. The evicting policy decides what KV exists: its rounds, freed slots,
admission, memory and reports are its runtime's (``policies.lethe.runtime``). The selecting
policy reads only that retained set: its full-attention layers attend to all of it, its selection
layers attend to all of it and choose among its entries, and its sparse layers read that choice.

The eviction's scores come from the layers that attend to the whole retained set, the selection's
full and selection layers: a sparse layer sees only what was selected, so its attention would
favour that. The other layers keep no scores (nor prefill seeds), and a round ranks tokens by the
scoring layers alone (a layer without scores gives every token a share of 0). A selection layer
runs the eviction's attention, which gives its output and its scores, and the selection's scoring
attention over the same entries.

The eviction keeps one retained set for every layer: gathered into one slot table per step, it is
what each layer reads (per-layer lists are not composed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_ext.policies.base import DecodeContext, DecodeInputs, KVPolicy, PolicyConfigError
from sglang_ext.policies.context import DecodeProgram, RetainedKV
from sglang_ext.policies.lethe.policy import EvictionPolicy
from sglang_ext.policies.lethe.runtime import LetheRuntime
from sglang_ext.policies.runtime import FULL, StepPlan, StepRequest
from sglang_ext.policies.selection import LayerRole, SelectionDecoder, SelectionPolicy

SEPARATOR = "+"


def over_eviction(selection: SelectionPolicy, base: KVPolicy) -> SelectionOverEviction:
    """``selection`` reading what the evicting ``base`` keeps (a selection policy's ``over``)."""
    try:
        eviction = base.one_set()  # an EvictionPolicy's: what one table per step can read
    except AttributeError:
        raise PolicyConfigError(
            "policy", f"{selection.name} composes over an evicting policy, not {base.name}"
        ) from None
    return SelectionOverEviction(eviction=eviction, selection=selection)


@dataclasses.dataclass(frozen=True)
class SelectionOverEviction(KVPolicy):
    """An evicting policy with a selecting one reading what it keeps. A request may opt out to
    full attention; the members' parameters are the server's."""

    eviction: EvictionPolicy
    selection: SelectionPolicy

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.eviction.name}{SEPARATOR}{self.selection.name}"

    def validate(self) -> None:
        self.eviction.one_set()  # raises where its lists are per layer
        if self.selection.cache_correction() is not None:
            raise PolicyConfigError(
                f"{self.name}.{self.selection.name}.correction_interval",
                "cache correction re-fills evicted positions: 0 under eviction",
            )  # fmt: skip

    def request_choices(self) -> dict[str, KVPolicy | None]:
        return {self.name: self, FULL: None}

    def for_model(self, ctx: DecodeContext) -> SelectionOverEviction:
        return dataclasses.replace(self, selection=self.selection.for_model(ctx))

    def runtime(self, ctx: DecodeContext, shared: DecodeInputs | None = None) -> EvictedSelection:
        return EvictedSelection(self, ctx, shared)

    def evicts(self) -> bool:
        return True

    def per_layer_lists(self) -> bool:
        return False

    def server_defaults(self) -> dict[str, str | None]:
        return {**self.selection.server_defaults(), **self.eviction.server_defaults()}

    def request_state_bytes(self, num_layers: int, num_q_heads: int, context_len: int) -> int:
        return self.eviction.request_state_bytes(num_layers, num_q_heads, context_len)

    def budget(self) -> str:
        return f"{self.eviction.budget()}; {self.selection.name}: {self.selection.budget()}"

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        held = self.eviction.attended_tokens(seq_len, num_layers)
        return self.selection.attended_tokens(round(held), num_layers)

    def describe(self) -> dict[str, Any]:
        # as --policy-config gives it: the eviction's parameters, the selection's under its name
        own = [{k: v for k, v in m.describe().items() if k != "name"}
               for m in (self.eviction, self.selection)]  # fmt: skip
        return {"name": self.name, **own[0], self.selection.name: own[1]}

    def schema(self) -> dict[str, Any]:
        return {**self.eviction.schema(), self.selection.name: self.selection.schema()}


class EvictedSelection(LetheRuntime):
    """The eviction's runtime, whose layers are the selection's over the step's retained set."""

    def __init__(self, policy: SelectionOverEviction, ctx, shared: DecodeInputs | None = None):
        # its layers are more than reads of one slot table: under a mix it keeps its own tables
        own = dataclasses.replace(shared or DecodeInputs(), table_share=None)
        roles = policy.selection.layer_roles(ctx.num_layers)
        self.scoring_layers = {i for i, role in enumerate(roles) if role is not LayerRole.SPARSE}
        super().__init__(policy, ctx, own, eviction=policy.eviction)

    def reads_step_table(self) -> bool:
        return True

    def eviction_of(self, own: SelectionOverEviction):
        return own.eviction

    def build_program(self) -> DecodeProgram:
        selection = self.policy.selection
        retained = RetainedKV(
            self.ctx.kv_pool, self._slot_table, self._table_rows, self._entry_count
        )
        rule = selection.selection(self.ctx, retained=retained)
        inputs = dataclasses.replace(self.inputs, retained=retained)
        decoder = SelectionDecoder(self.policy.name, rule, self.ctx, inputs, selection.budget_field)

        def select(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            out = self._decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            decoder.select_decode(q, None, None, layer, forward_batch, save_kv_cache=False)
            return out

        by_role = {
            LayerRole.FULL: self._decode, LayerRole.SELECT: select,
            LayerRole.SPARSE: decoder.sparse_decode,
        }  # fmt: skip
        layers = [by_role[role] for role in selection.layer_roles(self.ctx.num_layers)]
        return DecodeProgram(
            layers, step_setups=decoder.step_setups, reservations=rule.reservations
        )

    def plan_step(self, requests: list[StepRequest], decode: bool) -> StepPlan:
        plan = super().plan_step(requests, decode)
        if not decode:
            return plan
        # its selection scores the entries a request holds, not all its positions: the step's
        # score rows fit what CUDA graphs recorded (sized by the KV pool) while the pool does
        held = sum(r.seq_len - r.state.evicted for r in requests)
        return dataclasses.replace(plan, batch_tokens=held)

    def after_extend(self, q, layer, forward_batch) -> None:
        if layer.layer_id in self.scoring_layers:
            super().after_extend(q, layer, forward_batch)

    def report(self, request: StepRequest, extend: bool):
        report = super().report(request, extend)
        if not request.state.evicts or extend:
            return report
        attended = self.policy.selection.attended_tokens(report.held, self.ctx.num_layers)
        return dataclasses.replace(report, attended=attended)
