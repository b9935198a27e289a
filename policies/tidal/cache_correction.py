"""KV cache correction (TidalDecode, Sec. 3.2): every T decode steps, a prefill with full attention
over a request's tokens decoded since its last correction overwrites their K/V in place.

A sparsely decoded token's K/V in the layers past the first selection layer come from sparse
attention; they drift from what full attention would have stored, and every later token reads
them. The correction re-runs those tokens as an extend whose prefix is the request's cache and
whose output slots are the tokens' own slots, so SGLang's own extend path (full attention, the
model's own layers) recomputes and overwrites their K/V; its logits are discarded.

Here: which requests of a decode batch are due, planned on the host from data the scheduler
already has (``PolicyRuntime.plan_step``), so the decode step itself stays free of host syncs and
keeps its CUDA graph. The engine adapter runs the plan before the step
(``sglang_ext.engine.batches.correction_batch``).
"""

from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_ext.policies.runtime import StepRequest


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


def plan_correction(requests: list[StepRequest], interval: int) -> CorrectionPlan | None:
    """The corrections due in a decode batch; a request's ``seq_len`` counts the token being
    decoded.

    A request is due once ``interval`` of its tokens past the prompt and past its last correction
    are on the host (under overlap scheduling the host learns a token a step late, so a round
    waits for it rather than skip it). The request's state remembers how far it was corrected.
    """
    pool_indices, starts, token_ids = [], [], []
    for r in requests:
        start = max(r.prompt_len, r.state.corrected_until)
        end = min(r.seq_len - 1, r.prompt_len + len(r.output_ids))  # cached and known on the host
        if end - start < interval:
            continue
        pool_indices.append(r.row)
        starts.append(start)
        token_ids.append(list(r.output_ids[start - r.prompt_len : end - r.prompt_len]))
        r.state.corrected_until = end
    return CorrectionPlan(pool_indices, starts, token_ids) if pool_indices else None


@dataclasses.dataclass(frozen=True)
class CacheCorrection:
    """Every ``interval`` decode steps of a request (a policy's ``cache_correction``)."""

    interval: int

    def __call__(self, requests: list[StepRequest]) -> CorrectionPlan | None:
        return plan_correction(requests, self.interval)
