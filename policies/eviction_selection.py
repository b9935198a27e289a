"""``EVICTION+SELECTION`` (``lethe+tidal``, ``lethe+delta``, ``snapkv+tidal``, …): one request
under both policies. The evicting policy decides what KV exists: its rounds, freed slots,
admission, memory and reports are its runtime's (``policies.lethe.runtime``). The selecting
policy reads only that retained set: its full-attention layers attend to all of it, its selection
layers attend to all of it and choose among its entries, and its sparse layers read that choice.

Every layer keeps the eviction's scores, as the eviction alone does (prefill seeds included): a
full or selection layer from its attention over the whole retained set, a sparse layer from its
attention over the selection, which every entry's score decays by and the selected entries'
probabilities are added to (``kernels.rasr.accumulate_selected``): an entry left out of the
selection is one the layer would have paid little. Scored by the full and selection layers alone
(a few of the model's), the rounds kept measurably less of what the next steps attend. A
selection layer's one attention over the retained set gives its output, the selection's scores
and the eviction's (``kernels.selection_attention.RetentionUpdate``: its scoring pass adds each
entry's probabilities).

The eviction keeps one retained set for every layer (its ``one_set``): gathered into one slot
table per step, it is what each layer reads (per-layer lists are not composed).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from sglang_ext.kernels import rasr
from sglang_ext.kernels.selection_attention import RetentionUpdate
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

    def request_state_bytes(
        self, num_layers: int, num_q_heads: int, num_kv_heads: int, context_len: int
    ) -> int:
        return self.eviction.request_state_bytes(
            num_layers, num_q_heads, num_kv_heads, context_len
        )

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
            # one attention over the retained set: the layer's output, the selection's scores
            # and the eviction's, whose update its scoring pass makes
            retention = RetentionUpdate(
                self.scores[layer.layer_id], self.state_rows[: q.shape[0]], self.eviction.decay
            )
            return decoder.select_decode(
                q, k, v, layer, forward_batch, save_kv_cache, retention=retention
            )

        sparse = functools.partial(self._decode_selected, decoder)
        by_role = {LayerRole.FULL: self._decode, LayerRole.SELECT: select, LayerRole.SPARSE: sparse}
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

    def _decode_selected(
        self, decoder: SelectionDecoder, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs
    ):  # fmt: skip
        """A sparse layer: attention over the latest selection among the retained entries, and
        the eviction's scores updated from it."""
        if save_kv_cache and k is not None and v is not None:
            self.ctx.write_kv(layer, forward_batch, k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        lid, batch = layer.layer_id, q.shape[0]
        kv = decoder.retained.view(lid)
        selected, num_selected = decoder.selected[:batch], decoder.num_selected[:batch]
        page_size, decay = decoder.rule.page_size, self.eviction.decay
        state_rows = self.state_rows[:batch]
        if decoder.table is None:  # off CUDA: the torch path
            out = rasr.selected_decode_ref(
                q, kv, selected, num_selected, page_size, self.scores[lid], state_rows,
                layer.scaling, decay,
            )  # fmt: skip
            return out.view(batch, -1)
        out, lse = decoder.table.attend_with_lse(q, kv, layer.scaling, logits=self._logits)
        rasr.accumulate_selected(
            self._logits, lse, selected, num_selected, page_size, kv.lengths[:batch], state_rows,
            self.scores[lid], decay,
        )  # fmt: skip
        return out.view(batch, -1)

    def report(self, request: StepRequest, extend: bool):
        report = super().report(request, extend)
        if not request.state.evicts or extend:
            return report
        attended = self.policy.selection.attended_tokens(report.held, self.ctx.num_layers)
        return dataclasses.replace(report, attended=attended)
