"""Lethe's retained-set decode attention and RASR score update vs its torch oracle.

Without CUDA the kernel runs under Triton's interpreter on CPU tensors (conftest.py).
"""

import dataclasses

import pytest
import torch
from kernel_cases import DEVICE, OUT_TOL, make_batch
from sglang_ext.kernels import rasr
from sglang_ext.kernels.rasr import (
    accumulate_selected, gather_retained_slots, gather_retained_slots_ref, pool_neighbours,
    retained_decode_ref, selected_decode_ref, shared_retained_decode, shared_retained_decode_ref,
    window_scores,
)
from sglang_ext.kernels.sparse_decode import SlotTable
from sglang_ext.kernels.selection_attention import selection_attention_ref

SEQ_LENS = (5, 37, 70)
MAX_CONTEXT = 96


def retained_state(batch, lists, num_rows):
    """positions/count/scores for every request slot: the batch's rows hold ``lists`` (ascending
    positions); other rows hold junk a kernel must not touch."""
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 5, (num_rows, MAX_CONTEXT), generator=gen, dtype=torch.int32)
    count = torch.full((num_rows,), 3, dtype=torch.int32)
    scores = torch.rand(num_rows, MAX_CONTEXT, generator=gen)
    for row, kept in zip(batch["kv"].rows.tolist(), lists, strict=True):
        positions[row, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
        count[row] = len(kept)
    return positions.to(DEVICE), count.to(DEVICE), scores.to(DEVICE)


def rows_table(batch, positions, count):
    """Per-layer memory's table: each request slot's list of KV rows (here its retained
    positions' slots), by request slot."""
    table = batch["kv"].table.gather(1, positions.long().clamp(max=MAX_CONTEXT - 1))
    return table.to(torch.int32), count


def run_both(dtype, lists, gamma=0.9, state_rows=None, extra_rows=0):
    """The kernel over a table of rows by request slot (per-layer memory's decode) against the
    torch path through the positions (the oracle chain: both name the same KV)."""
    batch, sm_scale = make_batch(dtype, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    kv = batch["kv"]
    num_rows = kv.table.shape[0]
    positions, count, scores = retained_state(batch, lists, num_rows + extra_rows)
    if extra_rows:
        count[num_rows:] = 0  # the trash row padded entries point at
        extended = torch.cat([kv.table, kv.table[:extra_rows]])
        batch["kv"] = kv = kv.through(extended, kv.rows, kv.lengths)
    rows = kv.rows.long() if state_rows is None else state_rows
    table, _ = rows_table(batch, positions, count)
    scores_ref, before = scores.clone(), scores.clone()
    logits = torch.empty(len(SEQ_LENS), batch["q"].shape[1], MAX_CONTEXT, device=DEVICE)
    out = shared_retained_decode(
        batch["q"], kv.through(table, rows, count[rows]), scores, rows, sm_scale, gamma, logits
    )
    out_ref = retained_decode_ref(
        **batch, positions=positions, count=count, scores=scores_ref, sm_scale=sm_scale,
        gamma=gamma, state_rows=rows,
    )  # fmt: skip
    return batch, before, (out, scores), (out_ref, scores_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_retaining_everything_is_full_attention(dtype):
    lists = [list(range(n)) for n in SEQ_LENS]
    batch, _, (out, scores), (_, scores_ref) = run_both(dtype, lists)
    full, _ = selection_attention_ref(**batch, sm_scale=batch["q"].shape[-1] ** -0.5)
    torch.testing.assert_close(out, full, **OUT_TOL[dtype])
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_retained_lists_match_reference_and_scores_accumulate(dtype):
    lists = [[0, 4], [0, 1, 2, 3, 20, 30, 36], [0, 1, *range(40, 70)]]
    batch, before, (out, scores), (out_ref, scores_ref) = run_both(dtype, lists, gamma=0.5)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[dtype])
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-4)
    for row, kept in zip(batch["kv"].rows.tolist(), lists, strict=True):
        # each query head's probabilities sum to 1 over the retained tokens; old scores halve
        heads = batch["q"].shape[1]
        assert scores[row, : len(kept)].sum().item() == pytest.approx(
            heads + 0.5 * before[row, : len(kept)].sum().item(), rel=1e-3
        )


def test_rows_outside_the_batch_and_padding_are_untouched():
    batch, sm_scale = make_batch(torch.float16, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    num_rows = batch["kv"].table.shape[0]
    state_rows = batch["kv"].rows.long().clone()
    state_rows[1] = num_rows  # entry 1 plays CUDA-graph padding
    lists = [list(range(n)) for n in SEQ_LENS]
    batch, before, (out, scores), (out_ref, scores_ref) = run_both(
        torch.float16, lists, state_rows=state_rows, extra_rows=1
    )
    touched = set(state_rows.tolist()) - {num_rows}
    for row in range(num_rows + 1):
        if row not in touched:
            assert torch.equal(scores[row], before[row]), row
    assert torch.count_nonzero(out[1]) == 0
    torch.testing.assert_close(out, out_ref, **OUT_TOL[torch.float16])


def test_the_table_reference_is_the_positions_reference_over_the_same_rows():
    batch, sm_scale = make_batch(torch.float32, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    lists = [[0, 4], [0, 1, 2, 3, 20, 30, 36], [0, 1, *range(40, 70)]]
    kv = batch["kv"]
    num_rows = kv.table.shape[0]
    positions, count, scores = retained_state(batch, lists, num_rows)
    table, _ = rows_table(batch, positions, count)
    rows = kv.rows.long()
    scores_ref = scores.clone()
    out = shared_retained_decode_ref(
        batch["q"], kv.through(table, rows, count[rows]), scores, rows, sm_scale, 0.5
    )
    out_ref = retained_decode_ref(
        **batch, positions=positions, count=count, scores=scores_ref, sm_scale=sm_scale, gamma=0.5
    )  # fmt: skip
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(scores, scores_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_list_for_every_layer_gathered_once_matches_the_reference(dtype):
    """The default path on CUDA: the lists' slots gathered into a table once per step, a layer's
    attention over it; entry 1 plays CUDA-graph padding (its state row holds nothing)."""
    batch, sm_scale = make_batch(dtype, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    kv = batch["kv"]
    num_rows = kv.table.shape[0]
    lists = [[0, 4], [0, 1, 2, 3, 20, 30, 36], [0, 1, *range(40, 70)]]
    positions, count, scores = retained_state(batch, lists, num_rows + 1)
    count[num_rows] = 0
    state_rows = kv.rows.long().clone()
    state_rows[1] = num_rows
    before, scores_ref = scores.clone(), scores.clone()
    size = len(SEQ_LENS) + 1  # buffers larger than the batch, as the runtime owns them
    table = torch.full((size, MAX_CONTEXT), -1, dtype=torch.int32, device=DEVICE)
    entry_count = torch.full((size,), -1, dtype=torch.int32, device=DEVICE)
    gather_retained_slots(kv.table, kv.rows, positions, count, state_rows, table, entry_count)
    table_ref, entry_count_ref = torch.full_like(table, -1), torch.full_like(entry_count, -1)
    gather_retained_slots_ref(
        kv.table, kv.rows, positions, count, state_rows, table_ref, entry_count_ref
    )  # fmt: skip
    assert torch.equal(table, table_ref) and torch.equal(entry_count, entry_count_ref)
    for b, (row, req) in enumerate(zip(state_rows.tolist(), kv.rows.tolist())):
        n = int(count[row])
        assert int(entry_count[b]) == n
        expected = kv.table[req, positions[row, :n].long()]
        assert torch.equal(table[b, :n], expected)
        assert bool((table[b, n:] == -1).all())
    logits = torch.empty(size, batch["q"].shape[1], MAX_CONTEXT, device=DEVICE)
    out = shared_retained_decode(
        batch["q"], kv.through(table, torch.arange(size, device=DEVICE), entry_count), scores,
        state_rows, sm_scale, 0.5, logits,
    )  # fmt: skip
    out_ref = retained_decode_ref(
        **batch, positions=positions, count=count, scores=scores_ref, sm_scale=sm_scale,
        gamma=0.5, state_rows=state_rows,
    )  # fmt: skip
    torch.testing.assert_close(out, out_ref, **OUT_TOL[dtype])
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[1]) == 0
    touched = {state_rows[0].item(), state_rows[2].item()}
    for row in set(range(num_rows + 1)) - touched:
        assert torch.equal(scores[row], before[row]), row


@pytest.mark.parametrize("gamma", [0.5, 1.0])
@pytest.mark.parametrize("entry_block, count_block", [(128, 256), (8, 2)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_selection_of_the_retained_entries_scores_as_its_reference(
    page_size, entry_block, count_block, gamma, monkeypatch
):
    """A sparse layer under eviction: attention over the selected entries (gathered as a
    SlotTable), every entry's score decayed and the selected ones' probabilities added; the last
    unit runs past a request's entries, and entry 1 plays CUDA-graph padding (no entries). Small
    blocks spread a request's entries over programs and its units over counting steps, each
    program finding where its block's selected entries were gathered."""
    monkeypatch.setattr(rasr, "_BLOCK_J", entry_block)
    monkeypatch.setattr(rasr, "_SELECTED_BLOCK", count_block)
    dtype = torch.float16
    batch, sm_scale = make_batch(dtype, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    kv = batch["kv"]
    size = len(SEQ_LENS) + 1  # buffers larger than the batch, as the runtime owns them
    entries = torch.tensor([30, 0, 45], dtype=torch.int32, device=DEVICE)
    table = kv.table[kv.rows.long()].contiguous()  # each entry's retained slots, by batch entry
    retained = kv.through(table, torch.arange(len(SEQ_LENS), device=DEVICE), entries)
    units = -(-45 // page_size)
    selected = torch.zeros(size, 8, dtype=torch.int32, device=DEVICE)
    selected[0, :3] = torch.tensor([0, 3, 30 // page_size - 1])
    selected[2, :4] = torch.tensor([0, 1, 5, units - 1])  # the last unit is partial for pages
    num_selected = torch.tensor([3, 0, 4, 0], dtype=torch.int32, device=DEVICE)
    state_rows = torch.tensor([2, size + 1, 0], device=DEVICE)  # 5: the trash row
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(size + 2, MAX_CONTEXT, generator=gen).to(DEVICE)
    before, scores_ref = scores.clone(), scores.clone()

    slot_table = SlotTable(size, 8 * page_size, DEVICE)
    slot_table.gather(retained, selected[:3], num_selected[:3], page_size)
    logits = torch.full((size, batch["q"].shape[1], MAX_CONTEXT), float("nan"), device=DEVICE)
    out, lse = slot_table.attend_with_lse(batch["q"], retained, sm_scale, logits=logits)
    accumulate_selected(
        logits, lse, selected[:3], num_selected[:3], page_size, entries, state_rows, scores, gamma
    )  # fmt: skip
    out_ref = selected_decode_ref(
        batch["q"], retained, selected, num_selected, page_size, scores_ref, state_rows,
        sm_scale, gamma,
    )  # fmt: skip
    torch.testing.assert_close(out[[0, 2]], out_ref[[0, 2]], **OUT_TOL[dtype])
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-4)
    heads = batch["q"].shape[1]
    for b, row in ((0, 2), (2, 0)):
        n = int(entries[b])
        # each head's probabilities sum to 1 over the selection; every old score decays
        assert scores[row, :n].sum().item() == pytest.approx(
            heads + gamma * before[row, :n].sum().item(), rel=1e-3
        )
        assert torch.equal(scores[row, n:], before[row, n:])  # past its entries: untouched
    for row in (1, 3, size + 1):
        assert torch.equal(scores[row], before[row]), row


def test_window_scores_are_causal_and_find_the_matching_key():
    gen = torch.Generator().manual_seed(2)
    seq_len, n, heads, dim = 20, 4, 4, 16
    keys = torch.randn(seq_len, 2, dim, generator=gen)
    queries = torch.randn(n, heads, dim, generator=gen) * 0.1
    queries[:, :, :] += 4 * keys[7, 0]  # every head of every query looks for position 7
    scores = window_scores(queries, keys, seq_len, dim**-0.5)
    assert scores.sum().item() == pytest.approx(n * heads, rel=1e-5)
    assert int(scores.argmax()) == 7
    # position 17 is seen by the queries at 17, 18 and 19, not by the one at 16; the heads of KV
    # head 0 (2 of 4) find it
    queries = torch.randn(n, heads, dim, generator=gen) * 0.1 + 4 * keys[17, 0]
    scores = window_scores(queries, keys, seq_len, dim**-0.5)
    assert 2.9 * 2 < scores[17].item() < 3 * heads


def test_pooling_gives_each_token_its_neighbours_best_score():
    scores = torch.tensor([0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(pool_neighbours(scores, 3), torch.tensor([5.0, 5, 5, 0, 1, 1, 1]))
    torch.testing.assert_close(pool_neighbours(scores, 5), torch.tensor([5.0, 5, 5, 5, 1, 1, 1]))
    assert pool_neighbours(scores, 1) is scores


def per_head_case(dtype, head_lists):
    """A table per KV head (lists per KV head): request b's KV head h reads the slots of
    positions ``head_lists[h][b]``; its scores a list per head. Returns the batch, its table
    [rows, KV heads, n] and lengths [batch, KV heads] by request slot, the scores, the rows."""
    batch, sm_scale = make_batch(dtype, seq_lens=SEQ_LENS, max_context=MAX_CONTEXT)
    kv = batch["kv"]
    num_rows, heads = kv.table.shape[0], kv.k.shape[1]
    table = torch.zeros(num_rows, heads, MAX_CONTEXT, dtype=torch.int32, device=DEVICE)
    lengths = torch.zeros(len(SEQ_LENS), heads, dtype=torch.int32, device=DEVICE)
    rows = kv.rows.long()
    for h, lists in enumerate(head_lists):
        for b, (row, kept) in enumerate(zip(rows.tolist(), lists, strict=True)):
            table[row, h, : len(kept)] = kv.table[row, kept]
            lengths[b, h] = len(kept)
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(num_rows, heads, MAX_CONTEXT, generator=gen).to(DEVICE)
    return batch, sm_scale, kv.through(table, rows, lengths), scores, rows


HEAD_LISTS = [
    [[0, 4], [0, 1, 2, 3, 20, 30, 36], [0, 1, *range(40, 70)]],
    [[1, 2, 3], [5, 36], [*range(0, 60, 3), 69]],
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_table_per_kv_head_matches_its_reference(dtype):
    batch, sm_scale, kv, scores, rows = per_head_case(dtype, HEAD_LISTS)
    scores_ref = scores.clone()
    logits = torch.empty(len(SEQ_LENS), batch["q"].shape[1], MAX_CONTEXT, device=DEVICE)
    out = shared_retained_decode(batch["q"], kv, scores, rows, sm_scale, 0.5, logits)
    out_ref = shared_retained_decode_ref(batch["q"], kv, scores_ref, rows, sm_scale, 0.5)
    torch.testing.assert_close(out, out_ref, **OUT_TOL[dtype])
    torch.testing.assert_close(scores, scores_ref, atol=1e-4, rtol=1e-4)


def test_each_kv_heads_list_is_what_its_query_group_reads_and_scores():
    """Per KV head, the reference is the one-list reference over that head's list, for its
    query group; each head's scores gain its group's probabilities only (they sum to the
    group's size)."""
    batch, sm_scale, kv, scores, rows = per_head_case(torch.float32, HEAD_LISTS)
    before = scores.clone()
    out = shared_retained_decode_ref(batch["q"], kv, scores, rows, sm_scale, 0.5)
    heads = kv.k.shape[1]
    group = batch["q"].shape[1] // heads
    for h in range(heads):
        one_list = kv.through(kv.table[:, h], rows, kv.lengths[:, h].contiguous())
        q_heads = slice(h * group, (h + 1) * group)
        alone = shared_retained_decode_ref(
            batch["q"][:, q_heads], dataclasses.replace(
                one_list, k=kv.k[:, h : h + 1], v=kv.v[:, h : h + 1]
            ), before[:, h].clone(), rows, sm_scale, 0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[:, q_heads], alone)
        for b, row in enumerate(rows.tolist()):
            n = int(kv.lengths[b, h])
            gained = scores[row, h, :n].sum() - 0.5 * before[row, h, :n].sum()
            assert gained.item() == pytest.approx(group, rel=1e-4)
