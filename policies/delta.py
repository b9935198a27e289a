"""``delta``: DELTA (arXiv 2510.09883), page selection refreshed at a few Δ-layers.

Layers in ``full_layers`` attend to the whole cache (the engine's own decode). A Δ-layer attends to
the whole cache too, scores each 16-token page (token score: max over query heads of the attention
probability; page score: their sum over the page), and selects the last ``recent_pages`` pages plus
the top ``budget_pages - recent_pages`` others by score (the first ``sink_pages`` ahead of them:
off by default, as the probability score finds the sink page anyway); every other layer after
it, up to the next Δ-layer, attends only to those pages. The selection is made anew at every
decode step.
"""

from __future__ import annotations

import dataclasses

import torch
from sglang_ext.kernels import selection_attention as sa
from sglang_ext.kernels.page_select import unit_chooser
from sglang_ext.policies.base import DecodeContext, KVPolicy
from sglang_ext.policies.context import RetainedKV
from sglang_ext.policies.eviction_selection import over_eviction
from sglang_ext.policies.registry import register_policy
from sglang_ext.policies.selection import (
    LayerRole,
    Selection,
    SelectionPolicy,
    RaggedScoring,
    ragged_scoring,
    scaled_layers,
)

__all__ = ["PAGE_SIZE", "DeltaPolicy", "LayerRole"]

PAGE_SIZE = 16  # tokens per page; the selection kernel's page scores are fixed to it
PAPER_DEPTH, PAPER_DELTA_LAYERS = 28, [2, 14, 22]  # the paper's Δ-layers for 28-layer models


@register_policy
@dataclasses.dataclass(frozen=True)
class DeltaPolicy(SelectionPolicy):
    name = "delta"
    selection_field = "delta_layers"
    budget_field, recent_field, sink_field = "budget_pages", "recent_pages", "sink_pages"
    budget_unit_tokens = PAGE_SIZE
    score = "probability"
    request_params = ("budget_pages",)  # at most the server's: it sizes the selection buffers
    full_layers: list[int] | None = None  # unset: calibration file, else [0, 1]
    delta_layers: list[int] | None = None  # unset: calibration file, else [2, 14, 22] at 28 layers
    budget_pages: int = 64
    recent_pages: int = 8
    sink_pages: int = 0  # the first pages, always kept (its max-probability score finds them)

    def over(self, base: KVPolicy) -> KVPolicy:
        return over_eviction(self, base)  # EVICTION+SELECTION: it reads what base keeps

    def paper_layers(self, num_layers: int) -> tuple[list[int], list[int]]:
        return [0, 1], [2, *scaled_layers(PAPER_DELTA_LAYERS[1:], PAPER_DEPTH, num_layers)]

    @classmethod
    def for_token_budget(cls, tokens: int) -> dict[str, int]:
        # the paper's ratio: 64 pages, 8 of them recent
        pages = max(1, tokens // PAGE_SIZE)
        return {"budget_pages": pages, "recent_pages": max(1, pages // 8)}

    def selection(
        self, ctx: DecodeContext, importance_ordered: bool = False, retained: RetainedKV | None = None
    ) -> Selection:  # fmt: skip
        if torch.device(ctx.device).type == "cuda":
            scoring = ragged_scoring(ctx, True, page_size=PAGE_SIZE, retained=retained)
        else:  # the torch reference (the Triton interpreter is far too slow to serve with)
            scoring = RaggedScoring(_reference_attention, {}, (), ())
        choose_pages = unit_chooser(
            ctx.device, self.budget_pages, self.recent_pages, PAGE_SIZE, importance_ordered,
            num_sink=self.sink_units(), **scoring.chooser_args,
        )  # fmt: skip

        def choose(token_scores, page_scores, seq_lens, row_budget=None, out=None):
            if page_scores is None:  # (combined across ranks: the pages are summed again)
                page_scores = page_sums(token_scores)
            return choose_pages(page_scores, seq_lens, row_budget, out)

        return Selection(
            "pages", PAGE_SIZE, self.budget_pages, scoring.attend_and_score, choose,
            self.recent_pages, scoring.step_setups, scoring.reservations,
        )  # fmt: skip


def page_sums(token_scores: torch.Tensor) -> torch.Tensor:
    """Page scores of dense rows [batch, T], or of ragged ones [capacity] (rows start on pages)."""
    rows = token_scores.view(-1, token_scores.shape[-1])
    return sa.page_scores_ref(rows, PAGE_SIZE).view(*token_scores.shape[:-1], -1)


def _reference_attention(q, kv, *, sm_scale, retention=None):
    out, token_scores = sa.selection_attention_ref(q, kv, sm_scale, retention)
    return out, token_scores, page_sums(token_scores)
