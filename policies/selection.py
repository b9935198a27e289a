"""What DELTA and TidalDecode share: selection layers that attend to the whole cache and choose what
the sparse layers after them read, made anew at every decode step.

A policy lists its full-attention layers and its selection layers; every other layer is sparse and
reads the latest selection. Layer lists left unset come from the model's calibration file
(``python -m sglang_ext.tools.calibrate``), else from the paper's defaults scaled to the model's depth.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import torch
from sglang_ext.kernels.kv_view import KVView
from sglang_ext.kernels.sparse_decode import SlotTable, TableRead, sparse_decode_attention_ref
from sglang_ext.kernels import selection_attention as sa
from sglang_ext.policies.base import (
    DecodeContext,
    DecodeInputs,
    DecodeProgram,
    KVPolicy,
    PolicyConfigError,
)
from sglang_ext.policies.context import RetainedKV
from sglang_ext.policies.calibration import find_calibration

logger = logging.getLogger(__name__)


class LayerRole(str, enum.Enum):
    FULL = "full"  # the engine's full attention
    SELECT = "select"  # full attention, then a new selection
    SPARSE = "sparse"  # attention over the latest selection only


@dataclasses.dataclass(frozen=True)
class Selection:
    """How a policy selects: units of ``page_size`` tokens, ``budget`` of them with the last
    ``num_recent`` always kept; ``attend_and_score`` runs a selection layer's full attention and
    returns (out, token_scores, page_scores or None), making an evicting policy's score update
    where its ``retention`` (a ``kernels.selection_attention.RetentionUpdate``) is given;
    ``choose(token_scores, page_scores, seq_lens, row_budget, out=None)`` returns (selected
    [batch, budget] int32, num_selected [batch] int32), written into ``out`` when given;
    ``row_budget`` ([batch], or None: ``budget`` for all) is each request's own budget."""

    unit: str  # "pages" or "tokens", for logs
    page_size: int
    budget: int
    attend_and_score: Callable[..., tuple]
    choose: Callable[..., tuple]
    num_recent: int = 0  # under ART the selection is importance-ordered, these first
    # what its scoring needs run once per decode step (DecodeProgram's)
    step_setups: tuple[Callable, ...] = ()
    reservations: tuple[Callable[[int], bool], ...] = ()


