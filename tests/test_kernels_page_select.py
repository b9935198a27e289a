"""Page (DELTA) and token (TidalDecode) selection against a plain-Python statement of the rule."""

import pytest
import torch
from kernel_cases import DEVICE
from sglang_ext.kernels import page_select
from sglang_ext.kernels.page_select import (
    fastest_top_ranked,
    flashinfer_top_ranked,
    select_pages,
    select_tokens,
    select_units_fused,
    torch_top_ranked,
    unit_chooser,
)


def expected_pages(scores, seq_len, budget, num_recent, page_size, num_sink=0):
    """All pages if they fit, else the last num_recent, the first num_sink and the best others
    (ties: lower index)."""
    num_pages = -(-seq_len // page_size)
    if num_pages <= budget:
        return list(range(num_pages))
    older = sorted(range(num_pages - num_recent), key=lambda p: (p >= num_sink, -scores[p], p))
    return sorted(older[: budget - num_recent] + list(range(num_pages - num_recent, num_pages)))


def check(scores, seq_lens, budget, num_recent, page_size=16, top_ranked=None, num_sink=0):
    scores = torch.tensor(scores, dtype=torch.float32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    selected, count = select_pages(
        scores, lens, budget, num_recent, page_size, top_ranked=top_ranked, num_sink=num_sink
    )
    assert (
        selected.shape == (len(seq_lens), budget) and selected.dtype == count.dtype == torch.int32
    )
    for row, n, seq_len, row_scores in zip(
        selected.tolist(), count.tolist(), seq_lens, scores.tolist()
    ):
        assert row[:n] == expected_pages(
            row_scores, seq_len, budget, num_recent, page_size, num_sink
        )
        assert row[n:] == [0] * (budget - n)
    return selected, count


def test_mixed_batch_with_many_ties_matches_rule():
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 5, 16, 17, 37, 70, 96, 300, 513]  # short and long requests side by side
    for _ in range(20):
        scores = torch.randint(
            0, 4, (len(seq_lens), 40), generator=gen
        ).float()  # few values: many ties
        check(scores.tolist(), seq_lens, budget=6, num_recent=2)


def test_signed_and_infinite_scores_rank_by_value():
    # Tidal scores are logits: negative, and ties among negatives, must order like the floats.
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        scores = torch.randint(-3, 3, (4, 40), generator=gen).float() * 0.75
        scores[0, 3] = float("-inf")
        scores[1, 5] = -0.0
        check(scores.tolist(), [640, 300, 45, 17], budget=7, num_recent=1)


def test_sinks_are_kept_ahead_of_better_scored_units():
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        scores = torch.randint(-3, 3, (5, 40), generator=gen).float()
        scores[:, :3] = -100.0  # the sinks score worst: only the rule keeps them
        check(scores.tolist(), [640, 300, 45, 17, 3], budget=7, num_recent=1, num_sink=3)
    selected, _ = check([[0.0, 1.0, 5.0, 4.0, 3.0, 2.0]], [6], 3, 1, page_size=1, num_sink=1)
    assert selected.tolist() == [[0, 2, 5]]  # the sink, the best, the current token


ON_FLASHINFER = fastest_top_ranked(DEVICE) is flashinfer_top_ranked


@pytest.mark.skipif(not ON_FLASHINFER, reason="FlashInfer's top-k needs CUDA and flashinfer")
def test_flashinfer_top_k_keeps_the_rule_ties_and_widths_included():
    gen = torch.Generator().manual_seed(2)
    seq_lens = [1, 17, 300, 640, 5000, 33000]  # a Tidal row: every token of a long request
    for _ in range(5):
        scores = torch.randint(-3, 3, (len(seq_lens), 33000), generator=gen).float() * 0.75
        scores[2, 7] = float("-inf")
        check(scores.tolist(), seq_lens, 1024, 1, 1, top_ranked=flashinfer_top_ranked)
        check(scores[:, :2100].tolist(), seq_lens, 64, 8, 16, top_ranked=flashinfer_top_ranked)
    # each request's own smaller budget keeps the first of the ranking
    scores = torch.rand(3, 4000, device=DEVICE)
    lens = torch.tensor([4000, 2500, 100], dtype=torch.int32, device=DEVICE)
    own = torch.tensor([300, 1024, 50], device=DEVICE)
    for by_importance in (False, True):
        ours = select_pages(scores, lens, 1024, 1, 1, by_importance, own, flashinfer_top_ranked)
        oracle = select_pages(scores, lens, 1024, 1, 1, by_importance, own, torch_top_ranked)
        assert torch.equal(ours[0], oracle[0]) and torch.equal(ours[1], oracle[1])


@pytest.mark.skipif(DEVICE != "cuda", reason="long rows: minutes under the interpreter")
def test_fused_selection_keeps_the_rule_over_the_widest_rows():
    gen = torch.Generator().manual_seed(4)
    lens = torch.tensor([1, 17, 300, 640, 5000, 8192], dtype=torch.int32, device=DEVICE)
    widest = page_select.FUSED_MAX_UNITS
    scores = (torch.randint(-3, 3, (len(lens), widest), generator=gen).float() * 0.75).to(DEVICE)
    own = torch.tensor([1024, 7, 1024, 300, 1024, 513], device=DEVICE)
    assert_fused_matches_oracle(scores, lens, 1024, 1, 1)  # Tidal at 8k: every token
    assert_fused_matches_oracle(scores, lens, 1024, 1, 1, own)
    pages = torch.rand(len(lens), widest, device=DEVICE)  # DELTA at 128k
    assert_fused_matches_oracle(pages, lens * 16, 64, 8, 16)
    # Tidal at 64k: eight chunks' best
    wide = (torch.randint(-3, 3, (len(lens), 8 * widest), generator=gen).float() * 0.75).to(DEVICE)
    wide_lens = [3, 8193, 20000, 40000, 60000, 65536]
    wide_lens = torch.tensor(wide_lens, dtype=torch.int32, device=DEVICE)
    assert_fused_matches_oracle(wide, wide_lens, 1024, 1, 1)
    assert_fused_matches_oracle(wide, wide_lens, 1024, 1, 1, own)


@pytest.mark.skipif(not ON_FLASHINFER, reason="FlashInfer's top-k needs CUDA and flashinfer")
def test_flashinfer_top_k_never_ranks_what_lies_past_a_request():
    # NaN past each request's end: a top-k over the unmasked row would rank it
    scores = torch.rand(4, 5000, device=DEVICE)
    lens = torch.tensor([5000, 2000, 700, 3], dtype=torch.int32, device=DEVICE)
    for b, n in enumerate(lens.tolist()):
        scores[b, n:] = float("nan")
    ours = select_tokens(scores, lens, budget=513, top_ranked=flashinfer_top_ranked)
    oracle = select_tokens(scores.nan_to_num(-1.0), lens, budget=513, top_ranked=torch_top_ranked)
    assert torch.equal(ours[0], oracle[0]) and torch.equal(ours[1], oracle[1])


def assert_fused_matches_oracle(scores, lens, budget, num_recent, page_size, own=None, num_sink=0):
    oracle = select_pages(
        scores, lens, budget, num_recent, page_size, row_budget=own, num_sink=num_sink
    )
    selected = torch.full((len(lens) + 1, budget), -7, dtype=torch.int32, device=DEVICE)
    count = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device=DEVICE)
    # written in place into rows of larger buffers, as the decoder's
    out = (selected[1:], count[1:])
    select_units_fused(scores, lens, budget, num_recent, page_size, own, out=out, num_sink=num_sink)
    assert torch.equal(selected[1:], oracle[0]) and torch.equal(count[1:], oracle[1])
    assert (selected[0] == -7).all() and count[0] == -7
    # the same rows laid out ragged (as ScoreRows holds them), NaN around each row
    ragged, row_start = ragged_copy(scores, lens, page_size)
    width = scores.shape[1]
    chosen = select_units_fused(
        ragged, lens, budget, num_recent, page_size, own, row_start=row_start, width=width,
        num_sink=num_sink,
    )  # fmt: skip
    assert torch.equal(chosen[0], oracle[0]) and torch.equal(chosen[1], oracle[1])


