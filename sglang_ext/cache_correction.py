"""KV cache correction (TidalDecode, Sec. 3.2): every T decode steps, a prefill with full attention
over a request's tokens decoded since its last correction overwrites their K/V in place.

A sparsely decoded token's K/V in the layers past the first selection layer come from sparse
attention; they drift from what full attention would have stored, and every later token reads
them. The correction re-runs those tokens as an extend whose prefix is the request's cache and
whose output slots are the tokens' own slots, so SGLang's own extend path (full attention, the
model's own layers) recomputes and overwrites their K/V; its logits are discarded.

Two SGLang hooks (sglang.srt.plugins.HookRegistry), installed only when the served policy asks
for correction:
- after ``ForwardBatch.init_new``, which still sees the scheduler's requests, a decode batch gets a
  host-side plan: which requests are due, their positions and token ids (a request is due once T
  tokens were decoded since its last correction; prompt positions came from a full-attention
  prefill and are never re-filled);
- around ``ModelRunner.forward``, a decode batch with a plan first runs the correction extend.
The plan is built from host data only, so the decode step itself stays free of host syncs and
keeps its CUDA graph.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

logger = logging.getLogger(__name__)

PLAN_ATTR = "sglang_ext_correction"  # on a ForwardBatch: its CorrectionPlan
CORRECTED_ATTR = "sglang_ext_corrected_until"  # on a Req: positions before it were re-filled
_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


@dataclasses.dataclass(frozen=True)
class CorrectionPlan:
    """Per due request: its request slot, first re-filled position, and the token ids from there
    up to (not including) the token being decoded."""

    req_pool_indices: list[int]
    starts: list[int]
    token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


@dataclasses.dataclass
class CorrectionStats:
    rounds: int = 0
    requests: int = 0
    tokens: int = 0


STATS = CorrectionStats()
_installed = False


def plan_correction(reqs, seq_lens_cpu, interval: int) -> CorrectionPlan | None:
    """The corrections due in a decode batch; ``seq_lens_cpu`` counts the token being decoded.

    A request is due once ``interval`` of its tokens past the prompt and past its last correction
    are on the host (under overlap scheduling the host learns a token a step late, so a round
    waits for it rather than skip it). The request remembers how far it was corrected.
    """
    pool_indices, starts, token_ids = [], [], []
    for req, seq_len in zip(reqs, seq_lens_cpu.tolist(), strict=True):
        prompt_len = len(req.origin_input_ids)
        start = max(prompt_len, getattr(req, CORRECTED_ATTR, 0))
        end = min(seq_len - 1, prompt_len + len(req.output_ids))  # cached and known on the host
        if end - start < interval:
            continue
        pool_indices.append(req.req_pool_idx)
        starts.append(start)
        token_ids.append(list(req.output_ids[start - prompt_len : end - prompt_len]))
        setattr(req, CORRECTED_ATTR, end)
    return CorrectionPlan(pool_indices, starts, token_ids) if pool_indices else None


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


def install(interval: int) -> None:
    """Register the two hooks (from the plugin, before SGLang applies hooks); once per process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _installed
    if _installed:
        return
    _installed = True

    def attach_plan(forward_batch, cls, batch, *args, **kwargs):
        if forward_batch.forward_mode.is_decode() and forward_batch.seq_lens_cpu is not None:
            plan = plan_correction(batch.reqs, forward_batch.seq_lens_cpu, interval)
            setattr(forward_batch, PLAN_ATTR, plan)
        return forward_batch

    def correct_then_forward(forward, model_runner, forward_batch, *args, **kwargs):
        plan = getattr(forward_batch, PLAN_ATTR, None)
        if plan is not None:
            setattr(forward_batch, PLAN_ATTR, None)
            run_correction(model_runner, forward_batch, plan)
        return forward(model_runner, forward_batch, *args, **kwargs)

    HookRegistry.register(_INIT_NEW, attach_plan, HookType.AFTER)
    HookRegistry.register(_FORWARD, correct_then_forward, HookType.AROUND)
    logger.info("sglang_ext: KV cache correction every %d decode steps", interval)


def run_correction(model_runner, decode_batch, plan: CorrectionPlan) -> None:
    batch = correction_batch(decode_batch, plan, model_runner.req_to_token_pool.req_to_token)
    model_runner.forward(batch)  # the extend writes K/V at out_cache_loc: the tokens' own slots
    STATS.rounds += 1
    STATS.requests += len(plan.starts)
    STATS.tokens += plan.num_tokens
    if STATS.rounds == 1:
        logger.info(
            "sglang_ext: first cache correction re-filled %d tokens of %d requests from positions %s",
            plan.num_tokens, len(plan.starts), plan.starts,
        )  # fmt: skip
