"""A served policy's life inside one attention backend: the interface the engine adapter drives.

The adapter (``sglang_ext.engine``) calls, in this order:

- ``new_request`` at every prefill of a request (new, next chunk, or retracted and re-run): its
  ``RequestState``, which the adapter keeps for the request;
- ``admission_tokens``: the KV a request is counted at by the scheduler;
- ``plan_step`` once per batch, on the host, from data the scheduler already has (no device sync);
- ``run_plan`` before the batch's forward (a prefill's rows, eviction rounds, cache correction:
  may sync; decode buffers sized for the batch, and ``graphable`` whether a CUDA graph may run
  it);
- ``prepare_decode`` once per decode batch on the device, where CUDA graphs record it;
- the per-layer ``decode_fns`` and, for a prefill, ``after_extend`` of each layer;
- ``report`` of each request after the step (metrics and the per-request report);
- ``relieve_memory`` when the next decode step does not fit, before the scheduler retracts.

Nothing here imports SGLang: requests are seen through ``StepRequest``, the engine through
``EngineOps``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sglang_ext.policies.context import DecodeContext, DecodeFn, DecodeInputs, DecodeProgram
from sglang_ext.policies.request_table import RequestTable, TableRows

if TYPE_CHECKING:
    from sglang_ext.policies.base import KVPolicy

FULL = "full"  # the name a request that opted out of the served policy decodes under

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestState:
    """One request's state under the served policy, from its (latest) prefill on."""

    policy: KVPolicy | None  # the policy it decodes under (its own parameters), None: full attention
    evicted: int = 0  # KV slots freed under it so far
    rounds: int = 0  # eviction rounds run, over the request's life
    corrected_until: int = 0  # positions before it had their K/V re-filled (cache correction)
    policy_state: Any = None  # what the runtime keeps of it beyond these (Lethe's threshold)

    @property
    def evicts(self) -> bool:
        return self.policy_state is not None


# Made per request at every step (with its report) on the scheduler's critical path: slotted,
# not frozen (a frozen __init__ sets field by field, which costs host time there;
# benchmarks.host_step measures it).
@dataclasses.dataclass(slots=True)
class StepRequest:
    """One request of a batch as the scheduler sees it this step (host data; not to be changed)."""

    state: RequestState
    rid: str
    row: int  # request pool row (req_to_token)
    seq_len: int  # tokens it holds, the one being decoded included
    prompt_len: int
    output_ids: Sequence[int]  # generated so far, as known on the host
    protected_len: int  # its first positions owned by the radix cache: never freed under it
    index: int = 0  # its position in the batch (a runtime may see only some of the batch's)


@dataclasses.dataclass(slots=True)
class RequestReport:
    policy: str  # the name it decoded under
    held: int  # KV tokens it holds
    evicted: int  # freed so far
    attended: float  # tokens attended this step, mean over layers


