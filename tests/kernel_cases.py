"""Shared by the kernel tests. Where they run: on CUDA when there is one, else on CPU tensors under Triton's
interpreter (conftest.py switches it on before anything imports triton).
"""

import os

import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Kernel outputs against the fp32 torch references.
OUT_TOL = {
    torch.float16: {"atol": 5e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


def make_batch(dtype, seq_lens=(5, 37, 70), num_kv_heads=2, group=3, head_dim=64, max_context=96):
    """A decode batch in SGLang's layout: shuffled request pool rows, scattered token slots."""
    gen = torch.Generator().manual_seed(0)
    num_rows = len(seq_lens) + 1
    num_slots = num_rows * max_context + 7
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[: num_rows * max_context]
    req_to_token = slots.view(num_rows, max_context)
    batch = {
        "q": q,
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "req_to_token": req_to_token.int(),
        "req_pool_indices": torch.randperm(num_rows, generator=gen)[: len(seq_lens)].int(),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }
    return {name: t.to(DEVICE) for name, t in batch.items()}, head_dim**-0.5
