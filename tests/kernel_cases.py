"""Shared by the kernel tests. Where they run: on CUDA when there is one, else on CPU tensors under Triton's
interpreter (conftest.py switches it on before anything imports triton).
"""

import os

import torch
from sglang_ext.kernels.kv_view import KVView

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Kernel outputs against the fp32 torch references.
OUT_TOL = {
    torch.float16: {"atol": 5e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


def make_batch(dtype, seq_lens=(5, 37, 70), num_kv_heads=2, group=3, head_dim=64, max_context=96):
    """A decode batch in SGLang's layout: shuffled request pool rows, scattered token slots, as
    the kernels' leading arguments: {"q": q, "kv": KVView}, and the softmax scale."""
    gen = torch.Generator().manual_seed(0)
    num_rows = len(seq_lens) + 1
    num_slots = num_rows * max_context + 7
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: num_rows * max_context]
    req_to_token = slots.view(num_rows, max_context)
    kv = KVView(
        k_buffer.to(DEVICE),
        v_buffer.to(DEVICE),
        req_to_token.int().to(DEVICE),
        torch.randperm(num_rows, generator=gen)[: len(seq_lens)].int().to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )
    return {"q": q.to(DEVICE), "kv": kv}, head_dim**-0.5


def selection_scores(batch, sm_scale, use_probs=True, rows=None, num_kv_splits=None):
    """A selection layer as the engine runs it (ragged score rows, placed for the batch): (out,
    token scores [batch, context], page scores [batch, context / 16] or None), the scores as
    dense rows, -inf past each request's tokens or pages."""
    from sglang_ext.kernels.page_select import dense_rows
    from sglang_ext.kernels.selection_attention import (
        PAGE_SIZE,
        ScoreRows,
        ragged_selection_attention,
    )

    seq_lens, width = batch["kv"].lengths, batch["kv"].table.shape[1]
    if rows is None:
        fits = int(seq_lens.sum())
        rows = ScoreRows(fits, len(seq_lens), batch["q"].shape[1], DEVICE, pages=use_probs)
    rows.place(seq_lens)
    out, tokens, pages = ragged_selection_attention(
        **batch, sm_scale=sm_scale, rows=rows, use_probs=use_probs, num_kv_splits=num_kv_splits
    )
    tokens = dense_rows(tokens, rows.row_start, seq_lens, width, 1)
    if pages is not None:
        pages = dense_rows(pages, rows.row_start, seq_lens, -(-width // PAGE_SIZE), PAGE_SIZE)
    return out, tokens, pages