def ragged_copy(scores, lens, page_size):
    """(one row holding each request's units from row_start[b] / page_size on, row_start in
    tokens: page-aligned, a page apart), NaN elsewhere."""
    units = [min(-(-n // page_size), scores.shape[1]) for n in lens.tolist()]
    starts, end = [], 16
    for n in units:
        starts.append(end)
        end += -(-n * page_size // 16) * 16 + 16
    ragged = torch.full((end // page_size,), float("nan"), device=DEVICE)
    for b, (start, n) in enumerate(zip(starts, units)):
        ragged[start // page_size : start // page_size + n] = scores[b, :n]
    return ragged, torch.tensor(starts, dtype=torch.int64, device=DEVICE)


def test_ragged_rows_rank_as_dense_ones_on_the_top_k_path():
    gen = torch.Generator().manual_seed(6)
    lens = torch.tensor([1, 40, 300, 513], dtype=torch.int32, device=DEVICE)
    scores = torch.randint(-3, 3, (len(lens), 600), generator=gen).float().to(DEVICE) * 0.75
    for page_size, width in ((1, 600), (16, 40)):
        ragged, row_start = ragged_copy(scores[:, :width], lens, page_size)
        # ART's importance order is made by the top-k path, over dense copies of the rows
        choose = unit_chooser(DEVICE, 9, 2, page_size, True, row_start=row_start, width=width)
        oracle = select_pages(scores[:, :width], lens, 9, 2, page_size, by_importance=True)
        chosen = choose(ragged, lens)
        assert torch.equal(chosen[0], oracle[0]) and torch.equal(chosen[1], oracle[1])


def test_fused_selection_keeps_the_rule():
    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 5, 16, 17, 37, 300, 513, 600], dtype=torch.int32, device=DEVICE)
    ties = torch.randint(-3, 3, (len(lens), 600), generator=gen).float().to(DEVICE) * 0.75
    ties[0, 0], ties[5, 3], ties[6, 5] = float("-inf"), float("-inf"), -0.0
    own = torch.tensor([1, 2, 3, 4, 5, 6, 40, 2], dtype=torch.float32, device=DEVICE)
    assert_fused_matches_oracle(ties, lens, 40, 1, 1, own)  # tokens, each row its own budget
    assert_fused_matches_oracle(ties, lens, 7, 0, 1)  # no recency window
    assert_fused_matches_oracle(ties[:, :40], lens, 6, 2, 16)  # pages
    assert_fused_matches_oracle(ties[:, :40], lens, 3, 3, 16)  # recent pages only
    ties[:, :4] = -9.0  # sinks that no score would keep
    assert_fused_matches_oracle(ties, lens, 40, 1, 1, own, num_sink=4)
    assert_fused_matches_oracle(ties[:, :40], lens, 6, 2, 16, num_sink=1)


def test_keys_alike_but_for_their_low_bits_rank_exactly():
    # every key shares its top bytes: the threshold is found in its last bits; negative ones too
    gen = torch.Generator().manual_seed(11)
    lens = torch.tensor([3, 90, 257, 600], dtype=torch.int32, device=DEVICE)
    steps = torch.randint(0, 300, (len(lens), 600), generator=gen).float()
    near = (1.0 + steps * 2.0**-23).to(DEVICE)
    assert_fused_matches_oracle(near, lens, 40, 1, 1)
    assert_fused_matches_oracle(-near, lens, 40, 1, 1)
    assert_fused_matches_oracle(near[:, :40], lens, 6, 2, 16)


def test_distinct_scores_stop_the_search_early_and_rank_exactly():
    # no ties: the threshold search stops as soon as exactly the wanted number lie above it
    gen = torch.Generator().manual_seed(12)
    lens = torch.tensor([2, 41, 90, 257, 600, 600], dtype=torch.int32, device=DEVICE)
    distinct = torch.rand(len(lens), 600, generator=gen).to(DEVICE)
    distinct[5] = torch.randperm(600, generator=gen).float() - 300.0  # integers, signed
    own = torch.tensor([1, 40, 2, 17, 39, 40], dtype=torch.float32, device=DEVICE)
    assert_fused_matches_oracle(distinct, lens, 40, 1, 1, own)
    assert_fused_matches_oracle(-distinct, lens, 40, 1, 1)
    assert_fused_matches_oracle(distinct[:, :40], lens, 6, 2, 16, num_sink=1)


def test_wide_rows_choose_among_each_chunks_best(monkeypatch):
    # 64-unit chunks stand in for 8192-unit ones: rows of up to twenty chunks, ties across chunks
    monkeypatch.setattr(page_select, "FUSED_MAX_UNITS", 64)
    gen = torch.Generator().manual_seed(5)
    lens = [1, 60, 64, 65, 130, 200, 300, 640, 1000, 1280]
    lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ties = torch.randint(-3, 3, (len(lens), 1280), generator=gen).float().to(DEVICE) * 0.75
    ties[3, 64], ties[6, 5], ties[7, 100] = float("-inf"), -0.0, float("-inf")
    own = torch.tensor([1, 2, 13, 4, 5, 13, 9, 3, 13, 7], dtype=torch.float32, device=DEVICE)
    # 12 candidates a list: 5 lists a merge, 20 chunks -> 4 lists -> the choice
    assert_fused_matches_oracle(ties, lens, 13, 1, 1)
    assert_fused_matches_oracle(ties, lens, 13, 1, 1, own)
    assert_fused_matches_oracle(ties[:, :300], lens.clamp(max=300), 12, 0, 1)  # no recency window
    assert_fused_matches_oracle(ties, lens, 3, 3, 1)  # recent units only: nothing to choose
    assert_fused_matches_oracle(ties, lens * 2, 7, 2, 2)  # units of two tokens
    # 32 candidates a list, two lists a merge: 20 -> 10 -> 5 -> 3 -> 2 -> the choice
    assert_fused_matches_oracle(ties, lens, 33, 1, 1, own * 2)
    ties[:, :5] = -9.0  # sinks that no score would keep survive every merge
    assert_fused_matches_oracle(ties, lens, 13, 1, 1, num_sink=5)
    assert_fused_matches_oracle(ties, lens, 33, 1, 1, own * 2, num_sink=12)


def test_few_candidates_spread_a_row_over_narrower_chunks(monkeypatch):
    # DELTA's 56 candidates take 1024-page chunks (a 32k request: two programs, not one 8192-page
    # pass); Tidal's ~1k keep the widest
    assert page_select.chunk_units(56) == 1024 and page_select.chunk_units(1023) == 8192
    monkeypatch.setattr(page_select, "FUSED_MAX_UNITS", 64)
    monkeypatch.setattr(page_select, "MIN_CHUNK_UNITS", 8)
    assert page_select.chunk_units(2) == 32 and page_select.chunk_units(12) == 64
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([1, 31, 32, 33, 100, 200], dtype=torch.int32, device=DEVICE)
    ties = torch.randint(-3, 3, (len(lens), 200), generator=gen).float().to(DEVICE) * 0.75
    own = torch.tensor([1, 3, 2, 3, 3, 2], dtype=torch.float32, device=DEVICE)
    # 2 candidates a list: 32-unit chunks, 7 of them, one merge
    assert_fused_matches_oracle(ties, lens, 3, 1, 1)
    assert_fused_matches_oracle(ties, lens, 3, 1, 1, own)
    assert_fused_matches_oracle(ties, lens * 16, 4, 2, 16, num_sink=1)


def test_choices_wider_than_a_merge_holds_take_the_top_k_path(monkeypatch):
    monkeypatch.setattr(page_select, "FUSED_MAX_UNITS", 64)
    scores = torch.rand(2, 200, device=DEVICE)
    lens = torch.tensor([200, 100], dtype=torch.int32, device=DEVICE)
    # merges take at least two lists of (budget - num_recent) candidates
    assert page_select.fused_fits(200, 33, 1) and not page_select.fused_fits(200, 34, 1)
    assert page_select.fused_fits(64, 64, 0)  # one pass holds the whole row
    with pytest.raises(ValueError, match="at most 64 units, or 32 to choose"):
        select_units_fused(scores, lens, 34, 1, 1)
    chosen = unit_chooser(DEVICE, 34, 1, 1, by_importance=False)(scores, lens)
    oracle = select_tokens(scores, lens, budget=34)
    assert torch.equal(chosen[0], oracle[0]) and torch.equal(chosen[1], oracle[1])


def test_ties_go_to_the_lower_page():
    selected, count = check([[1.0] * 10], [160], budget=4, num_recent=1)
    assert selected.tolist() == [[0, 1, 2, 9]] and count.tolist() == [4]


def test_requests_within_budget_keep_every_page():
    _selected, count = check([[5.0, 1.0, 3.0, 0.0]] * 3, [1, 33, 64], budget=4, num_recent=2)
    assert count.tolist() == [1, 3, 4]


def test_partial_last_page_counts_as_recent():
    # 33 tokens: pages 0 and 1 full, page 2 holds one token and is kept as the recency window.
    selected, _ = check([[1.0, 2.0, 0.0, 9.0]], [33], budget=2, num_recent=1)
    assert selected.tolist() == [[1, 2]]


def test_scores_past_the_last_page_are_ignored():
    big = float("inf")
    selected, count = check([[0.0, 1.0, 0.5, big, big, big]], [48], budget=2, num_recent=1)
    assert selected.tolist() == [[1, 2]] and count.tolist() == [2]


def test_score_rows_narrower_than_the_budget_are_padded():
    selected, count = check([[1.0, 2.0]], [20], budget=5, num_recent=1)
    assert selected.tolist() == [[0, 1, 0, 0, 0]] and count.tolist() == [2]


@pytest.mark.parametrize("num_recent", [0, 3])
def test_budget_of_recent_pages_only_or_none(num_recent):
    check([[3.0, 1.0, 2.0, 0.0, 5.0, 4.0]], [96], budget=3, num_recent=num_recent)


def test_tokens_keep_the_current_one_and_the_top_scored():
    scores = torch.tensor([[0.0, 9.0, 1.0, 8.0, 2.0, 0.5, 7.0, 0.0]], device=DEVICE)
    selected, count = select_tokens(scores, torch.tensor([7], device=DEVICE), budget=3)
    assert selected.tolist() == [[1, 3, 6]] and count.tolist() == [3]  # token 6 is the current one
    selected, count = select_tokens(scores, torch.tensor([6], device=DEVICE), budget=3)
    assert selected.tolist() == [[1, 3, 5]] and count.tolist() == [3]


@pytest.mark.parametrize("by_importance", [False, True])
def test_each_request_may_select_a_smaller_budget_of_its_own(by_importance):
    """A row's budget selects as a call with that budget would, padded to the server's."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [20, 300, 513, 513, 700]
    row_budget = [6, 2, 4, 6, 3]
    scores = torch.rand(len(seq_lens), 48, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    own = torch.tensor(row_budget, dtype=torch.float32, device=DEVICE)  # as the request table holds it
    selected, count = select_pages(scores, lens, 6, 2, 16, by_importance, row_budget=own)
    assert selected.shape == (5, 6)
    for b, budget in enumerate(row_budget):
        alone, alone_count = select_pages(scores[b : b + 1], lens[b : b + 1], budget, 2, 16, by_importance)
        n = int(alone_count)
        assert int(count[b]) == n and selected[b, :n].tolist() == alone[0, :n].tolist()
        assert selected[b, n:].tolist() == [0] * (6 - n)


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs only show on a GPU")
def test_selection_never_syncs_with_the_host():
    scores = torch.rand(4, 64, device=DEVICE)
    seq_lens = torch.tensor([5, 100, 700, 1000], dtype=torch.int32, device=DEVICE)
    select_pages(scores, seq_lens, budget=8, num_recent=2)  # warm up
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_pages(scores, seq_lens, budget=8, num_recent=2)
        select_tokens(scores, seq_lens, budget=8)
        select_pages(scores, seq_lens, budget=8, num_recent=2, row_budget=seq_lens // 100 + 2)
        select_tokens(scores, seq_lens, budget=8, top_ranked=fastest_top_ranked(DEVICE))
        unit_chooser(DEVICE, 8, 2, 16, by_importance=False)(scores, seq_lens, seq_lens // 100 + 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
