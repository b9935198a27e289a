"""Admission and decode memory under a policy's KV budget (installed for ``--policy lethe``).

SGLang admits a request only if its prompt plus its whole ``max_new_tokens`` fits beside what the
running requests may still grow by; under eviction a request never holds that much. Through
``HookRegistry`` (a class REPLACE of ``PrefillAdder``, an AROUND of
``ScheduleBatch.check_decode_mem``):

- admission counts a new request at its policy's expected retained KV
  (``Lethe.expected_kv(prompt + max_new_tokens)``, under the request's own Lethe parameters; at
  its full length when it chose full attention), and each running request at what it may still
  grow by up to that, instead of its full length;
- when the next decode step does not fit, the running requests are pruned now (a round for each
  that holds more than a round would leave) before SGLang retracts any; retraction and
  re-admission then work as in SGLang (a retracted request is prefilled again, and its eviction
  state starts over).

SGLang's own reservation logic is kept: the adder only changes the token counts it is given.
"""

from __future__ import annotations

import logging

from sglang_ext import eviction, request_policy

logger = logging.getLogger(__name__)

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_CHECK_DECODE_MEM = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"


def budget_prefill_adder(policy) -> type:
    """SGLang's PrefillAdder, counting requests at ``policy.expected_kv``."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, PrefillAdder

    def expected_kv(req, total: int) -> int:
        own = request_policy.of_request(policy, req)
        return total if own is None else own.expected_kv(total)

    class BudgetPrefillAdder(PrefillAdder):
        def _get_running_request_total_token_offset(self, req) -> int:
            total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
            state = getattr(req, eviction.STATE_ATTR, None)
            held = len(req.origin_input_ids) + len(req.output_ids)
            held -= state.evicted if state is not None else 0
            growth = max(0, expected_kv(req, total) - held)
            return min(growth, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

        def add_one_req(self, req, *args, **kwargs):
            # SGLang reads max_new_tokens here only to budget; it sees the expected growth
            # beyond what prefill fills, and the request's own value is back before returning.
            params = req.sampling_params
            requested = params.max_new_tokens
            filled = len(req.origin_input_ids) + len(req.output_ids)
            expected = expected_kv(req, len(req.origin_input_ids) + requested)
            params.max_new_tokens = len(req.output_ids) + max(0, expected - filled)
            try:
                return super().add_one_req(req, *args, **kwargs)
            finally:
                params.max_new_tokens = requested

    return BudgetPrefillAdder


def install(policy) -> None:
    """Register the hooks (from the plugin, before SGLang applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def prune_before_retracting(check, batch, *args, **kwargs):
        if check(batch, *args, **kwargs):
            return True
        if not eviction.RUNTIMES:  # this process has no lethe backend
            return False
        freed = eviction.RUNTIMES[0].prune_under_pressure(
            batch.reqs, batch.seq_lens_cpu.tolist(), batch.token_to_kv_pool_allocator
        )
        if freed:
            logger.info("sglang_ext: decode memory short: pruning freed %d slots", freed)
        return freed > 0 and check(batch, *args, **kwargs)

    HookRegistry.register(_ADDER, budget_prefill_adder(policy), HookType.REPLACE)
    HookRegistry.register(_CHECK_DECODE_MEM, prune_before_retracting, HookType.AROUND)
