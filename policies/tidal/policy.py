"""``tidal``: TidalDecode (arXiv 2410.05076), position-persistent sparse attention.

Layers in ``full_layers`` attend to the whole cache. A token-selection layer (by default layer 2
and one re-selection layer mid-depth) attends to the whole cache too and keeps the
``budget_tokens`` tokens with the highest score, always including the last ``recent_tokens`` (the
token being decoded) and the first ``sink_tokens`` (attention sinks, which q·k alone often misses:
keeping them brings the model closer to full attention); the other layers after it attend only
to those tokens. A token's ``score`` is the max over query heads of its attention probability
(``"probability"``, DELTA's: each head normalised by its softmax; the default, as it keeps the
next-token distribution closer to full attention's) or of its scaled q·k (``"qk"``, the paper's).
With ``correction_interval`` T > 0, every T decode steps the tokens decoded since the last
correction get their K/V re-filled by a full-attention prefill (sglang_ext.policies.tidal.cache_correction).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from sglang_ext.kernels import selection_attention as sa
from sglang_ext.kernels.page_select import unit_chooser
from sglang_ext.policies.base import DecodeContext, KVPolicy, PolicyConfigError
from sglang_ext.policies.context import RetainedKV
from sglang_ext.policies.eviction_selection import over_eviction
from sglang_ext.policies.registry import register_policy
from sglang_ext.policies.tidal.cache_correction import CacheCorrection
from sglang_ext.policies.selection import (
    Selection,
    SelectionPolicy,
    RaggedScoring,
    ragged_scoring,
    scaled_layers,
)

PAPER_DEPTH, PAPER_RESELECTION_LAYER = 32, 13  # the paper's best for Llama-3-8B (Sec. 4.4)
SCORES = ("probability", "qk")


@register_policy
@dataclasses.dataclass(frozen=True)
class TidalPolicy(SelectionPolicy):
    name = "tidal"
    selection_field = "selection_layers"
    budget_field, recent_field, sink_field = "budget_tokens", "recent_tokens", "sink_tokens"
    request_params = ("budget_tokens",)  # at most the server's: it sizes the selection buffers
    full_layers: list[int] | None = None  # unset: calibration file, else [0, 1]
    selection_layers: list[int] | None = None  # unset: calibration file, else [2, 13 of 32]
    budget_tokens: int = 1024
    recent_tokens: int = 1
    sink_tokens: int = 4  # the first tokens, always kept: q·k alone misses attention sinks
    correction_interval: int = 0  # T of the paper's cache correction (Sec. 3.2); 0: off
    score: str = "probability"  # per token, the max over query heads of: "probability" or "qk"

    @classmethod
    def for_token_budget(cls, tokens: int) -> dict[str, int]:
        return {"budget_tokens": tokens}

    def validate(self) -> None:
        super().validate()
        if self.score not in SCORES:
            raise PolicyConfigError(
                f"{self.name}.score", f"unknown token score {self.score!r}", list(SCORES)
            )
        if self.correction_interval < 0:
            self._error(
                "correction_interval", f"must be >= 0 (0: off), got {self.correction_interval}"
            )

    def over(self, base: KVPolicy) -> KVPolicy:
        return over_eviction(self, base)  # EVICTION+SELECTION: it reads what base keeps

    def cache_correction(self) -> CacheCorrection | None:
        return CacheCorrection(self.correction_interval) if self.correction_interval > 0 else None

    def paper_layers(self, num_layers: int) -> tuple[list[int], list[int]]:
        reselect = scaled_layers([PAPER_RESELECTION_LAYER], PAPER_DEPTH, num_layers)
        return [0, 1], sorted({2, *reselect})

    def selection(
        self, ctx: DecodeContext, importance_ordered: bool = False, retained: RetainedKV | None = None
    ) -> Selection:  # fmt: skip
        if torch.device(ctx.device).type == "cuda":
            by_probability = self.score == "probability"
            scoring = ragged_scoring(ctx, by_probability, page_size=1, retained=retained)
        else:  # the torch reference (the Triton interpreter is far too slow to serve with)
            reference = functools.partial(_reference_attention, score=self.score)
            scoring = RaggedScoring(reference, {}, (), ())
        choose_tokens = unit_chooser(
            ctx.device, self.budget_tokens, self.recent_tokens, 1, importance_ordered,
            num_sink=self.sink_units(), **scoring.chooser_args,
        )  # fmt: skip

        def choose(token_scores, page_scores, seq_lens, row_budget=None, out=None):
            return choose_tokens(token_scores, seq_lens, row_budget, out)

        return Selection(
            "tokens", 1, self.budget_tokens, scoring.attend_and_score, choose,
            self.recent_tokens, scoring.step_setups, scoring.reservations,
        )  # fmt: skip


def _reference_attention(q, kv, *, sm_scale, score, retention=None):
    out, probabilities = sa.selection_attention_ref(q, kv, sm_scale, retention)
    if score == "probability":
        return out, probabilities, None
    return out, sa.tidal_token_scores_ref(q, kv, sm_scale), None
