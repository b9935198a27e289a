"""Sparse decode attention over selected pages (DELTA) or tokens (TidalDecode) vs its torch oracle.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (tests/kernel_device.py).
"""

import pytest
import torch
from kernel_cases import DEVICE, OUT_TOL, make_batch, selection_scores
from sglang_ext.kernels.page_select import select_pages, select_tokens
from sglang_ext.kernels.selection_attention import ScoreRows, selection_attention_ref
from sglang_ext.kernels.sparse_decode import (
    SharedSlotTables,
    SlotTable,
    gather_selected_slots_ref,
    sparse_decode_attention,
    sparse_decode_attention_ref,
)

SEQ_LENS = (5, 37, 70)


def selection(rows, width):
    """Fixed-size selection buffers from per-request index lists. The entries past a request's count
    point at page 0: a kernel reading one would attend to page 0 twice and fail the comparison."""
    selected = torch.zeros((len(rows), width), dtype=torch.int32)
    for b, row in enumerate(rows):
        selected[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    counts = torch.tensor([len(row) for row in rows], dtype=torch.int32)
    return selected.to(DEVICE), counts.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_all_pages_selected_equals_full_attention(dtype):
    batch, sm_scale = make_batch(dtype)
    selected, count = selection([list(range(-(-n // 16))) for n in SEQ_LENS], width=6)
    out = sparse_decode_attention(**batch, selected=selected, num_selected=count, sm_scale=sm_scale)
    full_ref, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, full_ref, **OUT_TOL[dtype])
    full, _, _ = selection_scores(batch, sm_scale)
    torch.testing.assert_close(out, full, **OUT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selected_pages_match_reference(dtype):
    batch, sm_scale = make_batch(dtype)
    # Includes each request's partial last page (pages 0, 2 and 4) and an unsorted list.
    selected, count = selection([[0], [2, 0], [4, 1, 3]], width=4)
    out = sparse_decode_attention(**batch, selected=selected, num_selected=count, sm_scale=sm_scale)
    expected = sparse_decode_attention_ref(
        **batch, selected=selected, num_selected=count, sm_scale=sm_scale
    )
    torch.testing.assert_close(out, expected, **OUT_TOL[dtype])


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 3, 64), (1, 8, 128)])
def test_selected_tokens_match_reference(num_kv_heads, group, head_dim):
    batch, sm_scale = make_batch(
        torch.bfloat16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim
    )
    selected, count = selection([[4, 0], [36, 3, 20, 7, 8], list(range(69, 19, -1))], width=50)
    kwargs = dict(batch, selected=selected, num_selected=count, sm_scale=sm_scale, page_size=1)
    torch.testing.assert_close(
        sparse_decode_attention(**kwargs),
        sparse_decode_attention_ref(**kwargs),
        **OUT_TOL[torch.bfloat16],
    )


@pytest.mark.parametrize(
    "rows, page_size",
    [([[0], [2, 0], [4, 1, 3]], 16), ([[4, 0], [36, 3, 20, 7, 8], list(range(69, 19, -1))], 1)],
)
def test_a_slot_table_gathers_the_selection_and_attends_as_the_pages_do(
    rows, page_size, monkeypatch
):
    # pages: each request's partial last page, one mid-list (4 of 70 tokens); tokens unsorted
    from sglang_ext.kernels import split_kv_decode as skv

    batch, sm_scale = make_batch(torch.bfloat16)
    selected, count = selection(rows, width=50)
    heads, dim = batch["q"].shape[1], batch["q"].shape[2]
    # as few SMs as the interpreter's: a split count the last split's program may merge, on a GPU
    # too (a large one gives this small batch more splits, which stage 2 merges)
    monkeypatch.setattr(skv, "_num_sms", lambda device: 4)
    table = SlotTable(4, 50 * page_size, DEVICE, heads=(heads, 2, dim))
    assert table.workspace is not None  # owned up front: attend allocates nothing
    table.slots.fill_(-1)  # what a gather leaves past a count is never read
    table.gather(batch["kv"], selected, count, page_size)
    for b, slots in enumerate(gather_selected_slots_ref(batch["kv"], selected, count, page_size)):
        assert table.count[b] == len(slots)
        assert table.slots[b, : len(slots)].tolist() == slots.tolist()
    # a sparse layer reads under the short-list launch: its splits merged by the last one's
    # program, without stage 2's launch, where their count allows it
    assert 1 < table.workspace.splits[batch["q"].shape[0]] <= skv.MAX_MERGED_SPLITS
    monkeypatch.setattr(skv, "merge_splits", lambda *args: pytest.fail("stage 2 launched"))
    out = table.attend(**batch, sm_scale=sm_scale)
    expected = sparse_decode_attention_ref(
        **batch, selected=selected, num_selected=count, sm_scale=sm_scale, page_size=page_size
    )
    torch.testing.assert_close(out, expected, **OUT_TOL[torch.bfloat16])


def test_shared_tables_read_each_entry_from_its_own_readers_table():
    # three readers (a policy mix's members) in one storage: pages, tokens and no table
    batch, sm_scale = make_batch(torch.bfloat16)
    q, kv = batch["q"], batch["kv"]
    tables = SharedSlotTables(3, max_batch=4, device=DEVICE, heads=(6, 2, 64))
    readers = [SlotTable(4, n, DEVICE, share=tables.shares[i]) for i, n in enumerate((64, 50))]
    tables.allocate()  # the third reader took no table; the widest is the storage's width
    assert readers[0].slots.shape == (4, 64) == readers[1].slots.shape
    pages = selection([[0], [2, 0], [4, 1, 3]], width=4)
    tokens = selection([[4, 0], [36, 3, 20, 7, 8], list(range(69, 19, -1))], width=50)
    readers[0].gather(kv, *pages, 16)
    readers[1].gather(kv, *tokens, 1)
    tables.route(torch.tensor([1, 0, 2], device=DEVICE))
    logits = torch.full((3, 6, 96), float("nan"), device=DEVICE)
    out, lse = tables.attend(q, kv, sm_scale, logits=logits)
    assert not out[2].any() and lse[2].eq(float("-inf")).all()  # a reader without a table
    tables.route(torch.tensor([1, 0, 1], device=DEVICE))
    out, _ = tables.attend(q, kv, sm_scale, logits=logits)
    expected = [
        sparse_decode_attention_ref(**batch, selected=s, num_selected=n, sm_scale=sm_scale,
                                    page_size=size)
        for (s, n), size in ((pages, 16), (tokens, 1))
    ]  # fmt: skip
    for b, reader in enumerate([1, 0, 1]):
        torch.testing.assert_close(out[b], expected[reader][b], **OUT_TOL[torch.bfloat16])
    for b, n in enumerate([2, 16 + 5, 50]):  # logits by entry, as many as its own table holds
        assert readers[[1, 0, 1][b]].count[b] == n
        assert not logits[b, :, :n].isnan().any() and logits[b, :, n:].isnan().all()


def test_empty_selection_outputs_zeros():
    batch, sm_scale = make_batch(torch.float16)
    selected, count = selection([[], [1], []], width=2)
    out = sparse_decode_attention(**batch, selected=selected, num_selected=count, sm_scale=sm_scale)
    assert torch.isfinite(out).all() and not out[0].any() and not out[2].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_delta_and_tidal_steps_match_reference(dtype):
    batch, sm_scale = make_batch(dtype)
    _, _, page_scores = selection_scores(batch, sm_scale)
    selected, count = select_pages(page_scores, batch["kv"].lengths, budget=3, num_recent=1)
    kwargs = dict(batch, selected=selected, num_selected=count, sm_scale=sm_scale)
    torch.testing.assert_close(
        sparse_decode_attention(**kwargs), sparse_decode_attention_ref(**kwargs), **OUT_TOL[dtype]
    )

    _, token_scores, _ = selection_scores(batch, sm_scale, use_probs=False)
    selected, count = select_tokens(token_scores, batch["kv"].lengths, budget=20)
    kwargs = dict(batch, selected=selected, num_selected=count, sm_scale=sm_scale, page_size=1)
    torch.testing.assert_close(
        sparse_decode_attention(**kwargs), sparse_decode_attention_ref(**kwargs), **OUT_TOL[dtype]
    )


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_delta_step_replays_in_a_cuda_graph():
    batch, sm_scale = make_batch(torch.float16)
    rows = ScoreRows(256, max_batch=3, num_q_heads=batch["q"].shape[1], device=DEVICE, pages=True)

    def step():
        _, _, page_scores = selection_scores(batch, sm_scale, rows=rows)
        selected, count = select_pages(page_scores, batch["kv"].lengths, budget=3, num_recent=1)
        return sparse_decode_attention(
            **batch, selected=selected, num_selected=count, sm_scale=sm_scale
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    batch["kv"].lengths.copy_(torch.tensor([9, 50, 90]))  # next step: new lengths, new queries
    batch["q"].normal_()
    graph.replay()
    torch.testing.assert_close(graph_out, step(), atol=0, rtol=0)


def test_split_count_fills_the_gpu_without_splits_narrower_than_a_block():
    from sglang_ext.kernels.split_kv_decode import MAX_KV_SPLITS, num_kv_splits_for

    counts = {}  # off CUDA the rule assumes 4 SMs, so 16 programs fill it
    for batch in (1, 2, 8, 32, 64, 512):
        splits = num_kv_splits_for(batch, 2, 32768, "cpu")
        assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_KV_SPLITS
        counts[batch] = splits
    # a small batch gets many splits, a large one few; never more than the tokens' blocks
    assert counts[1] > counts[64] >= counts[512] == 1
    assert counts[1] == 8  # 8 splits x 2 KV heads = 16 programs
    assert num_kv_splits_for(1, 2, 64, "cpu") == 2  # 64 tokens: two blocks of 32


def test_workspace_and_indirect_rows_give_the_allocating_kernel_result():
    from sglang_ext.kernels.split_kv_decode import SplitKVWorkspace, split_kv_decode

    batch, sm_scale = make_batch(torch.bfloat16)
    n = len(SEQ_LENS)
    lists, _ = selection([[4, 0], [36, 3, 20, 7, 8], list(range(69, 19, -1))], width=50)
    # the lists in rows 3, 0, 1 of a larger table, picked by selected_rows
    table = torch.zeros((5, 50), dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([3, 0, 1], device=DEVICE)
    table[rows] = lists
    count = torch.tensor([2, 5, 50], dtype=torch.int32, device=DEVICE)
    common = dict(batch, sm_scale=sm_scale, num_selected=count)
    expected, expected_lse = split_kv_decode(**common, selected=lists, num_kv_splits=4)
    workspace = SplitKVWorkspace(8, 6, 2, 64, max_tokens=50, device=DEVICE)
    assert workspace.views(n)[0] == 2  # 50 tokens are two blocks: no more splits than that
    out, lse = split_kv_decode(**common, selected=table, selected_rows=rows, workspace=workspace)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_split_writes_the_result_itself_as_a_merge_of_several_would(dtype):
    from sglang_ext.kernels.split_kv_decode import SplitKVWorkspace, split_kv_decode

    batch, sm_scale = make_batch(dtype, seq_lens=(5, 0, 70))  # the empty row: zeros, LSE -inf
    expected, expected_lse = split_kv_decode(**batch, sm_scale=sm_scale, num_kv_splits=4)
    workspace = SplitKVWorkspace(4, 6, 2, 64, max_tokens=96, device=DEVICE, num_splits=1)
    out = torch.full_like(batch["q"], float("nan"))
    got, lse = split_kv_decode(**batch, sm_scale=sm_scale, workspace=workspace, out=out)
    assert got is out and not out[1].any() and lse[1].eq(float("-inf")).all()
    torch.testing.assert_close(out, expected, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_n,warps,stages", [(64, 8, 1), (64, 4, 3)])
def test_every_stage1_launch_computes_the_same_attention(block_n, warps, stages):
    """kernel_bench's tuning rows compare launches: each must compute what the oracle does."""
    from sglang_ext.kernels.split_kv_decode import Stage1Launch, split_kv_decode

    batch, sm_scale = make_batch(torch.bfloat16)
    launch = Stage1Launch(block_n, warps, stages)
    logits = torch.full((3, 6, 96), float("nan"), device=DEVICE)
    out, _ = split_kv_decode(**batch, sm_scale=sm_scale, logits=logits, launch=launch)
    expected, _ = selection_attention_ref(**batch, sm_scale=sm_scale)
    torch.testing.assert_close(out, expected, **OUT_TOL[torch.bfloat16])
    for b, n in enumerate(SEQ_LENS):  # every attended position's logits stored
        assert not logits[b, :, :n].isnan().any() and logits[b, :, n:].isnan().all()
    selected, count = selection([[0], [2, 0], [4, 1, 3]], width=4)
    sparse = sparse_decode_attention_ref(
        **batch, selected=selected, num_selected=count, sm_scale=sm_scale
    )
    out, _ = split_kv_decode(
        **batch, sm_scale=sm_scale, selected=selected, num_selected=count, selected_span=16,
        launch=launch,
    )  # fmt: skip
    torch.testing.assert_close(out, sparse, **OUT_TOL[torch.bfloat16])


def test_a_selection_split_over_few_programs_is_read_in_longer_tiles():
    """Many requests leave one split per (request, KV head) and a long run of tokens each: the
    64-token tile; a small batch splits the list finely, and 32-token tiles waste less."""
    from sglang_ext.kernels import split_kv_decode as skv

    assert skv.selected_launch(1024, 1) is skv.STAGE1_SELECTED_LONG
    assert skv.selected_launch(2048, 2).block_n == 64
    assert skv.selected_launch(1024, 2) is skv.STAGE1_SELECTED
    assert skv.selected_launch(256, 1).block_n == 32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_last_split_merges_as_the_merge_launch_does_and_resets_its_counters(dtype):
    """The last program of each (request, KV head) merges the splits; its counters return to 0,
    so a second call (a replayed graph's) merges again, the empty row included."""
    from sglang_ext.kernels.split_kv_decode import (
        STAGE1_SELECTED,
        Stage1Launch,
        SplitKVWorkspace,
        split_kv_decode,
    )

    batch, sm_scale = make_batch(dtype, seq_lens=(5, 0, 70))
    assert STAGE1_SELECTED.merge_in_last_split
    launch = Stage1Launch(32, 4, 2, merge_in_last_split=False)
    expected, expected_lse = split_kv_decode(
        **batch, sm_scale=sm_scale, num_kv_splits=4, launch=launch
    )
    workspace = SplitKVWorkspace(4, 6, 2, 64, max_tokens=96, device=DEVICE, num_splits=4)
    out = torch.empty_like(batch["q"])

    def decode():
        out.fill_(float("nan"))
        return split_kv_decode(
            **batch, sm_scale=sm_scale, workspace=workspace, out=out, launch=STAGE1_SELECTED
        )

    calls = [decode] * 2
    if DEVICE == "cuda":  # and as the engine replays it: from a CUDA graph
        decode()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, graph_lse = decode()
        calls += [lambda: (graph.replay(), (out, graph_lse))[1]] * 2
    for call in calls:
        _, lse = call()
        assert not workspace.arrivals(3).any()
        assert not out[1].any() and lse[1].eq(float("-inf")).all()
        torch.testing.assert_close(out, expected, **OUT_TOL[dtype])
        torch.testing.assert_close(lse, expected_lse, atol=1e-4, rtol=1e-4)
