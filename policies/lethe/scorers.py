"""The public decode-time eviction scorers, SnapKV, TOVA and H2O, as policies on Lethe's eviction
runtime (``policies.lethe.runtime``): the same rounds, freed slots, radix protection, admission,
reports and CUDA graphs as ``lethe``; only the scoring rule and the round parameters differ.

Each is a kvpress-style press (``ScorerPress`` under ``CompressionRatioDecodingPress``): a round
keeps ``1 - compression_ratio`` of the tokens a request has seen, the first at the request's first
decode step (its prompt, from the prefill's seeded scores: kvpress's prefill compression), then
every ``compression_interval`` decoded tokens. Selection is per layer (each layer keeps its own
top entries by its own scores, ``EvictionPolicy.cap_layers``), its entries packed into shared
slots (``layer_memory``), as Lethe does with ``per_layer`` true; under a selection composed over
it (``snapkv+tidal``), or with ``per_layer`` false, one retained set for every layer, ranked by the
best share any layer gives a token (``cap_union_layers``). Scores are summed over a layer's
query heads unless ``per_kv_head`` is true: then each KV head keeps its own top entries by its
own query group's scores, as kvpress's presses do. No sink tokens (kvpress's defaults).

- ``snapkv``: the attention of the last ``window_size`` queries before a round (decay 1, scores
  zeroed ``window_size`` steps before each round and after it; at the first round, the last
  ``window_size`` prompt queries), average-pooled over ``kernel_size`` neighbouring entries of
  a layer's list, which a round leaves in kvpress's cache order (``SnapKV.list_order``); the
  last ``window_size`` tokens are always kept.
- ``tova``: the attention of the last query only (decay 0; at the first round, the prompt's last
  query); the last token is always kept (as kvpress's TOVA does).
- ``h2o``: attention accumulated over the request's life (decay 1; seeded from the last
  ``observation_window`` prompt queries); half of a round's cap is the recent window, the other
  half the heavy hitters.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from sglang_ext.policies.lethe.policy import EvictionPolicy, pooled_before_window, rank_order
from sglang_ext.policies.registry import register_policy


@dataclasses.dataclass(frozen=True)
class DecodeScorer(EvictionPolicy):
    """What the three share: kvpress's ``compression_ratio`` (the fraction of a request's tokens
    a round removes) and ``compression_interval`` (decoded tokens between rounds), both per
    request."""

    request_params = ("compression_ratio", "compression_interval")
    sink_tokens: ClassVar[int] = 0
    pack_layers: ClassVar[bool] = True  # per-layer memory: the layers' lists packed into slots
    decay: ClassVar[float]  # of the scores, per decode step

    compression_ratio: float = 0.5
    compression_interval: int = 512

    def validate(self) -> None:
        if not 0 <= self.compression_ratio < 1:
            self._error("compression_ratio", f"must be in [0, 1), got {self.compression_ratio}")
        if self.compression_interval < 1:
            self._error(
                "compression_interval", f"must be >= 1, got {self.compression_interval}"
            )
        self.validate_lists()

    def first_threshold(self) -> int:
        return 0  # the first decode step: the prompt is compressed

    def next_threshold(self, threshold, breakpoints, retained: int, length: int) -> int:
        return retained + self.compression_interval - 1  # due after compression_interval steps

    def round_cap(self, length: int) -> int:
        # rounded down, at least 1, as kvpress's compute_n_kept and decoding target size
        return max(1, int(length * (1 - self.compression_ratio)))

    def expected_kv(self, total_tokens: int) -> int:
        # a round leaves its cap; the request grows by an interval before the next
        return min(total_tokens, self.round_cap(total_tokens) + self.compression_interval)

    def budget(self) -> str:
        layout = "" if self.per_layer_lists() else ", one set"
        layout += ", lists per KV head" if self.per_kv_head else ""
        return (
            f"compression_ratio {self.compression_ratio}, "
            f"compression_interval {self.compression_interval}{layout}"
        )


@register_policy
@dataclasses.dataclass(frozen=True)
class SnapKV(DecodeScorer):
    name = "snapkv"
    decay = 1.0

    window_size: int = 64  # the queries a round observes, and the latest tokens it keeps
    kernel_size: int = 5  # odd: the average pool over neighbouring entries' scores

    def validate(self) -> None:
        super().validate()
        if self.window_size < 1:
            self._error("window_size", f"must be >= 1, got {self.window_size}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            self._error("kernel_size", f"must be an odd number >= 1, got {self.kernel_size}")

    def seed_window(self) -> int:
        return self.window_size

    def observed_steps(self) -> int:
        return self.window_size

    def recent_window(self, retained: int) -> int:
        return min(self.window_size, retained)

    def round_scores(self, scores: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """The window's attention, average-pooled over ``kernel_size`` neighbouring entries of a
        layer's list, its own last ``window_size`` entries (kept anyway) left out, as kvpress pools
        the keys before its window: zeros past either end."""
        return pooled_before_window(scores, counts, self.window_size, self.kernel_size)

    def list_order(self, stays, ranked, counts) -> torch.Tensor:
        """kvpress's order of the cache after a compression, its top-k's: the window first
        (kvpress scores it above every other), then the kept entries by descending score. The next
        round's pooling runs over this order, so an entry's score is smoothed with those of the
        entries it ranked beside: without it kvpress's SnapKV keeps the model as far from full
        attention as this runtime's did with lists by position (RESULTS.md#eviction-fidelity).
        One retained set keeps its lists by position: every layer reads the same list, in one
        order."""
        if not self.per_layer_lists():
            return super().list_order(stays, ranked, counts)
        return rank_order(stays, ranked, counts, self.window_size)


@register_policy
@dataclasses.dataclass(frozen=True)
class TOVA(DecodeScorer):
    name = "tova"
    decay = 0.0

    def seed_window(self) -> int:
        return 1

    def recent_window(self, retained: int) -> int:
        return min(1, retained)


@register_policy
@dataclasses.dataclass(frozen=True)
class H2O(DecodeScorer):
    name = "h2o"
    decay = 1.0

    observation_window: int = 64  # the last prompt queries whose attention seeds the scores

    def validate(self) -> None:
        super().validate()
        if self.observation_window < 0:
            self._error("observation_window", f"must be >= 0, got {self.observation_window}")

    def seed_window(self) -> int:
        return self.observation_window

    def recent_window(self, retained: int) -> int:
        return retained // 2