@dataclasses.dataclass
class RuntimeStats:
    rounds: int = 0  # eviction rounds
    freed_slots: int = 0
    relief_slots: int = 0  # of freed_slots, freed because the next decode step did not fit
    seconds: float = 0.0  # host time spent in eviction rounds
    corrections: int = 0  # cache correction extends run


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What ``plan_step`` decided for one batch, for ``run_plan``."""

    decode: bool
    requests: list[StepRequest]
    rounds: list[StepRequest] = dataclasses.field(default_factory=list)  # due for eviction
    correction: Any = None  # sglang_ext.policies.tidal.cache_correction.CorrectionPlan
    # prefill: its requests' rows of the runtime's request table, on the host
    request_rows: TableRows | None = None
    batch_tokens: int = 0  # decode: the tokens its requests hold (a shared prefix per request)


@dataclasses.dataclass(frozen=True)
class EngineOps:
    """What a runtime may ask of the engine while running a plan."""

    free_slots: Callable[[torch.Tensor], None]  # give KV slots back to the pool
    available_slots: Callable[[], int]
    # rerun_extend(plan, decode_batch): forward a CorrectionPlan as an extend (its K/V only)
    rerun_extend: Callable[[Any, Any], None]


class PolicyRuntime:
    """The default lifecycle: stateless decode functions, optional cache correction, per-request
    values written at prefill. Lethe's runtime (``policies.lethe.runtime``) adds eviction."""

    def __init__(self, policy: KVPolicy, ctx: DecodeContext, shared: DecodeInputs | None = None):
        self.policy, self.ctx = policy, ctx
        self.inputs = self.decode_inputs(policy, ctx, shared or DecodeInputs())
        self.request_table = self.inputs.request_table
        self.tile_counts = self.inputs.tile_counts
        program = self.build_program()
        self.decode_fns: list[DecodeFn] = program.layers
        self.step_setups, self.reservations = program.step_setups, program.reservations
        self.table_reads = program.table_reads
        self.stats = RuntimeStats()
        self.plan_correction = policy.cache_correction()
        self.graphable = True  # whether the current decode step may replay a CUDA graph

    @staticmethod
    def decode_inputs(policy: KVPolicy, ctx: DecodeContext, shared: DecodeInputs) -> DecodeInputs:
        """What this runtime owns for its decode: every request slot's row of per-request values
        (the server's until a request's prefill writes its own), ART's tile counters where
        ``shared`` (what a policy mix shares among its members) has none."""
        defaults = policy.request_columns(policy)
        rows = ctx.req_to_token.shape[0]
        table = RequestTable(defaults, rows, ctx.device) if defaults else None
        counts = shared.tile_counts
        if counts is None and policy.reads_tiles():
            counts = torch.zeros(2, dtype=torch.int64, device=ctx.device)
        return dataclasses.replace(shared, request_table=table, tile_counts=counts)

    def build_program(self) -> DecodeProgram:
        """The policy's decode program (``KVPolicy.decode_program``); a runtime that decodes
        itself builds its own."""
        return self.policy.decode_program(self.ctx, self.inputs)

    # requests ---------------------------------------------------------------------------------
    def new_request(self, own: KVPolicy | None, previous: RequestState | None) -> RequestState:
        if previous is None:
            return RequestState(policy=own)
        # a re-run prefill (retraction) recomputes every K/V with full attention
        return RequestState(own, rounds=previous.rounds, corrected_until=previous.corrected_until)

    def admission_tokens(self, state: RequestState | None, total_tokens: int) -> int:
        """KV tokens the scheduler counts a request of ``total_tokens`` (prompt + max new) at."""
        return total_tokens

    # per step ---------------------------------------------------------------------------------
    def plan_step(self, requests: list[StepRequest], decode: bool) -> StepPlan:
        if not decode:
            return StepPlan(False, requests, request_rows=self._request_rows(requests))
        correction = None if self.plan_correction is None else self.plan_correction(requests)
        batch_tokens = sum(r.seq_len for r in requests)
        return StepPlan(True, requests, correction=correction, batch_tokens=batch_tokens)

    def run_plan(self, plan: StepPlan, forward_batch, engine: EngineOps) -> None:
        """Before the batch's forward, outside any CUDA graph."""
        if plan.decode:  # every reservation made, whichever says the graph cannot take the step
            fits = [reserve(plan.batch_tokens) for reserve in self.reservations]
            self.graphable = all(fits)
        if plan.request_rows is not None:  # a prefill: its requests' own decode values
            self.request_table.write(plan.request_rows)
        if plan.correction is not None:
            engine.rerun_extend(plan.correction, forward_batch)
            if self.stats.corrections == 0:
                logger.info(
                    "sglang_ext: first cache correction re-filled %d tokens of %d requests from "
                    "positions %s", plan.correction.num_tokens, len(plan.correction.starts),
                    plan.correction.starts,
                )  # fmt: skip
            self.stats.corrections += 1

    def prepare_decode(self, forward_batch) -> None:
        """Device work once per decode batch, before its layers: static in shape and free of
        host syncs, as CUDA graphs record it (on the graph's padded batch)."""
        for setup in self.step_setups:
            setup(forward_batch)

    def after_extend(self, q, layer, forward_batch) -> None:
        """After a prefill layer's attention (its K/V stored)."""

    def relieve_memory(self, requests: list[StepRequest], engine: EngineOps) -> int:
        """Free KV now because the next decode step does not fit; slots freed."""
        return 0

    # reports ----------------------------------------------------------------------------------
    def report(self, request: StepRequest, extend: bool) -> RequestReport:
        state = request.state
        held = request.seq_len - state.evicted
        if extend or state.policy is None:
            attended = float(request.seq_len)
        else:
            attended = state.policy.attended_tokens(request.seq_len, self.ctx.num_layers)
        name = FULL if state.policy is None else self.policy.name
        return RequestReport(name, held, state.evicted, attended)

    def held_per_layer(self, request: StepRequest) -> tuple[int, ...] | None:
        """The entries each layer's list holds after the step, where layers keep lists of their
        own (Lethe's per-layer memory); None where every layer attends alike. For metrics."""
        return None

    def _request_rows(self, requests: list[StepRequest]) -> TableRows | None:
        if self.request_table is None or not requests:
            return None
        values = [self.policy.request_columns(r.state.policy) for r in requests]
        return self.request_table.plan([r.row for r in requests], values)
