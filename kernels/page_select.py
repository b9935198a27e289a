"""Which pages (DELTA) or tokens (TidalDecode) the sparse layers attend to, from selection scores.

Per request with n = ceil(seq_len / page_size) pages (the last may be partial): keep the last
`num_recent` pages and the first `num_sink` (attention sinks), plus the top (budget - num_recent -
num_sink) pages by score among the others; a request with n <= budget keeps all n. Ties go to the
lower page index (stable sort). The output has a fixed shape, [batch, budget] int32 with the kept
pages in ascending order then zeros, plus num_selected [batch] int32: the input of
sparse_decode_attention. It all runs on the device with no host sync, so it can live inside a CUDA
graph; short and long requests mix freely in one batch.
"""

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (scores [batch, n], eligible [batch, n] bool, k) -> [batch, k] indices of the k best eligible
# entries, best first, ties to the lower index; with fewer than k eligible, ineligible ones follow.
TopRanked = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def select_pages(
    page_scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: int,
    num_recent: int,
    page_size: int = 16,
    by_importance: bool = False,
    row_budget: torch.Tensor | None = None,
    top_ranked: TopRanked | None = None,
    num_sink: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DELTA's choice of K = budget pages with a recency window of L = num_recent pages.

    page_scores [batch, max_pages] (entries past a request's last page are ignored) ->
    (selected [batch, budget] int32, num_selected [batch] int32). ``by_importance`` orders the
    kept pages for ART's traversal instead of ascending: the recent pages, latest first, then
    the others by score, highest first. ``row_budget`` ([batch], each in [num_recent, budget])
    gives a request its own smaller K; the output keeps its width ``budget``. ``top_ranked``
    ranks the candidates (default: torch's topk, the oracle; see ``fastest_top_ranked``). The
    first ``num_sink`` pages rank above every other candidate: they are kept while the budget
    lasts, as ``sink_scores`` ranks them.
    """
    assert 0 <= num_recent <= budget, "the recency window must fit in the budget"
    assert 0 <= num_sink <= budget - num_recent, "the sinks must fit beside the recency window"
    max_pages = page_scores.shape[1]
    page_ids = torch.arange(max_pages, device=page_scores.device)
    num_pages = (seq_lens.long()[:, None] + page_size - 1) // page_size
    candidate = page_ids < num_pages - num_recent  # exists and is not recent
    page_scores = sink_scores(page_scores, page_ids, num_sink)
    # A top-k, not a sort: the score rows span the server's whole context (Tidal's: every token).
    num_top = min(budget - num_recent, max_pages)
    top = (top_ranked or torch_top_ranked)(page_scores, candidate, num_top)
    kept_top = candidate.gather(1, top)
    if row_budget is not None:  # topk ranks best first: a row keeps its first K_row - L
        rank = torch.arange(num_top, device=page_scores.device)
        kept_top &= rank < row_budget.long()[:, None] - num_recent
    top = torch.where(kept_top, top, max_pages)
    recent = num_pages - num_recent + torch.arange(num_recent, device=page_scores.device)
    recent = torch.where(recent >= 0, recent, max_pages)
    if by_importance:
        kept = torch.cat([recent.flip(-1), top], dim=1)
        # the kept ones first, each group in its order (a stable sort on validity)
        kept = kept.gather(1, (kept >= max_pages).int().sort(dim=1, stable=True).indices)
    else:
        # Recent pages follow every candidate, so one small sort puts the kept pages in order.
        kept = torch.cat([top, recent], dim=1).sort(dim=1).values
    valid = kept < max_pages
    selected = torch.where(valid, kept, 0).int()
    if selected.shape[1] < budget:
        selected = F.pad(selected, (0, budget - selected.shape[1]))
    return selected, valid.sum(dim=1, dtype=torch.int32)


def sink_scores(scores: torch.Tensor, unit_ids: torch.Tensor, num_sink: int) -> torch.Tensor:
    """The scores with the first ``num_sink`` units' raised above all others (+inf)."""
    if num_sink == 0:
        return scores
    return torch.where(unit_ids < num_sink, float("inf"), scores)


def torch_top_ranked(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    return _rank_keys(scores, eligible).topk(k, dim=1).indices


def flashinfer_top_ranked(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """FlashInfer's radix top-k (O(n) in the row), where torch's topk over int64 keys sorts: it
    dominates a TidalDecode selection over every token of a long request. Its sorted, small-index
    tie-break mode keeps the rule; graph-safe mode because decode replays it from a CUDA graph.
    An eligible -inf becomes the lowest finite float so that it still ranks above the ineligible."""
    import flashinfer

    lowest = torch.finfo(scores.dtype).min
    masked = torch.where(eligible, scores.clamp_min(lowest), float("-inf"))
    _, top = flashinfer.top_k(
        masked, k, sorted=True, tie_break=flashinfer.topk.TopKTieBreak.SMALL, dsa_graph_safe=True
    )
    return top


def unit_chooser(
    device: torch.device | str,
    budget: int,
    num_recent: int,
    page_size: int,
    by_importance: bool,
    row_start: torch.Tensor | None = None,
    width: int | None = None,
    num_sink: int = 0,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``choose(scores, seq_lens, row_budget=None, out=None) -> (selected, num_selected)``, the
    selection rule of ``select_pages`` by the fastest way on ``device``: the fused kernels on
    CUDA for rows they take (``fused_fits``), else ``select_pages`` with the fastest top-k (and
    under ART, whose importance order the kernels do not make); measured: kernel_bench's
    ``rank_*_ms`` rows. The choice depends on the row's width only, so a CUDA graph keeps it.
    ``out`` receives the result in place. With ``row_start`` the scores are ragged (as
    ``select_units_fused`` takes them, rows of at most ``width`` units); the top-k path ranks
    dense copies of them."""
    fused = torch.device(device).type == "cuda" and not by_importance
    top_ranked = fastest_top_ranked(device)

    def choose(scores, seq_lens, row_budget=None, out=None):
        row_width = scores.shape[1] if row_start is None else width
        if fused and fused_fits(row_width, budget, num_recent):
            return select_units_fused(
                scores, seq_lens, budget, num_recent, page_size, row_budget, out,
                row_start=row_start, width=width, num_sink=num_sink,
            )  # fmt: skip
        if row_start is not None:
            scores = dense_rows(scores, row_start, seq_lens, width, page_size)
        chosen = select_pages(
            scores, seq_lens, budget, num_recent, page_size, by_importance, row_budget, top_ranked,
            num_sink,
        )  # fmt: skip
        if out is None:
            return chosen
        out[0].copy_(chosen[0])
        out[1].copy_(chosen[1])
        return out

    return choose


def dense_rows(
    scores: torch.Tensor, row_start: torch.Tensor, seq_lens: torch.Tensor, width: int, page: int
) -> torch.Tensor:
    """[batch, width] rows of ragged ``scores`` (request b's units of ``page`` tokens from
    row_start[b] / page on), -inf past each request's units: for the rankers that take dense
    rows only (allocated per call: ART's importance order, budgets the fused kernels refuse)."""
    units = torch.arange(width, device=scores.device)
    own = units < (seq_lens.long()[:, None] + page - 1) // page
    index = torch.where(own, row_start[: seq_lens.shape[0], None] // page + units, 0)
    return torch.where(own, scores[index], float("-inf"))


def fastest_top_ranked(device: torch.device | str) -> TopRanked:
    """FlashInfer's top-k on CUDA where it is installed (measured: benchmarks.kernel_bench's
    ``rank_*_ms`` rows), torch's elsewhere. FlashInfer's ragged top-k (each row's candidates only,
    ``rank_flashinfer_ragged_ms``) is faster alone but was slower in the engine's decode step (an
    A/B of benchmarks.decode_step), so it is not used."""
    if torch.device(device).type == "cuda":
        try:
            import flashinfer.topk  # noqa: F401
        except ImportError:
            return torch_top_ranked
        return flashinfer_top_ranked
    return torch_top_ranked


def _rank_keys(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (score, then lower index first); ineligible entries rank last.

    The float's bits, flipped for negatives, order like the float; the low 32 bits break ties
    toward the lower index, which topk alone does not promise."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    index = torch.arange(scores.shape[1], device=scores.device)
    keys = (ordered << 32) | (scores.shape[1] - 1 - index)
    return torch.where(eligible, keys, torch.iinfo(torch.int64).min)


def select_tokens(
    token_scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: int,
    num_recent: int = 1,
    by_importance: bool = False,
    row_budget: torch.Tensor | None = None,
    top_ranked: TopRanked | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TidalDecode's top-`budget` tokens by score, always keeping the last `num_recent` tokens.

    By default that is the token being decoded, which TidalDecode's kernels attend to outside the
    top-k. Same output format as select_pages, for sparse_decode_attention with page_size=1.
    """
    return select_pages(
        token_scores, seq_lens, budget, num_recent, 1, by_importance, row_budget, top_ranked
    )


# One Triton program per request does the whole choice where the torch path takes about fifteen
# small kernels (mask, top-k, gather, cat, sort, pad): at batch 1 their launches, not their work,
# cost most of a selection layer. It reads only the request's own units, held in registers, so
# one pass takes rows of at most this many units: DELTA's pages at 128k tokens, Tidal's tokens at
# 8k. A wider row is cut into chunks of at most that many (``chunk_units``); each keeps its best
# (budget - num_recent) candidates, and merges of as many lists as one pass holds choose among
# those, in a tree, until one list is left (exact: a unit among the row's best is among its
# chunk's and its group's best). Chunks and merges past a request's length skip their work.
# Passes over rows held in memory, instead, were slower than FlashInfer's top-k. At most 65,535:
# _keep_best counts a pass's keys in 16-bit fields.
FUSED_MAX_UNITS = 8192
# A chunk holds this many units per candidate it keeps, at least MIN_CHUNK_UNITS: a short
# request's row then spreads over several programs (few candidates would otherwise take whole
# chunks, one program's long pass at batch 1); many candidates keep the widest chunks, which
# spare merges.
UNITS_PER_CANDIDATE = 16
MIN_CHUNK_UNITS = 1024


def chunk_units(per_list: int) -> int:
    """Units of a chunk whose best ``per_list`` candidates make one list."""
    wanted = triton.next_power_of_2(UNITS_PER_CANDIDATE * max(per_list, 1))
    return min(FUSED_MAX_UNITS, max(MIN_CHUNK_UNITS, wanted))


@triton.jit
def _ordered_key(scores):
    """uint32 keys that order like the fp32 scores (-0.0 as 0.0)."""
    bits = (scores + 0.0).to(tl.int32, bitcast=True)
    signed = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return signed.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _load_scores(scores, offs, mask, num_sink):
    """A chunk's scores, the first ``num_sink`` units' raised to +inf (kept first)."""
    values = tl.load(scores, mask=mask, other=0.0)
    return tl.where(offs < num_sink, float("inf"), values)


@triton.jit
def _row_offset(RowStart, row, stride_scores, PAGE, RAGGED):
    """Where a row's scores start: ragged (ScoreRows), its first token's column over the unit
    size; dense, its stride."""
    if RAGGED:
        return tl.load(RowStart + row) // PAGE
    return row * stride_scores


@triton.jit
def _row_counts(SeqLens, RowBudget, row, budget, num_recent, PAGE, HAS_ROW_BUDGET):
    """(units, candidates: the units before the recent ones, how many candidates to keep)."""
    num_units = (tl.load(SeqLens + row).to(tl.int32) + PAGE - 1) // PAGE
    num_candidates = tl.maximum(num_units - num_recent, 0)
    row_budget = budget
    if HAS_ROW_BUDGET:
        row_budget = tl.load(RowBudget + row).to(tl.int32)
    num_top = tl.maximum(tl.minimum(row_budget - num_recent, num_candidates), 0)
    return num_units, num_candidates, num_top


@triton.jit
def _keep_best(keys, is_candidate, num_top):
    """(keep, place): the num_top best candidate keys, ties to the lower offset, and where each
    kept one lands in ascending order (a prefix sum). The threshold is the largest key with at
    least num_top candidate keys at or above it, found from the top two bits a round: one
    block-wide sum counts the keys at or above three trials (packed in 16-bit fields: a pass holds
    at most FUSED_MAX_UNITS keys). The search stops once exactly num_top keys lie at or above the
    threshold (distinct scores: after ~log2(keys) bits, not 32); else the threshold ends as the
    num_top-th largest key, and of the keys equal to it the lowest offsets are kept. Bit rounds,
    not tl.histogram rounds of a byte, which were slower."""
    threshold = tl.zeros((), tl.uint32)
    shift = tl.full((), 30, tl.uint32)
    searching = tl.full((), 1, tl.int1)  # num_top 0 too: it climbs until nothing is kept
    while searching:
        trial = threshold | (tl.full((), 1, tl.uint32) << shift)
        trial2 = threshold | (tl.full((), 2, tl.uint32) << shift)
        trial3 = threshold | (tl.full((), 3, tl.uint32) << shift)
        at_or_above = (
            (keys >= trial).to(tl.int64)
            | ((keys >= trial2).to(tl.int64) << 16)
            | ((keys >= trial3).to(tl.int64) << 32)
        )
        counts = tl.sum(tl.where(is_candidate, at_or_above, 0))
        count, count2, count3 = counts & 0xFFFF, (counts >> 16) & 0xFFFF, counts >> 32
        threshold = tl.where(count >= num_top, trial, threshold)
        threshold = tl.where(count2 >= num_top, trial2, threshold)
        threshold = tl.where(count3 >= num_top, trial3, threshold)
        exact = (count == num_top) | (count2 == num_top) | (count3 == num_top)
        searching = (shift > 0) & (exact == 0)
        shift = tl.where(shift > 0, shift - 2, shift)
    above = is_candidate & (keys > threshold)
    tie = is_candidate & (keys == threshold)
    ties_wanted = num_top - tl.sum(above.to(tl.int32))
    if ties_wanted < tl.sum(tie.to(tl.int32)):  # only then rank the ties (one more prefix sum)
        tie_rank = tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32)
        keep = above | (tie & (tie_rank < ties_wanted))
    else:
        keep = above | tie
    place = tl.cumsum(keep.to(tl.int32), 0) - keep.to(tl.int32)
    return keep, place


@triton.jit
def _finish_row(
    selected, NumSelected, row, num_units, num_candidates, num_top, budget, BUDGET_BLOCK
):
    """After the num_top kept candidates: the recent units, which follow every candidate, then
    zeros; and the count."""
    num_kept_recent = num_units - num_candidates
    slot = tl.arange(0, BUDGET_BLOCK)
    is_recent = (slot >= num_top) & (slot < num_top + num_kept_recent)
    tl.store(selected + slot, num_candidates + slot - num_top, mask=is_recent)
    tl.store(selected + slot, 0, mask=(slot >= num_top + num_kept_recent) & (slot < budget))
    tl.store(NumSelected + row, num_top + num_kept_recent)


@triton.jit
def _select_kernel(
    Scores,
    RowStart,
    SeqLens,
    RowBudget,
    Selected,
    NumSelected,
    stride_scores,
    stride_selected,
    budget,
    num_recent,
    num_sink,
    PAGE: tl.constexpr,
    HAS_ROW_BUDGET: tl.constexpr,
    RAGGED: tl.constexpr,
    BLOCK: tl.constexpr,
    BUDGET_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_units, num_candidates, num_top = _row_counts(
        SeqLens, RowBudget, row, budget, num_recent, PAGE, HAS_ROW_BUDGET
    )
    selected = Selected + row * stride_selected
    offs = tl.arange(0, BLOCK)
    is_candidate = offs < num_candidates
    scores = Scores + _row_offset(RowStart, row, stride_scores, PAGE, RAGGED) + offs
    keys = _ordered_key(_load_scores(scores, offs, is_candidate, num_sink))
    keep, place = _keep_best(keys, is_candidate, num_top)
    tl.store(selected + place, offs, mask=keep)
    _finish_row(
        selected, NumSelected, row, num_units, num_candidates, num_top, budget, BUDGET_BLOCK
    )


@triton.jit
def _chunk_best_kernel(
    Scores,
    RowStart,
    SeqLens,
    RowBudget,
    Best,
    BestScores,
    NumBest,
    stride_scores,
    stride_best,
    budget,
    num_recent,
    num_sink,
    PAGE: tl.constexpr,
    HAS_ROW_BUDGET: tl.constexpr,
    RAGGED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunk c of a row keeps its best candidates in list c: slots [c * (budget - num_recent),
    ...) of the row's Best (unit ids, ascending) and BestScores, their count in NumBest[row, c].
    A chunk past the row's candidates only records an empty list."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    _, num_candidates, num_top = _row_counts(
        SeqLens, RowBudget, row, budget, num_recent, PAGE, HAS_ROW_BUDGET
    )
    num_kept = tl.zeros((), tl.int32)
    if chunk * CHUNK < num_candidates:
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        is_candidate = offs < num_candidates
        scores = Scores + _row_offset(RowStart, row, stride_scores, PAGE, RAGGED) + offs
        keys = _ordered_key(_load_scores(scores, offs, is_candidate, num_sink))
        keep, place = _keep_best(keys, is_candidate, num_top)
        slots = row * stride_best + chunk * (budget - num_recent) + place
        tl.store(Best + slots, offs, mask=keep)
        # reread (no spills); the sinks' +inf goes with them, so that every merge keeps them
        tl.store(BestScores + slots, _load_scores(scores, offs, keep, num_sink), mask=keep)
        num_kept = tl.sum(keep.to(tl.int32))
    tl.store(NumBest + row * tl.num_programs(1) + chunk, num_kept)


@triton.jit
def _merge_best_kernel(
    Best,
    BestScores,
    NumBest,
    SeqLens,
    RowBudget,
    Out,
    OutScores,
    NumOut,
    stride_best,
    stride_out,
    budget,
    num_recent,
    num_lists,
    PAGE: tl.constexpr,
    HAS_ROW_BUDGET: tl.constexpr,
    LISTS_PER_GROUP: tl.constexpr,
    FINAL: tl.constexpr,
    BLOCK: tl.constexpr,
    BUDGET_BLOCK: tl.constexpr,
):
    """Group g of a row's candidate lists (lists [g * LISTS_PER_GROUP, ...), laid out as
    _chunk_best_kernel's, ascending by unit id) keeps its best: as list g of Out, OutScores and
    NumOut, or, FINAL (one group), as the row's selection in Out with the recent units. Lists
    fill in order, so a group whose first list is empty is empty."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    num_units, num_candidates, num_top = _row_counts(
        SeqLens, RowBudget, row, budget, num_recent, PAGE, HAS_ROW_BUDGET
    )
    per_list = budget - num_recent
    first = group * LISTS_PER_GROUP
    not_empty = (tl.load(NumBest + row * num_lists + first) > 0) | FINAL
    num_kept = tl.zeros((), tl.int32)
    if not_empty:
        offs = tl.arange(0, BLOCK)
        lst = first + offs // per_list
        in_group = (offs < LISTS_PER_GROUP * per_list) & (lst < num_lists)
        filled = tl.load(NumBest + row * num_lists + lst, mask=in_group, other=0)
        is_candidate = in_group & (offs - (lst - first) * per_list < filled)
        slots = Best + row * stride_best + first * per_list + offs
        scores = BestScores + row * stride_best + first * per_list + offs
        keys = _ordered_key(tl.load(scores, mask=is_candidate, other=0.0))
        keep, place = _keep_best(keys, is_candidate, num_top)
        if FINAL:
            tl.store(Out + row * stride_out + place, tl.load(slots, mask=keep), mask=keep)
        else:
            out = row * stride_out + group * per_list + place
            tl.store(Out + out, tl.load(slots, mask=keep), mask=keep)
            tl.store(OutScores + out, tl.load(scores, mask=keep), mask=keep)
            num_kept = tl.sum(keep.to(tl.int32))
    if FINAL:
        _finish_row(
            Out + row * stride_out, NumOut, row, num_units, num_candidates, num_top, budget,
            BUDGET_BLOCK,
        )  # fmt: skip
    else:
        tl.store(NumOut + row * tl.num_programs(1) + group, num_kept)


def fused_fits(width: int, budget: int, num_recent: int) -> bool:
    """Whether ``select_units_fused`` takes rows of ``width`` units: one pass, or chunks whose
    best candidates are merged in groups of at least two lists."""
    return width <= FUSED_MAX_UNITS or 2 * (budget - num_recent) <= FUSED_MAX_UNITS


def select_units_fused(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: int,
    num_recent: int,
    page_size: int,
    row_budget: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    row_start: torch.Tensor | None = None,
    width: int | None = None,
    num_sink: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages`` (ascending order, not ``by_importance``) by the fused kernels: one pass
    for rows of at most one chunk (``chunk_units``), else each chunk's best merged in a tree (rows
    ``fused_fits`` takes); the oracle is ``select_pages``. ``scores`` [batch, width] fp32 must
    cover every unit of each request; ``out`` (selected [batch, budget] int32, num_selected
    [batch] int32) receives the result in place. Ragged scores (``ScoreRows``): ``scores`` is
    one row, request b's units from row_start[b] / page_size on (``row_start`` [batch] int64,
    in tokens), and ``width`` is the most units a request has."""
    assert 0 <= num_recent <= budget, "the recency window must fit in the budget"
    assert 0 <= num_sink <= budget - num_recent, "the sinks must fit beside the recency window"
    ragged = row_start is not None
    batch, width = (seq_lens.shape[0], width) if ragged else scores.shape
    scores_stride = 0 if ragged else scores.stride(0)
    starts = row_start if ragged else seq_lens  # an unread placeholder when dense
    if not fused_fits(width, budget, num_recent):
        raise ValueError(
            f"select_units_fused: rows of {width} units with {budget - num_recent} to choose: "
            f"at most {FUSED_MAX_UNITS} units, or {FUSED_MAX_UNITS // 2} to choose"
        )
    if out is None:
        out = (
            torch.empty(batch, budget, dtype=torch.int32, device=scores.device),
            torch.empty(batch, dtype=torch.int32, device=scores.device),
        )
    selected, num_selected = out
    rows = seq_lens if row_budget is None else row_budget
    per_list = budget - num_recent
    shared = {"PAGE": page_size, "HAS_ROW_BUDGET": row_budget is not None, "num_warps": 8}
    finish = {"BUDGET_BLOCK": triton.next_power_of_2(budget)}
    chunk = chunk_units(per_list)
    if width <= chunk or per_list == 0:  # (nothing to choose: only the recent units)
        block = triton.next_power_of_2(width) if per_list else 16
        _select_kernel[(batch,)](
            scores, starts, seq_lens, rows, selected, num_selected, scores_stride,
            selected.stride(0), budget, num_recent, num_sink, RAGGED=ragged, BLOCK=block, **shared,
            **finish,
        )  # fmt: skip
        return selected, num_selected
    # Candidate lists, allocated here (inside a CUDA graph: the graph's own pool); the chunks'
    # programs past a request's length, and merges of such chunks, only record empty lists.
    lists = triton.cdiv(width, chunk)
    best, best_scores, num_best = _candidate_lists(batch, lists, per_list, scores)
    _chunk_best_kernel[(batch, lists)](
        scores, starts, seq_lens, rows, best, best_scores, num_best, scores_stride,
        best.stride(0), budget, num_recent, num_sink, RAGGED=ragged, CHUNK=chunk,
        **shared,
    )  # fmt: skip
    per_group = FUSED_MAX_UNITS // per_list
    while lists > per_group:
        groups = triton.cdiv(lists, per_group)
        merged = _candidate_lists(batch, groups, per_list, scores)
        _merge_best_kernel[(batch, groups)](
            best, best_scores, num_best, seq_lens, rows, *merged, best.stride(0),
            merged[0].stride(0), budget, num_recent, lists, LISTS_PER_GROUP=per_group,
            FINAL=False, BLOCK=triton.next_power_of_2(per_group * per_list), **shared, **finish,
        )  # fmt: skip
        (best, best_scores, num_best), lists = merged, groups
    _merge_best_kernel[(batch, 1)](
        best, best_scores, num_best, seq_lens, rows, selected, best_scores, num_selected,
        best.stride(0), selected.stride(0), budget, num_recent, lists, LISTS_PER_GROUP=lists,
        FINAL=True, BLOCK=triton.next_power_of_2(lists * per_list), **shared, **finish,
    )  # fmt: skip
    return selected, num_selected


def _candidate_lists(batch: int, lists: int, per_list: int, scores: torch.Tensor):
    """(unit ids, their scores, counts) of ``lists`` candidate lists per row."""
    device = scores.device
    return (
        torch.empty(batch, lists * per_list, dtype=torch.int32, device=device),
        torch.empty(batch, lists * per_list, dtype=scores.dtype, device=device),
        torch.empty(batch, lists, dtype=torch.int32, device=device),
    )