class SelectionPolicy(KVPolicy):
    """Base of a policy made of full, selection and sparse layers. A subclass declares the fields
    ``full_layers`` and ``<selection_field>`` (list[int] | None) and builds its ``Selection``."""

    selection_field: ClassVar[str]
    budget_field: ClassVar[str]  # how many units are selected
    recent_field: ClassVar[str]  # how many of them are the last ones, always kept
    sink_field: ClassVar[str]  # how many of them are the first ones (attention sinks)
    # a token's score at a selection layer, over the query heads: "probability" (the max of its
    # attention probability) or "qk" (the max of its scaled logit); a field where it is a choice
    score: ClassVar[str]
    budget_unit_tokens: ClassVar[int] = 1  # tokens per selected unit

    def paper_layers(self, num_layers: int) -> tuple[list[int], list[int]]:
        """(full layers, selection layers) from the paper, for a model without calibration."""
        raise NotImplementedError

    def selection(
        self, ctx: DecodeContext, importance_ordered: bool = False, retained: RetainedKV | None = None
    ) -> Selection:  # fmt: skip
        """Its selection rule; ``importance_ordered``: the selection lists its units by score
        (ART reads it so), not by position; ``retained``: it selects among what an evicting
        policy keeps (``EVICTION+SELECTION``), not among each request's tokens."""
        raise NotImplementedError

    @classmethod
    def for_token_budget(cls, tokens: int) -> dict[str, int]:
        """Its parameters for a budget of about ``tokens`` tokens (benchmarks and calibration
        compare the policies at equal budgets)."""
        raise NotImplementedError

    def selecting_layers(self) -> list[int] | None:
        return getattr(self, self.selection_field)

    def sink_units(self) -> int:
        """The first units kept ahead of any scored one: the sinks, as far as the budget beside
        the recent units allows."""
        budget, recent = getattr(self, self.budget_field), getattr(self, self.recent_field)
        return min(getattr(self, self.sink_field), budget - recent)

    def validate_request(self, chosen: SelectionPolicy) -> None:
        budget = getattr(self, self.budget_field)
        if getattr(chosen, self.budget_field) > budget:
            self._error(
                self.budget_field,
                f"at most the server's {budget} (it sizes the selection buffers), "
                f"got {getattr(chosen, self.budget_field)}",
            )

    def request_columns(self, chosen: SelectionPolicy | None) -> dict[str, int | float]:
        return {self.budget_field: getattr(chosen or self, self.budget_field)}

    def validate(self) -> None:
        budget, recent = getattr(self, self.budget_field), getattr(self, self.recent_field)
        if budget < 1:
            self._error(self.budget_field, f"must be >= 1, got {budget}")
        if not 0 <= recent <= budget:
            self._error(
                self.recent_field, f"must be in [0, {self.budget_field}={budget}], got {recent}"
            )
        if getattr(self, self.sink_field) < 0:
            self._error(self.sink_field, f"must be >= 0, got {getattr(self, self.sink_field)}")
        self.validate_layers()

    def validate_layers(self) -> None:
        selecting = self.selecting_layers()
        for field, layers in (("full_layers", self.full_layers), (self.selection_field, selecting)):
            if layers is None:
                continue
            if any(layer < 0 for layer in layers):
                self._error(field, f"layer ids must be >= 0, got {list(layers)}")
            if len(set(layers)) != len(layers):
                self._error(field, f"lists a layer twice: {list(layers)}")
        if selecting is None:
            return
        if not selecting:
            self._error(self.selection_field, "needs at least one selection layer")
        if list(selecting) != sorted(selecting):
            self._error(self.selection_field, f"must be in ascending order, got {list(selecting)}")
        if self.full_layers is None:
            return
        both = sorted(set(self.full_layers) & set(selecting))
        if both:
            self._error("full_layers", f"layers {both} are {self.selection_field} too")
        unselected = sorted(set(range(selecting[0])) - set(self.full_layers))
        if unselected:
            self._error(
                "full_layers",
                f"layers {unselected} come before the first selection layer ({selecting[0]}), "
                "so nothing is selected for them yet: list them here",
            )

    def for_model(self, ctx: DecodeContext) -> SelectionPolicy:
        """This policy with unset layer lists filled in for the served model."""
        if self.full_layers is not None and self.selecting_layers() is not None:
            return self
        found = find_calibration(ctx.model_fingerprint) if ctx.model_fingerprint else None
        if found is not None and self.name in found:
            layers = found[self.name]
            full, selecting = layers["full_layers"], layers[self.selection_field]
            logger.info("sglang_ext: %s layers from calibration %s", self.name, found["path"])
        else:
            full, selecting = self.paper_layers(ctx.num_layers)
        return dataclasses.replace(
            self,
            full_layers=full if self.full_layers is None else self.full_layers,
            **{self.selection_field: self.selecting_layers() or selecting},
        )

    def layer_roles(self, num_layers: int) -> list[LayerRole]:
        """The role of each of the model's layers; a layer id past its depth is an error."""
        if self.full_layers is None or self.selecting_layers() is None:
            raise ValueError("layer_roles needs layer lists: call for_model first")
        for field in ("full_layers", self.selection_field):
            beyond = [layer for layer in getattr(self, field) if layer >= num_layers]
            if beyond:
                self._error(field, f"layers {beyond} are beyond the model's {num_layers} layers")
        roles = [LayerRole.SPARSE] * num_layers
        for layer in self.full_layers:
            roles[layer] = LayerRole.FULL
        for layer in self.selecting_layers():
            roles[layer] = LayerRole.SELECT
        return roles

    def budget(self) -> str:
        return f"{getattr(self, self.budget_field)} {self.budget_field.removeprefix('budget_')}"

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        # per request and decode step (metrics, report): counted, not layer_roles rebuilt; the
        # lists are disjoint without repeats (validate) and within the model (decode_fns)
        if self.full_layers is None or self.selecting_layers() is None:
            raise ValueError("attended_tokens needs layer lists: call for_model first")
        sparse = num_layers - len(self.full_layers) - len(self.selecting_layers())
        budget = getattr(self, self.budget_field) * self.budget_unit_tokens
        return (seq_len * (num_layers - sparse) + min(seq_len, budget) * sparse) / num_layers

    def decode_program(self, ctx: DecodeContext, inputs: DecodeInputs) -> DecodeProgram:
        policy = self.for_model(ctx)
        selection = policy.selection(ctx, importance_ordered=inputs.art is not None)
        decoder = SelectionDecoder(policy.name, selection, ctx, inputs, policy.budget_field)
        by_role = {
            LayerRole.FULL: ctx.base_decode,
            LayerRole.SELECT: decoder.select_decode,
            LayerRole.SPARSE: decoder.sparse_decode,
        }
        roles = policy.layer_roles(ctx.num_layers)
        table_reads = {}
        if decoder.reads_shared_table():  # a sparse layer is only attention over the table
            table_reads = {
                layer: TableRead() for layer, role in enumerate(roles) if role is LayerRole.SPARSE
            }
        return DecodeProgram(
            [by_role[role] for role in roles], step_setups=decoder.step_setups,
            reservations=selection.reservations, table_reads=table_reads,
        )  # fmt: skip

    def _error(self, field: str, message: str):
        raise PolicyConfigError(f"{self.name}.{field}", message)


