"""Selection-layer attention (DELTA and TidalDecode scores): Triton kernels vs their torch oracles.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (tests/kernel_device.py).
"""

import pytest
import torch
from kernel_cases import DEVICE, OUT_TOL, make_batch, selection_scores
from sglang_ext.kernels.selection_attention import (
    PAGE_SIZE,
    RetentionUpdate,
    ScoreRows,
    page_scores_ref,
    ragged_selection_attention,
    score_tokens,
    selection_attention_ref,
    tidal_token_scores_ref,
)

SCORE_TOL = {"atol": 1e-4, "rtol": 1e-3}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 3, 64), (4, 1, 32)])
def test_delta_selection_matches_reference(dtype, num_kv_heads, group, head_dim):
    batch, sm_scale = make_batch(dtype, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
    out, token_scores, page_scores = selection_scores(batch, sm_scale)
    out_ref, token_scores_ref = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[dtype])
    # assert_close also demands the same -inf padding.
    torch.testing.assert_close(token_scores, token_scores_ref, **SCORE_TOL)
    torch.testing.assert_close(page_scores, page_scores_ref(token_scores_ref), **SCORE_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tidal_selection_matches_reference(dtype):
    batch, sm_scale = make_batch(dtype)
    out, token_scores, _ = selection_scores(batch, sm_scale, use_probs=False)
    out_ref, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[dtype])
    expected = tidal_token_scores_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(token_scores, expected, atol=1e-3, rtol=1e-3)


