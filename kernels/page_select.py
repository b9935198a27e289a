"""Which pages (DELTA) or tokens (TidalDecode) the sparse layers attend to, from selection scores.

Per request with n = ceil(seq_len / page_size) pages (the last may be partial): keep the last
`num_recent` pages, plus the top (budget - num_recent) pages by score among the others; a request
with n <= budget keeps all n. Ties go to the lower page index (stable sort). The output has a fixed
shape, [batch, budget] int32 with the kept pages in ascending order then zeros, plus num_selected
[batch] int32: the input of sparse_decode_attention. It all runs on the device with no host sync,
so it can live inside a CUDA graph; short and long requests mix freely in one batch.
"""

from typing import Callable

import torch
import torch.nn.functional as F

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """DELTA's choice of K = budget pages with a recency window of L = num_recent pages.

    page_scores [batch, max_pages] (entries past a request's last page are ignored) ->
    (selected [batch, budget] int32, num_selected [batch] int32). ``by_importance`` orders the
    kept pages for ART's traversal instead of ascending: the recent pages, latest first, then
    the others by score, highest first. ``row_budget`` ([batch], each in [num_recent, budget])
    gives a request its own smaller K; the output keeps its width ``budget``. ``top_ranked``
    ranks the candidates (default: torch's topk, the oracle; see ``fastest_top_ranked``).
    """
    assert 0 <= num_recent <= budget, "the recency window must fit in the budget"
    max_pages = page_scores.shape[1]
    page_ids = torch.arange(max_pages, device=page_scores.device)
    num_pages = (seq_lens.long()[:, None] + page_size - 1) // page_size
    candidate = page_ids < num_pages - num_recent  # exists and is not recent
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


def fastest_top_ranked(device: torch.device | str) -> TopRanked:
    """FlashInfer's top-k on CUDA where it is installed (measured: benchmarks.kernel_bench's
    ``rank_*_ms`` rows), torch's elsewhere. FlashInfer's ragged top-k (each row's candidates only,
    ``rank_flashinfer_ragged_ms``) is faster alone but measured slower in the engine's decode step
    (RESULTS.md, 2026-11-24 A/B), so it is not used."""
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