def scaled_layers(layers: list[int], from_depth: int, to_depth: int) -> list[int]:
    """Layer ids chosen for a model of ``from_depth`` layers, placed at the same relative depth."""
    return sorted({min(to_depth - 1, round(layer * to_depth / from_depth)) for layer in layers})


class SelectionDecoder:
    """Decode of selection and sparse layers for one attention backend, and the selection they
    share. The selection lives in buffers sized for the largest batch, allocated once; a batch uses
    their first rows. Decode reads nothing back to the host (but for one log line per server), so
    a CUDA graph can capture it."""

    def __init__(
        self, policy_name: str, selection: Selection, ctx: DecodeContext, inputs: DecodeInputs,
        budget_column: str,
    ):  # fmt: skip
        self.policy_name, self.rule, self.ctx = policy_name, selection, ctx
        self.budget_column = budget_column  # the request table's column of each one's budget
        self.art, self.request_table = inputs.art, inputs.request_table
        self.retained = inputs.retained
        self.tile_counts = inputs.tile_counts
        self.selected = torch.zeros(
            ctx.max_batch_size, selection.budget, dtype=torch.int32, device=ctx.device
        )
        self.num_selected = torch.zeros(ctx.max_batch_size, dtype=torch.int32, device=ctx.device)
        self.row_budget = None  # each request's own budget, gathered once per step
        # on CUDA (without ART, which reads the selection in its order) each selection layer
        # gathers its selection's slots once, for the sparse layers after it
        reads_art = self.art is not None
        self._table = None if reads_art else _slot_table(ctx, selection, inputs.table_share)
        self._art_scratch = self.art.scratch(ctx) if reads_art else None
        self.step_setups = selection.step_setups
        if self.request_table is not None:
            int32 = {"dtype": torch.int32, "device": ctx.device}
            self.row_budget = torch.zeros(ctx.max_batch_size, **int32)
            self.step_setups = (*self.step_setups, self._gather_row_budgets)
        self._shares_table = inputs.table_share is not None
        self._first_trim_unlogged = True
        if ctx.ranks is not None:
            logger.info("sglang_ext: %s selection scores are combined across ranks", policy_name)

    @property
    def table(self) -> SlotTable | None:
        """Where the sparse layers read the latest selection on CUDA (None: the torch path)."""
        return self._table

    def reads_shared_table(self) -> bool:
        return self._table is not None and self._shares_table

    def select_decode(
        self, q, k, v, layer, forward_batch, save_kv_cache=True, retention=None, **kwargs
    ):  # fmt: skip
        q, kv = self._begin(q, k, v, layer, forward_batch, save_kv_cache)
        out, token_scores, page_scores = self.rule.attend_and_score(
            q, kv, sm_scale=layer.scaling, retention=retention
        )
        if self.ctx.ranks is not None:
            # Each rank scored its own heads; the max over all heads makes every rank select alike.
            token_scores, page_scores = self.ctx.ranks.max(token_scores), None
        batch = q.shape[0]
        row_budget = None if self.row_budget is None else self.row_budget[:batch]
        self.rule.choose(
            token_scores, page_scores, kv.lengths[:batch], row_budget,
            out=(self.selected[:batch], self.num_selected[:batch]),
        )  # fmt: skip
        if self._table is not None:
            self._table.gather(
                kv, self.selected[:batch], self.num_selected[:batch], self.rule.page_size
            )
        if self._first_trim_unlogged and self._trims(forward_batch):
            self._log_selection(layer.layer_id, forward_batch.seq_lens, self.num_selected[:batch])
        return out.view(batch, -1)

    def _gather_row_budgets(self, forward_batch) -> None:
        rows = forward_batch.req_pool_indices
        budgets = self.request_table[self.budget_column]
        torch.index_select(budgets, 0, rows, out=self.row_budget[: rows.shape[0]])

    def sparse_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q, kv = self._begin(q, k, v, layer, forward_batch, save_kv_cache)
        batch = q.shape[0]
        if self.art is not None:  # the selection is importance-ordered: ART reads it so
            out = self.art.read(
                q, self.ctx, layer, forward_batch, scratch=self._art_scratch,
                tile_counts=self.tile_counts,
                order=self.selected[:batch],
                num_order=self.num_selected[:batch], order_span=self.rule.page_size,
                always_read=self.rule.num_recent * self.rule.page_size,
            )  # fmt: skip
            return out.view(batch, -1)
        if self._table is not None:
            return self._table.attend(q, kv, layer.scaling).view(batch, -1)
        out = sparse_decode_attention_ref(
            q,
            kv,
            self.selected[:batch],
            self.num_selected[:batch],
            sm_scale=layer.scaling,
            page_size=self.rule.page_size,
        )
        return out.view(batch, -1)

    def _begin(self, q, k, v, layer, forward_batch, save_kv_cache):
        """Store the new token's K/V; return q as [batch, heads, dim] and the layer's KV view."""
        if save_kv_cache and k is not None and v is not None:
            self.ctx.write_kv(layer, forward_batch, k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.retained is not None:
            return q, self.retained.view(layer.layer_id)
        kv = KVView.of_layer(self.ctx.kv_pool, layer.layer_id, self.ctx.req_to_token, forward_batch)
        return q, kv

    def _trims(self, forward_batch) -> bool:
        """Whether a request of the batch has more units than the budget (judged on the host copy
        of seq_lens: no device sync)."""
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None or int(seq_lens.max()) <= self.rule.budget * self.rule.page_size:
            return False
        return not (self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _log_selection(self, layer_id, seq_lens, num_selected):
        # Once per server, as evidence that selection takes effect; its read-back syncs once.
        self._first_trim_unlogged = False
        size = self.rule.page_size
        available = (seq_lens + size - 1) // size
        logger.info(
            "sglang_ext: %s layer %d first selected fewer %s than a request has: %s of %s",
            self.policy_name, layer_id, self.rule.unit, num_selected.tolist(), available.tolist(),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RaggedScoring:
    """A selection layer's attention on CUDA (``ragged_scoring``)."""

    attend_and_score: Callable[..., tuple]
    chooser_args: dict  # the ``unit_chooser`` arguments that read its score rows
    step_setups: tuple[Callable, ...]  # the rows placed once per step
    reservations: tuple[Callable[[int], bool], ...]


def ragged_scoring(
    ctx: DecodeContext, use_probs: bool, page_size: int, retained: RetainedKV | None = None
) -> RaggedScoring:  # fmt: skip
    """A selection layer's attention on CUDA: the kernel with its scratch and its score rows owned
    up front (``kernels.selection_attention.ScoreRows``: ragged, sized by the KV pool, shared by
    the policy's selection layers and placed once per step, by each request's tokens or by what
    ``retained`` holds of them), and the ``unit_chooser`` arguments that read those rows (units
    of ``page_size`` tokens: pages are scored beside tokens)."""
    rows = sa.ScoreRows(
        ctx.batch_tokens_bound(), ctx.max_batch_size, ctx.num_q_heads, ctx.device, page_size > 1
    )
    attend_and_score = functools.partial(
        sa.ragged_selection_attention, rows=rows, use_probs=use_probs,
        workspace=ctx.split_workspace(ctx.req_to_token.shape[1]),
    )  # fmt: skip
    width = -(-ctx.req_to_token.shape[1] // page_size)

    def place(forward_batch) -> None:
        lengths = forward_batch.seq_lens
        if retained is not None:
            lengths = retained.lengths[: lengths.shape[0]]
        rows.place(lengths)

    return RaggedScoring(
        attend_and_score, {"row_start": rows.row_start, "width": width},
        step_setups=(place,),
        reservations=(rows.reserve,),
    )  # fmt: skip


def _slot_table(ctx: DecodeContext, selection: Selection, share):
    """The sparse layers' slot table with its scratch owned up front on CUDA; None elsewhere (the
    torch reference reads the selection)."""
    if torch.device(ctx.device).type != "cuda":
        return None
    entries = selection.budget * selection.page_size
    return SlotTable(ctx.max_batch_size, entries, ctx.device, ctx.head_shape(), share)
