"""``lethe``: evicts KV during decoding and returns the freed slots to SGLang's pool (Lethe).

Every layer attends only to its own retained tokens and keeps a RASR score per token (decayed
accumulated attention, Eq. 5; ``sglang_ext.kernels.rasr``). Eq. 2 sums attention over queries, so
the prompt contributes too: the attention of its last ``observation_window`` tokens seeds the
scores at prefill, and a round that comes at the first decode step does not choose blind. When a request's retained KV (the
tokens any layer still keeps) passes its eviction threshold, a pruning round runs Algorithm 1 on
every layer: sort the layer's scores, cut them into ``segments``, and find the breakpoint; keep the
salient tokens before it, the ``sink_tokens`` first tokens and the most recent ``recent_ratio`` of
the layer's retained tokens.

Defaults (RESULTS.md#eviction-fidelity), scores decayed by 0.99 a step in both layouts:
- served alone: a list per layer, half its cap recent, a round every 64 decoded tokens, and at a
  request's first round (its prompt compressed) half the rest of each layer's cap a shared core
  (the tokens the one retained set would rank first); on SmolLM2 closer to full attention on
  text than one set, though not as close as kvpress's SnapKV at equal KV, and more lookups
  answered than without;
- under a selection (``lethe+tidal``), which reads one retained set: one set for every layer,
  0.3 of it recent, on Algorithm 1's threshold cadence;
- ``per_kv_head`` set (a list per KV head): as served alone, but 0.1 of a list recent.
``recent_ratio``, ``round_interval`` and ``shared_ratio`` left unset take their layout's value.
``sparse_ratio`` set adds the paper's breakpoints, per layer; ``window_size`` set ranks a round by
the last decode queries' attention, pooled as SnapKV's, instead of the decayed scores.

Memory: a round caps the request's KV at ``max_kv_ratio`` of its tokens; 1.0 turns the cap off
and leaves the paper's rule alone. Without per-layer lists the cap cuts the one retained set
(``cap_union``). With them, memory is per layer (``layer_memory``): each layer's
list is cut to the cap (``cap_layers``), and a request holds ``ceil(sum of its layers' entries /
layers)`` slots, its kept entries packed into the rows of those slots, whatever the layers keep
in common (``pack_layers``; False frees a slot only once no layer keeps its token, the union
capped as without per-layer lists). Layers whose attention is flat find no breakpoint and keep
everything (on SmolLM2 the first layers do), so the cap still bounds them. Its life in the
engine is ``runtime``.

Breakpoint: the paper's text reads "first cut where v_top[0] / v_top[cut] <= tau", which holds at
the first cut for any but the steepest scores and would make a larger tau prune *more*; its
ablation says a larger ``sparse_ratio`` keeps more. We take the reading that agrees with the
ablation: the breakpoint is the first cut where the scores have dropped by more than tau
(v_top[0] > tau * v_top[cut]); tokens from there on are pruned. No such cut: the layer's attention
is not sparse, it keeps everything this round, and if no layer found one the threshold doubles.

What the runtime asks of a policy is ``EvictionPolicy``, Lethe's base: the scoring knobs (decay,
prefill seed, scores a round ranks by), the round cadence and the caps. The public decode-time
scorers SnapKV, TOVA and H2O (``scorers``) are other rules over the same runtime.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from sglang_ext.kernels import rasr
from sglang_ext.policies.base import DecodeContext, DecodeInputs, KVPolicy, PolicyConfigError
from sglang_ext.policies.lethe.runtime import LetheRuntime
from sglang_ext.policies.registry import register_policy


@dataclasses.dataclass(frozen=True)
class LayerShrink:
    """One layer's outcome of a round: which retained entries it keeps, and the count the
    threshold update uses (breakpoint + recent window), or None when no breakpoint was found."""

    keep: torch.Tensor | None  # bool [n], over the layer's retained entries
    salient_plus_recent: int | None


@dataclasses.dataclass(frozen=True)
class EvictionPolicy(KVPolicy):
    """A policy that Lethe's eviction runtime (``LetheRuntime``) runs: decode-time scores per
    retained entry, rounds that cut each request's KV to a cap and give the freed slots back to
    SGLang's pool. A subclass is the scoring rule and its round parameters; the runtime asks only
    this interface, never a policy's type.

    Scores: every decode step each list updates ``s = decay * s + attention received`` (summed
    over the layer's query heads, or a KV head's query group with ``per_kv_head``,
    ``kernels.rasr``); ``decay`` is a field or a class constant of the subclass.
    A prefill seeds them from the attention of its last ``seed_window()`` prompt queries
    (``seed``). A round ranks entries by ``round_scores``; with ``observed_steps()`` set, a
    round's scores come from the last that many decode queries before it only (reset then, and
    after each round). Rounds run once a request's retained KV passes its threshold
    (``first_threshold``, then ``next_threshold``)."""

    request_opt_out = True

    # each layer keeps its own list, cut by its own scores; False: one retained set for all layers;
    # None: per-layer lists, but one set under a selection composed over it (``one_set``)
    per_layer: bool | None = None
    # with per-layer lists and per-layer memory: each KV head of a layer keeps its own list, cut
    # by its own query group's scores (kvpress's presses keep top-k per KV head)
    per_kv_head: bool = False

    def evicts(self) -> bool:
        return True

    def per_layer_lists(self) -> bool:
        """Whether layers may keep different lists (else every layer keeps the request's set)."""
        return self.per_layer is not False

    def per_kv_head_lists(self) -> bool:
        """Whether each KV head of a layer keeps a list of its own (else the layer's heads share
        one)."""
        return self.per_kv_head

    def validate_lists(self) -> None:
        """The lists' layout: lists per KV head need lists per layer packed into shared slots."""
        if self.per_kv_head and not (self.per_layer_lists() and self.pack_layers):
            self._error("per_kv_head", "lists per KV head need per-layer lists (per_layer true) "
                        "and per-layer memory (pack_layers true)")  # fmt: skip

    def pools_layer_rows(self) -> bool:
        return self.per_layer_lists()

    def one_set(self) -> EvictionPolicy:
        """This rule keeping one retained set for every layer, for a selection composed over it
        (``policies.eviction_selection``); PolicyConfigError where its lists are per layer."""
        if self.per_kv_head:
            self._error("per_kv_head", "a selection composed over it reads one retained set: "
                        "its lists are per KV head")  # fmt: skip
        if self.per_layer is None:  # left to the rule: one set under a selection
            return dataclasses.replace(self, per_layer=False)
        if self.per_layer_lists():
            self._error("per_layer", "a selection composed over it reads one retained set: its "
                        "lists are per layer")  # fmt: skip
        return self

    def runtime(self, ctx: DecodeContext, shared: DecodeInputs | None = None) -> LetheRuntime:
        return LetheRuntime(self, ctx, shared)

    def server_defaults(self) -> dict[str, str | None]:
        # Prefill seeds the scores with a host-side loop over requests (lethe.runtime).
        return {"--disable-prefill-cuda-graph": None}

    def request_state_bytes(
        self, num_layers: int, num_q_heads: int, num_kv_heads: int, context_len: int
    ) -> int:
        return LetheRuntime.request_slot_bytes(
            self, num_layers, num_q_heads, num_kv_heads, context_len
        )

    # the rule: scores ----------------------------------------------------------------------------
    def seed_window(self) -> int:
        """The last prompt queries whose attention seeds the scores at prefill (0: none)."""
        return 0

    def seed(self, received: torch.Tensor) -> torch.Tensor:
        """A request's seeded scores in one layer from ``received`` [tokens] (the attention its
        window's queries pay each token, summed over heads and queries, over every rank)."""
        return received

    def observed_steps(self) -> int | None:
        """None: scores decay over the request's whole life. N: a round sees only the attention
        of the last N decode queries before it (the runtime zeroes scores N steps before a round
        and after each)."""
        return None

    def round_scores(self, scores: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """What a round ranks entries by, from their scores [requests, layers, n] (request i's
        layer l holds its first ``counts[i][l]`` entries, in ``list_order``, then the tokens
        decoded since its last round)."""
        return scores

    def list_order(
        self, stays: torch.Tensor, ranked: torch.Tensor, counts: list[list[int]]
    ) -> torch.Tensor:
        """The order of each layer's list after a round ([requests, layers, n] indices into it,
        from which entries stay and what the round ranked them by, ``counts`` as in
        ``round_scores``): the kept entries first, here in the order they held (by ascending
        position); the tokens decoded later are appended."""
        return torch.sort((~stays).to(torch.int8), dim=2, stable=True).indices

    # the rule: rounds ----------------------------------------------------------------------------
    def first_threshold(self) -> int:
        """The retained KV past which a request's first round runs."""
        raise NotImplementedError

    def next_threshold(
        self, threshold: int, breakpoints: list[int | None], retained: int, length: int
    ) -> int:
        """The threshold after a round at ``length`` positions that left ``retained`` (each
        layer's breakpoint + recent window where ``shrink_layers`` found one, else None)."""
        raise NotImplementedError

    def round_cap(self, length: int) -> int:
        """The most positions of ``length`` a round leaves."""
        raise NotImplementedError

    def recent_window(self, retained: int) -> int:
        """The most recent of ``retained`` entries a round keeps first."""
        raise NotImplementedError

    def expected_kv(self, total_tokens: int) -> int:
        """The most KV a request of ``total_tokens`` (prompt and generation) is expected to hold."""
        raise NotImplementedError

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        # Right after a round: the fewest it reads at this length, for a decode step's bandwidth
        # floor. Its runtime's reports count what each request really holds.
        return float(min(seq_len, self.round_cap(seq_len)))

    def shrink_layers(self, positions: torch.Tensor, scores: torch.Tensor, counts: list[int]):
        """What each layer keeps before the cap (a row each: the layers of a batch of requests;
        row r's entries the first ``counts[r]`` columns of ``positions``/``scores`` [rows, n]):
        (keep [rows, n] bool, False past a row's count; found [rows] bool: a breakpoint;
        salient_plus_recent [rows] int64, meaningful where found), without a host sync. Here
        every entry: only the cap evicts."""
        layers, n = scores.shape
        device = scores.device
        count = torch.tensor(counts, device=device)
        valid = torch.arange(n, device=device) < count[:, None]
        return valid, torch.zeros(layers, dtype=torch.bool, device=device), count

    def cap_union_layers(
        self, positions: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """``cap_union`` of what ``shrink_layers`` kept, for a batch of requests at once on the
        device without a host sync: request i's layers are ``[i]`` of ``positions``, ``scores``
        and ``keep`` [requests, layers, n], its round covers ``lengths[i]`` positions. Bool
        [requests, max(lengths)], False past a request's length."""
        device = scores.device
        width = max(lengths)
        best = _best_share(positions, scores, keep, width)
        union = torch.isfinite(best)
        cap, recent = self._caps(lengths, device)
        length = torch.tensor(lengths, device=device)[:, None]
        column = torch.arange(width, device=device)
        capped = (column < length) & ((column < self.sink_tokens) | (column >= length - recent))
        room = cap - capped.sum(1, keepdim=True)
        candidates = torch.where(capped | ~union, float("-inf"), best)
        ranked, order = torch.sort(candidates, dim=1, descending=True, stable=True)
        chosen = (column < room) & torch.isfinite(ranked)
        capped |= torch.zeros_like(capped).scatter_(1, order, chosen)
        return torch.where(union.sum(1, keepdim=True) <= cap, union, capped)

    def shared_entries(
        self, positions: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, lengths: list[int],
        first: list[bool], across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Per-layer lists: the entries ([requests, layers, n] bool, as ``positions``) that every
        layer keeping them keeps ahead of its own choice, the request's shared core; None: none
        (each layer cuts by its own scores alone). ``first[i]``: request i's first round.
        ``across``: the most over the tensor-parallel ranks, where each holds lists of its own."""
        return None

    def cap_layers(
        self, positions: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, lengths: list[int],
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """What ``shrink_layers`` kept ([rows, n] each, a row a layer of a request, its entries in
        ``list_order``), each row cut to ``round_cap(lengths[row])`` entries where it kept
        more: its sink tokens, its most recent entries and its ``shared`` ones first, then by its
        own score. On the device, without a host sync."""
        cap, recent = self._caps(lengths, scores.device)
        kept = keep.sum(1, keepdim=True)
        latest_first = _rank(torch.where(keep, positions, -1))  # 0 at a layer's latest kept entry
        forced = keep & ((positions < self.sink_tokens) | (latest_first < recent))
        if shared is not None:
            forced |= keep & shared
        room = cap - forced.sum(1, keepdim=True)
        candidates = torch.where(keep & ~forced, scores, float("-inf"))
        chosen = (_rank(candidates) < room) & torch.isfinite(candidates)
        return torch.where(kept <= cap, keep, forced | chosen)

    def _error(self, field: str, message: str):
        raise PolicyConfigError(f"{self.name}.{field}", message)

    def _caps(self, lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each round's cap and the recent window it keeps first, [len(lengths), 1] on device."""
        caps = [self.round_cap(n) for n in lengths]
        recent = [self.recent_window(c) for c in caps]
        return torch.tensor([caps, recent], device=device).view(2, -1, 1).unbind(0)


def _rank(values: torch.Tensor) -> torch.Tensor:
    """Each entry's place in its row ([rows, n]) by descending value, ties by column."""
    order = torch.argsort(values, dim=1, descending=True, stable=True)
    column = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, column)


@register_policy
@dataclasses.dataclass(frozen=True)
class Lethe(EvictionPolicy):
    name = "lethe"
    # Host-side rules of a round. Server-wide: decay and the observation windows (they shape
    # every request's device-side scores), per_layer and sparse_ratio (without per-layer lists
    # the decode reads one list for all layers, gathered once per step).
    request_params = (
        "evict_threshold", "recent_ratio", "sink_tokens", "segments", "max_kv_ratio",
        "round_interval", "shared_ratio",
    )  # fmt: skip

    evict_threshold: int = 1024  # initial L_evict: retained tokens that trigger the first round
    # tau: a score drop by more than this marks a layer's breakpoint; None: no breakpoints
    sparse_ratio: float | None = None
    # fraction of a layer's retained tokens kept as the recent window; None: the layout's
    recent_ratio: float | None = None
    sink_tokens: int = 4  # the first tokens, always kept
    segments: int = 10  # D: cut points of the sorted scores
    # gamma of RASR: 0.99 kept the model closer to full attention than no decay, in both
    # layouts, and the paper's 0.95 further
    decay: float = 0.99
    max_kv_ratio: float = 0.3  # a round leaves at most this fraction of a request's tokens' KV
    # decoded tokens between rounds once a round has run; 0: the next round comes when the
    # retained KV outgrows the cap by a recent window (or Algorithm 1's threshold); None: the
    # layout's
    round_interval: int | None = None
    # with per-layer lists: memory is the sum of the layers' lists, packed into shared slots
    # (sglang_ext.policies.lethe.layer_memory); False: a slot is freed once no layer keeps its token (the union)
    pack_layers: bool = True
    # with per-layer lists, at a request's first round: the fraction of each layer's cap, beside
    # its sinks and recent window, that keeps the request's shared core (the tokens the one
    # retained set would rank first, by the best share any layer gives them) ahead of the layer's
    # own choice; 0: none; None: the layout's
    shared_ratio: float | None = None
    # None: a round ranks by the scores decayed over the request's life (RASR). N: a round ranks
    # by the attention of the last N decode queries before it, average-pooled over
    # ``window_pool`` neighbouring entries of a layer's list, which a round leaves in rank order
    # (SnapKV's rule in kvpress's cache order); set ``decay`` 1 to weigh the N alike. Not the
    # default: on SmolLM2 no closer to full attention than the decayed scores beyond what the
    # pool width alone moves, and its choices, like SnapKV's, move with float rounding
    # (RESULTS.md#lethe-window)
    window_size: int | None = None
    window_pool: int = 5  # odd
    observation_window: int = 32  # the last prompt tokens whose attention seeds the scores
    # odd: a seeded score is the best of the token and its neighbours; 13 keeps a six-digit value
    # beside the key a question attends, where 9 lost its last digits (RESULTS.md#eviction-fidelity)
    observation_pool: int = 13

    def validate(self) -> None:
        if self.evict_threshold < 1:
            self._error("evict_threshold", f"must be >= 1, got {self.evict_threshold}")
        ratio = self.sparse_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 1):
            self._error("sparse_ratio", f"must be a finite number > 1 or null, got {ratio}")
        if ratio is not None and self.per_layer is False:
            self._error("sparse_ratio", "breakpoints need per-layer lists (per_layer true)")
        if not 0 <= self.recent() < 1:
            self._error("recent_ratio", f"must be in [0, 1), got {self.recent_ratio}")
        if self.sink_tokens < 0:
            self._error("sink_tokens", f"must be >= 0, got {self.sink_tokens}")
        if self.segments < 2:
            self._error("segments", f"must be >= 2, got {self.segments}")
        if not 0 < self.decay <= 1:
            self._error("decay", f"must be in (0, 1], got {self.decay}")
        if self.observation_window < 0:
            self._error(
                "observation_window", f"must be >= 0, got {self.observation_window}"
            )
        if self.observation_pool < 1 or self.observation_pool % 2 == 0:
            self._error(
                "observation_pool", f"must be an odd number >= 1, got {self.observation_pool}"
            )
        if self.window_size is not None and self.window_size < 1:
            self._error("window_size", f"must be >= 1 or null, got {self.window_size}")
        if self.window_pool < 1 or self.window_pool % 2 == 0:
            self._error("window_pool", f"must be an odd number >= 1, got {self.window_pool}")
        if not 0 < self.max_kv_ratio <= 1:
            self._error("max_kv_ratio", f"must be in (0, 1], got {self.max_kv_ratio}")
        if self.round_interval is not None and self.round_interval < 0:
            self._error("round_interval", f"must be >= 0 or null, got {self.round_interval}")
        if not 0 <= self.core() <= 1:
            self._error("shared_ratio", f"must be in [0, 1], got {self.shared_ratio}")
        if self.core() > 0 and not self.per_layer_lists():
            self._error("shared_ratio", "a shared core needs per-layer lists (per_layer true)")
        self.validate_lists()

    def one_set(self) -> Lethe:
        if self.sparse_ratio is not None:  # the paper's breakpoints: lists per layer
            self._error("per_layer", "a selection composed over it reads one retained set: "
                        "sparse_ratio keeps a list per layer")  # fmt: skip
        return super().one_set()

    # the layout's values of the parameters left unset (the module's docstring)
    def recent(self) -> float:
        """The recent window's share of a layer's retained tokens."""
        if self.recent_ratio is not None:
            return self.recent_ratio
        if self.per_kv_head:  # a head's own scores pick well: fewer recent tokens are forced
            return 0.1
        return 0.5 if self.per_layer_lists() else 0.3

    def interval(self) -> int | None:
        """Decoded tokens between rounds; None: rounds on the retained KV's threshold."""
        interval = self.round_interval
        if interval is None:
            interval = 64 if self.per_layer_lists() else 0
        return interval or None

    def core(self) -> float:
        """The shared core's share of each layer's cap beside its sinks and recent window."""
        if self.shared_ratio is not None:
            return self.shared_ratio
        return 0.5 if self.per_layer_lists() else 0.0

    def seed_window(self) -> int:
        return self.observation_window

    def seed(self, received: torch.Tensor) -> torch.Tensor:
        return rasr.pool_neighbours(received, self.observation_pool)

    def first_threshold(self) -> int:
        return self.evict_threshold

    def observed_steps(self) -> int | None:
        return self.window_size

    def round_scores(self, scores: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        if self.window_size is None:
            return scores
        return pooled_before_window(scores, counts, self.window_size, self.window_pool)

    def list_order(self, stays, ranked, counts) -> torch.Tensor:
        if self.window_size is None or not self.per_layer_lists():
            return super().list_order(stays, ranked, counts)
        return rank_order(stays, ranked, counts, self.window_size)

    def shared_entries(self, positions, scores, keep, lengths, first, across=None):
        # At a request's first round only (its prompt compressed, ranked by seeds from the
        # prompt's last queries): a later round that forced the core cut what each layer had
        # since shown it reads (RESULTS.md#eviction-fidelity).
        if self.core() == 0 or not any(first):
            return None
        device, width = scores.device, max(lengths)
        best = _best_share(positions, scores, keep, width)
        if across is not None:  # every rank's lists
            best = across(best)
        cap, recent = self._caps(lengths, device)
        room = ((cap - recent - self.sink_tokens).clamp_min(0) * self.core()).long()
        length = torch.tensor(lengths, device=device)[:, None]
        column = torch.arange(width, device=device)
        forced = (column < self.sink_tokens) | (column >= length - recent)  # kept anyway
        ranked, order = torch.sort(
            torch.where(forced, float("-inf"), best), dim=1, descending=True, stable=True
        )
        chosen = (column < room) & torch.isfinite(ranked)
        core = torch.zeros_like(chosen).scatter_(1, order, chosen)
        core &= torch.tensor(first, device=device)[:, None]
        at = positions.long().clamp(max=width - 1).flatten(1)
        return keep & core.gather(1, at).view_as(keep)

    def budget(self) -> str:
        caps = f"max_kv_ratio {self.max_kv_ratio}, evict_threshold {self.evict_threshold}"
        if self.interval() is not None:
            caps += f", round_interval {self.interval()}"
        if not self.per_layer_lists():
            return f"{caps}{self._window()}, one set"
        memory = "per-layer memory" if self.pack_layers else "freed by the union"
        if self.per_kv_head:
            memory += ", lists per KV head"
        breakpoints = "" if self.sparse_ratio is None else f", sparse_ratio {self.sparse_ratio}"
        core = f", shared_ratio {self.core()}" if self.core() else ""
        return f"{caps}{breakpoints}{core}{self._window()} ({memory})"

    def _window(self) -> str:
        if self.window_size is None:
            return ""
        return f", window_size {self.window_size} (pooled over {self.window_pool})"

    def recent_window(self, retained: int) -> int:
        return math.ceil(self.recent() * retained)

    def shrink_layer(self, positions: torch.Tensor, scores: torch.Tensor) -> LayerShrink:
        """Algorithm 1 on one layer's retained entries (logical positions ascending, scores)."""
        n = positions.numel()
        if n == 0:  # a layer that holds nothing (yet) keeps nothing
            return LayerShrink(torch.zeros(0, dtype=torch.bool, device=positions.device), None)
        if self.sparse_ratio is None:  # no breakpoints: the layer keeps its whole set (to the cap)
            return LayerShrink(torch.ones(n, dtype=torch.bool, device=positions.device), None)
        recent = self.recent_window(n)
        keep = positions < self.sink_tokens
        keep[n - recent :] = True
        top_values, top_indices = torch.sort(scores, descending=True, stable=True)
        cuts = torch.tensor([n * d // self.segments for d in range(1, self.segments)])
        cuts = cuts[(cuts > 0) & (cuts < n)].to(scores.device)
        dropped = top_values[0] > self.sparse_ratio * top_values[cuts]
        if not bool(dropped.any()):
            return LayerShrink(torch.ones_like(keep), None)
        breakpoint = int(cuts[int(dropped.int().argmax())])
        keep[top_indices[:breakpoint]] = True
        return LayerShrink(keep, breakpoint + recent)

    def shrink_layers(self, positions: torch.Tensor, scores: torch.Tensor, counts: list[int]):
        """``shrink_layer`` on many layers at once (a row each: the layers of a batch of requests),
        on the device: row r's retained entries are the first ``counts[r]`` columns of
        ``positions``/``scores`` [rows, n]. Returns (keep [rows, n] bool, False past a row's
        count; found [rows] bool: a breakpoint; salient_plus_recent [rows] int64, meaningful
        where found), without a host sync."""
        layers, n = scores.shape
        device = scores.device
        column = torch.arange(n, device=device)
        count = torch.tensor(counts, device=device)
        valid = column < count[:, None]
        if self.sparse_ratio is None:  # no breakpoints: each layer keeps its whole set (to the cap)
            return valid, torch.zeros(layers, dtype=torch.bool, device=device), count
        recent = torch.tensor([self.recent_window(c) for c in counts], device=device)
        keep = valid & ((positions < self.sink_tokens) | (column >= (count - recent)[:, None]))
        ranked, order = torch.sort(
            torch.where(valid, scores, float("-inf")), dim=1, descending=True, stable=True
        )
        cut_lists = [[c * d // self.segments for d in range(1, self.segments)] for c in counts]
        cuts = torch.tensor(cut_lists, device=device).view(layers, self.segments - 1)
        real_cut = (cuts > 0) & (cuts < count[:, None])
        at_cut = ranked.gather(1, cuts.clamp(max=max(n - 1, 0))) if n else ranked[:, :0]
        dropped = real_cut & (ranked[:, :1] > self.sparse_ratio * at_cut) if n else real_cut
        found = dropped.any(1)
        breakpoint = cuts.gather(1, dropped.int().argmax(1, keepdim=True)).squeeze(1)
        salient = torch.zeros_like(valid).scatter_(1, order, column < breakpoint[:, None])
        keep = torch.where(found[:, None], keep | salient, valid)
        return keep, found, breakpoint + recent

    def round_cap(self, length: int) -> int:
        """The most positions of ``length`` a round leaves."""
        return max(self.sink_tokens + 1, math.ceil(self.max_kv_ratio * length))

    def attended_tokens(self, seq_len: int, num_layers: int) -> float:
        # Right after a round: the fewest it reads at this length (it then grows by a recent
        # window until the next), for a decode step's bandwidth floor. Its runtime's reports
        # count what each request really holds.
        if seq_len <= self.evict_threshold:
            return float(seq_len)
        return float(min(seq_len, self.round_cap(seq_len)))

    def expected_kv(self, total_tokens: int) -> int:
        """The most KV a request of ``total_tokens`` (prompt and generation) is expected to hold:
        rounds leave ``max_kv_ratio`` of it, and it grows by a recent window before the next."""
        return min(total_tokens, self._budget_trigger(total_tokens))

    def cap_union(self, kept: list[torch.Tensor], scores: list[torch.Tensor], length: int):
        """Which of ``length`` positions the request's KV keeps after a round: every position a
        layer kept (``kept[l]`` with ``scores[l]``), cut to ``max_kv_ratio`` of ``length`` when
        more: sink and recent tokens first, then by the best score any layer gives the position,
        each layer's scores normalised to sum 1 so that layers weigh alike. Bool [length]."""
        device = scores[0].device
        best = torch.full((len(kept), length), float("-inf"), device=device)
        for layer, (positions, layer_scores) in enumerate(zip(kept, scores, strict=True)):
            total = layer_scores.sum().clamp_min(torch.finfo(torch.float32).tiny)
            best[layer, positions.long()] = layer_scores / total
        best = best.amax(0)
        union = torch.isfinite(best)
        cap = self.round_cap(length)
        if int(union.sum()) <= cap:
            return union
        keep = torch.zeros(length, dtype=torch.bool, device=device)
        keep[: self.sink_tokens] = True
        keep[length - self.recent_window(cap) :] = True
        room = cap - int(keep.sum())
        if room > 0:
            candidates = torch.where(keep | ~union, float("-inf"), best)
            top = torch.topk(candidates, room)
            keep[top.indices[torch.isfinite(top.values)]] = True
        return keep

    def next_threshold(
        self, threshold: int, breakpoints: list[int | None], retained: int, length: int
    ) -> int:
        """L_evict after a round at ``length`` positions, given each layer's breakpoint + recent
        window (``LayerShrink.salient_plus_recent``; None: none found) (Algorithm 1: max with breakpoint + r,
        doubled when no layer found a breakpoint). Under a KV budget (max_kv_ratio < 1) it is
        capped where ``expected_kv`` says the request may grow to, so that the scheduler's count
        holds: flat attention (no breakpoint) would otherwise double it round after round. Never
        below what the round left plus a recent window, so that rounds do not fire at once.
        With a round interval: the next round after that many decoded tokens."""
        if self.interval() is not None:
            return retained + self.interval() - 1
        found = [b for b in breakpoints if b is not None]
        threshold = max([threshold, *found]) if found else 2 * threshold
        if self.max_kv_ratio < 1:
            threshold = min(threshold, self._budget_trigger(length))
        return max(threshold, retained + max(1, self.recent_window(retained)))

    def _budget_trigger(self, length: int) -> int:
        cap = self.round_cap(length)
        growth = self.recent_window(cap) if self.interval() is None else self.interval()
        return max(self.evict_threshold, cap + growth)


def _split_at_window(like: torch.Tensor, counts: list[list[int]], window: int):
    """Which entries of each layer's list ([requests, layers, n], as ``like``; its first
    ``counts[i][l]`` held) come before its last ``window``, and which are those last."""
    count = torch.tensor(counts, device=like.device)[..., None]
    column = torch.arange(like.shape[-1], device=like.device)
    start = count - window
    return column < start, (column >= start) & (column < count)


def pooled_before_window(
    scores: torch.Tensor, counts: list[list[int]], window: int, kernel: int
) -> torch.Tensor:
    """SnapKV's round scores: ``scores`` [requests, layers, n] (the last ``window`` queries'
    attention) average-pooled over ``kernel`` neighbouring entries of a layer's list, its own
    last ``window`` entries (kept anyway) left out: zeros past either end, as kvpress pools the
    keys before its window."""
    before_window, _ = _split_at_window(scores, counts, window)
    flat = torch.where(before_window, scores, 0.0).flatten(0, 1)[:, None]
    pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return pooled.view_as(scores)


def rank_order(
    stays: torch.Tensor, ranked: torch.Tensor, counts: list[list[int]], window: int
) -> torch.Tensor:
    """kvpress's cache order after a compression (``EvictionPolicy.list_order``'s contract): the
    last ``window`` entries first, then the kept ones by descending ``ranked`` score, so that
    the next round's pooling smooths an entry's score with those it ranked beside."""
    _, last = _split_at_window(ranked, counts, window)
    key = torch.where(last, float("-inf"), -ranked)
    return torch.sort(torch.where(stays, key, float("inf")), dim=2, stable=True).indices


def _best_share(positions, scores, keep, width: int) -> torch.Tensor:
    """Per request and position ([requests, width]), the largest share of its layer's kept
    scores any layer gives the position (each layer's scores normalised to sum 1, so that layers
    weigh alike); -inf where no layer keeps it. ``positions``, ``scores``, ``keep``:
    [requests, layers, n]."""
    total = torch.where(keep, scores, 0.0).sum(2, keepdim=True)
    share = scores / total.clamp_min(torch.finfo(torch.float32).tiny)
    best = torch.full((*keep.shape[:2], width + 1), float("-inf"), device=scores.device)
    at = torch.where(keep, positions.long(), width)  # what a layer dropped: a spare column
    best.scatter_reduce_(2, at, torch.where(keep, share, float("-inf")), "amax")
    return best[:, :, :width].amax(1)