def test_scores_are_padded_and_pages_may_be_partial():
    batch, sm_scale = make_batch(torch.float16)
    _, token_scores, page_scores = selection_scores(batch, sm_scale)
    assert token_scores.shape == (3, 96) and page_scores.shape == (3, 6)
    num_heads = batch["q"].shape[1]
    for b, seq_len in enumerate(batch["kv"].lengths.tolist()):
        tokens, pages = token_scores[b], page_scores[b]
        assert torch.isfinite(tokens).sum() == seq_len and torch.isfinite(tokens[:seq_len]).all()
        num_pages = -(-seq_len // PAGE_SIZE)
        assert torch.isfinite(pages).sum() == num_pages and torch.isfinite(pages[:num_pages]).all()
        last = (num_pages - 1) * PAGE_SIZE  # the last page sums only its real tokens
        torch.testing.assert_close(pages[num_pages - 1], tokens[last:seq_len].sum())
        # Each head's probabilities sum to 1, so their max over heads sums to [1, num_heads].
        assert 1 - 1e-4 <= tokens[:seq_len].sum() <= num_heads


def test_scores_are_written_to_the_end_of_each_requests_last_block_only():
    # 16-token blocks: rows of 64 tokens, requests of 5, 37 and 70 (all 64) tokens
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    lse = torch.logsumexp(logits, dim=-1)
    seq_lens = torch.tensor([5, 37, 70], dtype=torch.int32, device=DEVICE)
    tokens = torch.full((3, 64), float("nan"), device=DEVICE)
    pages = torch.full((3, 4), float("nan"), device=DEVICE)
    score_tokens(logits, lse, seq_lens, tokens, pages, block_t=16)
    for b, (seq_len, written) in enumerate([(5, 16), (37, 48), (64, 64)]):
        probs = torch.exp(logits[b, :, :seq_len] - lse[b, :, None]).amax(dim=0)
        torch.testing.assert_close(tokens[b, :seq_len], probs, **SCORE_TOL)
        assert (tokens[b, seq_len:written] == float("-inf")).all()
        assert tokens[b, written:].isnan().all()  # past the last block: untouched
        assert pages[b, written // PAGE_SIZE :].isnan().all()


def test_split_count_does_not_change_results():
    batch, sm_scale = make_batch(torch.float16)
    one_split = selection_scores(batch, sm_scale, num_kv_splits=1)
    for num_kv_splits in (3, 8):  # 8 leaves most splits of the short requests empty
        many_splits = selection_scores(batch, sm_scale, num_kv_splits=num_kv_splits)
        for got, expected in zip(many_splits, one_split):
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_output_matches_sglang_decode_kernel():
    # fp16 only: interpreted, SGLang's kernel hits the bf16 tl.dot bug that ours works around.
    # (The filtered warning is SGLang's kernel computing -inf - -inf in its padded head rows.)
    decode_attention = pytest.importorskip("sglang.kernels.ops.attention.decode_attention")
    batch, sm_scale = make_batch(torch.float16)
    kv = batch["kv"]
    seq_lens, num_splits = kv.lengths, 4
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    kv_indptr[1:] = seq_lens.cumsum(0)
    kv_indices = torch.cat([kv.table[r, :n] for r, n in zip(kv.rows, seq_lens)])
    q = batch["q"]
    expected = torch.empty_like(q)
    decode_attention.decode_attention_fwd(
        q,
        kv.k,
        kv.v,
        expected,
        kv_indptr,
        kv_indices,
        torch.empty(*q.shape[:2], num_splits, q.shape[2], device=DEVICE),
        torch.empty(*q.shape[:2], num_splits, device=DEVICE),
        torch.full((len(seq_lens),), num_splits, dtype=torch.int32, device=DEVICE),
        num_splits,
        sm_scale,
        1.0,
        1.0,
    )
    out, _, _ = selection_scores(batch, sm_scale)
    torch.testing.assert_close(out, expected, **OUT_TOL[torch.float16])


# DELTA's (probabilities, pages), Tidal's by q·k and Tidal's by probability (tokens only)
@pytest.mark.parametrize("use_probs, with_pages", [(True, True), (False, False), (True, False)])
def test_ragged_rows_hold_each_requests_scores_and_nothing_else(use_probs, with_pages):
    # rows of 5, 37 and 70 tokens start at pages 0, 1 and 4 of one long row and end on page 9:
    # buffers sized by the tokens a batch holds (120), not by batch x --context-length
    batch, sm_scale = make_batch(torch.float16)
    rows = ScoreRows(120, max_batch=4, num_q_heads=6, device=DEVICE, pages=with_pages)
    for buffer in (rows.logits, rows.tokens, rows.pages):
        if buffer is not None:
            buffer.fill_(float("nan"))
    rows.place(batch["kv"].lengths)
    assert rows.row_start[:3].tolist() == [0, 16, 64]
    out, tokens, pages = ragged_selection_attention(
        **batch, sm_scale=sm_scale, rows=rows, use_probs=use_probs
    )
    out_ref, probs_ref = selection_attention_ref(**batch, sm_scale=sm_scale)
    expected = probs_ref if use_probs else tidal_token_scores_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    for b, (start, seq_len) in enumerate([(0, 5), (16, 37), (64, 70)]):
        end = start + -(-seq_len // PAGE_SIZE) * PAGE_SIZE
        row = tokens[start:end]
        torch.testing.assert_close(row[:seq_len], expected[b, :seq_len], atol=1e-3, rtol=1e-3)
        assert (row[seq_len:] == float("-inf")).all()  # its last page's tail
        assert (pages is not None) == with_pages
        if with_pages:
            page_rows = pages[start // PAGE_SIZE : end // PAGE_SIZE]
            torch.testing.assert_close(page_rows, page_scores_ref(expected[b : b + 1, :seq_len])[0])
    assert tokens[144:].isnan().all()  # past the batch's rows: untouched
    assert pages is None or pages[144 // PAGE_SIZE :].isnan().all()


@pytest.mark.parametrize("use_probs", [True, False])
def test_the_scoring_pass_makes_an_evictions_update(use_probs):
    # one attention gives a selection layer under eviction its scores and Lethe's: each state
    # row decays and adds the probability its tokens received, summed over heads; nothing else
    batch, sm_scale = make_batch(torch.float16)
    rows = ScoreRows(120, max_batch=4, num_q_heads=6, device=DEVICE, pages=False)
    rows.place(batch["kv"].lengths)
    scores = torch.rand(5, 96, device=DEVICE)
    before, expected = scores.clone(), scores.clone()
    state_rows = torch.tensor([3, 0, 4], device=DEVICE)
    out, tokens, _ = ragged_selection_attention(
        **batch, sm_scale=sm_scale, rows=rows, use_probs=use_probs,
        retention=RetentionUpdate(scores, state_rows, 0.5),
    )  # fmt: skip
    out_ref, _ = selection_attention_ref(
        **batch, sm_scale=sm_scale, retention=RetentionUpdate(expected, state_rows, 0.5)
    )
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])
    torch.testing.assert_close(scores, expected, **SCORE_TOL)
    num_heads = batch["q"].shape[1]
    for b, seq_len in enumerate(batch["kv"].lengths.tolist()):
        row = int(state_rows[b])
        received = scores[row, :seq_len] - 0.5 * before[row, :seq_len]
        torch.testing.assert_close(received.sum(), torch.tensor(float(num_heads), device=DEVICE))
        assert scores[row, seq_len:].equal(before[row, seq_len:])  # past its tokens: untouched
    assert scores[1:3].equal(before[1:3])  # rows of no request in the batch


def test_a_batch_beyond_the_pool_gets_eager_buffers_of_its_size():
    rows = ScoreRows(100, max_batch=4, num_q_heads=2, device=DEVICE, pages=True)
    graphed = rows.tokens
    assert rows.reserve(100) and rows.tokens is graphed  # what CUDA graphs recorded
    assert graphed.shape[0] >= 100 + 4 * PAGE_SIZE  # each row rounded up to a page, padding too
    assert not rows.reserve(500)  # shared prefixes counted per request: too many for the graph
    grown = rows.tokens
    assert grown.shape[0] >= 500 + 4 * PAGE_SIZE and rows.logits.shape == (2, grown.shape[0])
    assert not rows.reserve(300) and rows.tokens is grown  # kept, not made again
    assert rows.reserve(10) and rows.tokens is graphed and rows.logits.shape[1] == graphed.shape[0]
