"""Which pages (DELTA) or tokens (TidalDecode) the sparse layers attend to, from selection scores.

Per request with n = ceil(seq_len / page_size) pages (the last may be partial): keep the last
`num_recent` pages, plus the top (budget - num_recent) pages by score among the others; a request
with n <= budget keeps all n. Ties go to the lower page index (stable sort). The output has a fixed
shape, [batch, budget] int32 with the kept pages in ascending order then zeros, plus num_selected
[batch] int32: the input of sparse_decode_attention. It all runs on the device with no host sync,
so it can live inside a CUDA graph; short and long requests mix freely in one batch.
"""

import torch
import torch.nn.functional as F


def select_pages(
    page_scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: int,
    num_recent: int,
    page_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DELTA's choice of K = budget pages with a recency window of L = num_recent pages.

    page_scores [batch, max_pages] (entries past a request's last page are ignored) ->
    (selected [batch, budget] int32, num_selected [batch] int32).
    """
    assert 0 <= num_recent <= budget, "the recency window must fit in the budget"
    max_pages = page_scores.shape[1]
    page_ids = torch.arange(max_pages, device=page_scores.device)
    num_pages = (seq_lens.long()[:, None] + page_size - 1) // page_size
    exists = page_ids < num_pages
    recent = exists & (page_ids >= num_pages - num_recent)
    candidate = exists & ~recent
    # Non-candidates rank last at -inf. Among equal scores the stable sort keeps the lower index
    # first, and non-candidates all have higher indices than candidates, so never displace one.
    ranked = torch.where(candidate, page_scores, float("-inf"))
    top = ranked.sort(dim=1, descending=True, stable=True).indices[:, : budget - num_recent]
    keep = recent | (torch.zeros_like(candidate).scatter_(1, top, True) & candidate)

    ascending = torch.where(keep, page_ids, max_pages).sort(dim=1).values[:, :budget]
    selected = torch.where(ascending < max_pages, ascending, 0).int()
    if selected.shape[1] < budget:
        selected = F.pad(selected, (0, budget - selected.shape[1]))
    return selected, keep.sum(dim=1, dtype=torch.int32)


def select_tokens(
    token_scores: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: int,
    num_recent: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TidalDecode's top-`budget` tokens by score, always keeping the last `num_recent` tokens.

    By default that is the token being decoded, which TidalDecode's kernels attend to outside the
    top-k. Same output format as select_pages, for sparse_decode_attention with page_size=1.
    """
    return select_pages(token_scores, seq_lens, budget, num_recent, page_size=1)
