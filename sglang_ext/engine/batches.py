"""Building a ForwardBatch that SGLang did not schedule: the cache correction's extend."""

from __future__ import annotations

import copy

import torch

from sglang_ext.policies.tidal.cache_correction import CorrectionPlan


def correction_batch(decode_batch, plan: CorrectionPlan, req_to_token: torch.Tensor):
    """An EXTEND ForwardBatch re-running the plan's tokens into their own cache slots."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    device = decode_batch.seq_lens.device
    lens = [len(ids) for ids in plan.token_ids]
    seq_lens = [start + n for start, n in zip(plan.starts, lens, strict=True)]
    positions = [
        p for start, end in zip(plan.starts, seq_lens, strict=True) for p in range(start, end)
    ]
    rows = [idx for idx, n in zip(plan.req_pool_indices, lens, strict=True) for _ in range(n)]
    start_loc = [sum(lens[:i]) for i in range(len(lens))]

    def to_device(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    positions_t = to_device(positions, torch.int64)
    batch = copy.copy(decode_batch)
    for name in _PER_BATCH_FIELDS:
        setattr(batch, name, None)
    batch.forward_mode = ForwardMode.EXTEND
    batch.batch_size = len(lens)
    batch.input_ids = to_device(
        [t for ids in plan.token_ids for t in ids], decode_batch.input_ids.dtype
    )
    batch.req_pool_indices = to_device(plan.req_pool_indices, decode_batch.req_pool_indices.dtype)
    batch.seq_lens = to_device(seq_lens, decode_batch.seq_lens.dtype)
    batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    batch.seq_lens_sum = sum(seq_lens)
    batch.orig_seq_lens = batch.seq_lens
    batch.positions = positions_t
    batch.out_cache_loc = req_to_token[to_device(rows, torch.int64), positions_t].to(
        decode_batch.out_cache_loc.dtype
    )
    batch.extend_num_tokens = len(positions)
    batch.extend_seq_lens = to_device(lens, torch.int32)
    batch.extend_prefix_lens = to_device(plan.starts, torch.int32)
    batch.extend_start_loc = to_device(start_loc, torch.int32)
    batch.extend_seq_lens_cpu = lens
    batch.extend_prefix_lens_cpu = list(plan.starts)
    batch.extend_logprob_start_lens_cpu = lens
    batch.num_token_non_padded_cpu = len(positions)
    batch.return_logprob = False
    batch.is_extend_in_batch = True
    return batch


# Decode-batch state a copy must not carry into the correction batch.
_PER_BATCH_FIELDS = (
    "sampling_info", "spec_info", "next_token_logits_buffer", "num_token_non_padded",
    "top_logprobs_nums", "token_ids_logprobs", "extend_input_logprob_token_ids_gpu",
    "global_num_tokens_cpu", "global_num_tokens_gpu", "global_num_tokens_for_logprob_cpu",
    "global_num_tokens_for_logprob_gpu", "original_global_num_tokens_cpu", "mm_inputs",
    "rids", "lora_ids",
)  # fmt: skip
