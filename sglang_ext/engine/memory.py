"""SGLang's memory accounting under a policy that evicts (``KVPolicy.evicts``: Lethe).

- **Holes**: a slot freed by a round leaves ``HOLE_SLOT`` in the request's ``req_to_token`` row;
  before ``TokenToKVPoolAllocator.free`` they are dropped, so SGLang's own release of a finished,
  aborted or retracted request frees exactly the slots it still holds.
- **Conservation check**: after SGLang's invariant checker counts the slots running requests
  hold (their allocated length past the radix prefix), the slots they had evicted are taken off,
  so its strict check stays exact: available + evictable + protected + held == total.
- **Radix cache**: SGLang inserts a request's prompt into the tree right after its prefill
  (``maybe_cache_unfinished_req``), which would make it radix-owned and never freed; for a request
  that evicts, that insertion is skipped (chunks of a prompt longer than
  ``--chunked-prefill-size`` are still inserted between chunks, as chunked prefill needs). A
  request that lost slots is not inserted when it finishes (``requests.mark_evicted``).
- **Admission**: SGLang admits a request only if its prompt plus its whole ``max_new_tokens``
  fits beside what the running requests may still grow by; under eviction a request never holds
  that much. SGLang's ``PrefillAdder`` (class REPLACE: 0.5.17 has no factory for it) counts each
  request at the runtime's ``admission_tokens`` instead, and each running request at what it may
  still grow by up to that. SGLang's own reservation logic is kept: only the counts change. A
  request that evicts is counted at all of that growth, where SGLang scales a running request's
  by its optimistic ``new_token_ratio`` (requests may stop early): the rounds bound it, and
  retracting a request whose KV they already cut re-prefills its whole context. A
  ``--schedule-conservativeness`` below 1 (the user asking for optimism) scales it.
- **Admission reopened by rounds**: once a request did not fit, SGLang stops trying its queue
  (``batch_is_full``) until a running request finishes or is retracted, since memory otherwise
  only grows; rounds free slots mid-flight (a long prompt loses most of its KV at its first
  round), so slots freed since the scheduler's last try open its queue again.
- **Decode memory**: when the next decode step does not fit, the runtime frees what it can
  (``relieve_memory``: Lethe's rounds now) before SGLang retracts anything.
- **Request pool by memory** (``KVPolicy.request_state_bytes``: Lethe's per-slot scores and
  lists): SGLang sizes its request pool (``--max-running-requests``'s default) from the KV pool
  alone, up to thousands of slots. A policy whose runtime owns state per slot gets at most as many
  slots as fit in ``STATE_SHARE`` of the memory SGLang found for the KV pool (or exactly the
  user's ``--max-running-requests``), and their bytes come out of the KV pool's budget, never out
  of the headroom SGLang keeps for activations and CUDA graphs. Its admission is then by KV (above).
- **One buffer for the pool's layers** (``KVPolicy.pools_layer_rows``: Lethe's per-layer memory):
  ``MHATokenToKVPool`` allocates each layer's K (and V) separately; it is made to allocate them
  as one [layers, slots, heads, dim] tensor whose per-layer views it keeps, so a row of any layer
  is addressable from every layer's decode (``policies.lethe.runtime``). Same bytes, same layout
  per layer; only the plain token-major layout is supported, anything else stops the engine.
"""

from __future__ import annotations

import logging

from sglang_ext.engine import requests, targets
from sglang_ext.engine.backends import HOLE_SLOT, process_runtime
from sglang_ext.policies.runtime import EngineOps

logger = logging.getLogger(__name__)


def drop_holes(allocator, free_index, *args, **kwargs):
    if free_index.numel() and bool((free_index == HOLE_SLOT).any()):
        free_index = free_index[free_index != HOLE_SLOT]
    return (allocator, free_index, *args), kwargs


def count_evicted(uncached, checker, *args, **kwargs):
    full, swa = uncached
    pair = (checker.get_last_batch(), checker.get_running_batch())
    batches = {id(b): b for b in pair if b is not None}
    evicted = sum(requests.held_by_running(batch.reqs) for batch in batches.values())
    return full - evicted, swa


def keep_prompt_own(cache_unfinished, req, tree_cache, **kwargs):
    state = requests.state_of(req)
    if kwargs.get("chunked") or state is None or not state.evicts:
        return cache_unfinished(req, tree_cache, **kwargs)
    return None


def budget_prefill_adder() -> type:
    """SGLang's PrefillAdder, counting requests at the runtime's ``admission_tokens``."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, PrefillAdder
    from sglang.srt.server_args import get_global_server_args

    def admission_tokens(req, total: int) -> int:
        runtime = process_runtime()
        if runtime is None:
            return total
        state = requests.state_of(req)
        if state is None:  # not prefilled yet: it will decode under what it asked for
            state = runtime.new_request(requests.own_policy(runtime.policy, req), None)
        return runtime.admission_tokens(state, total)

    class BudgetPrefillAdder(PrefillAdder):
        def _get_running_request_total_token_offset(self, req) -> int:
            total = len(req.origin_input_ids) + req.sampling_params.max_new_tokens
            state = requests.state_of(req)
            held = len(req.origin_input_ids) + len(req.output_ids)
            held -= state.evicted if state is not None else 0
            growth = min(max(0, admission_tokens(req, total) - held), CLIP_MAX_NEW_TOKENS)
            if state is not None and state.evicts:  # bounded by its rounds
                return growth * min(1.0, get_global_server_args().schedule_conservativeness)
            return growth * self.new_token_ratio

        def add_one_req(self, req, *args, **kwargs):
            # SGLang reads max_new_tokens here only to budget; it sees the expected growth
            # beyond what prefill fills, and the request's own value is back before returning.
            params = req.sampling_params
            requested = params.max_new_tokens
            filled = len(req.origin_input_ids) + len(req.output_ids)
            expected = admission_tokens(req, len(req.origin_input_ids) + requested)
            params.max_new_tokens = len(req.output_ids) + max(0, expected - filled)
            try:
                return super().add_one_req(req, *args, **kwargs)
            finally:
                params.max_new_tokens = requested

    return BudgetPrefillAdder


_FREED_SEEN = "sglang_ext_freed_seen"  # on the Scheduler: rounds' freed slots at its last try


def reopen_admission(scheduler, running_batch, *args, **kwargs):
    runtime = process_runtime()
    freed = runtime.stats.freed_slots if runtime is not None else 0
    if freed != getattr(scheduler, _FREED_SEEN, 0):
        setattr(scheduler, _FREED_SEEN, freed)
        running_batch.batch_is_full = False  # the adder's counts decide what fits now


def relieve_before_retracting(check, batch, *args, **kwargs):
    if check(batch, *args, **kwargs):
        return True
    runtime = process_runtime()
    if runtime is None:
        return False
    allocator = batch.token_to_kv_pool_allocator
    ops = EngineOps(allocator.free, allocator.available_size, rerun_extend=None)
    step = requests.step_requests(runtime, batch.reqs, batch.seq_lens_cpu.tolist())
    freed = runtime.relieve_memory(step, ops)
    for req in batch.reqs:
        requests.mark_evicted(req)
    if freed:
        logger.info("sglang_ext: decode memory short: pruning freed %d slots", freed)
    return freed > 0 and check(batch, *args, **kwargs)


# The most of the KV pool's memory a policy's per-request state may take where the user did not
# fix the request slots (a large pool then still holds far more slots than it can run), but
# never fewer slots than FLOOR_SLOTS (a small pool's share would starve concurrency) unless the
# state would then take more than MOST_OF_MEMORY of what the KV pool may use.
STATE_SHARE = 1 / 16
FLOOR_SLOTS = 64
MOST_OF_MEMORY = 1 / 2
# SGLang's request rows hold a few positions past the context length (its extra_max_context_len)
EXTRA_POSITIONS = 8


def state_slots(
    per_slot: int, pool_bytes: int, available: int, sglang_slots: int, requested: int | None
) -> int:
    """The request slots a server whose policy keeps ``per_slot`` bytes per slot gets beside a KV
    pool of ``pool_bytes`` (of ``available`` bytes the pool may use): the user's ``requested``
    count, else SGLang's own count (``sglang_slots``) as far as ``STATE_SHARE`` of the pool pays
    for, ``FLOOR_SLOTS`` at least where ``MOST_OF_MEMORY`` of ``available`` holds them."""
    if requested is not None:
        return max(requested, 1)
    floor = min(FLOOR_SLOTS, int(MOST_OF_MEMORY * available) // per_slot - 1)
    return max(1, min(sglang_slots, max(floor, int(STATE_SHARE * pool_bytes) // per_slot)))


def request_pool_by_memory(policy):
    """An AROUND hook of SGLang's memory-pool resolution: ``policy``'s per-request state paid
    from the KV budget, the request slots bounded by what it may take."""

    def resolve(resolve_pool, configurator, *args, **kwargs):
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        model = configurator.model_config
        per_slot = policy.request_state_bytes(
            configurator.layer_info.num_effective_layers,
            model.get_num_attention_heads(configurator.ps.attn_tp_size),
            model.get_num_kv_heads(configurator.ps.attn_tp_size),
            model.context_len + EXTRA_POSITIONS,
        )
        own = resolve_pool(configurator, *args, **kwargs)  # SGLang's sizing, without the state
        if per_slot == 0:
            return own
        sizing = create_memory_pool_configurator(configurator)
        available = configurator._profile_available_bytes(*args, **kwargs)
        uncapped = sizing.calculate_pool_sizes(available, configurator.page_size)
        pool_bytes = available * own.max_total_num_tokens // max(uncapped.max_total_num_tokens, 1)
        requested = configurator.server_args.max_running_requests
        if requested is not None:
            requested //= configurator.ps.attn_dp_size
        slots = state_slots(per_slot, pool_bytes, available, own.max_running_requests, requested)
        budget = available - (slots + 1) * per_slot
        if budget <= 0:
            raise targets.EngineAdapterError(
                f"{policy.name}'s state ({per_slot / 2**20:.1f} MiB per request slot at context "
                f"{model.context_len}) leaves no KV pool for {slots} request slots in "
                f"{available / 2**30:.1f} GiB: lower --max-running-requests or --context-length"
            )
        config = configurator.config_from_budget(budget)
        config.max_running_requests = min(
            configurator.resolve_max_num_reqs(config.max_total_num_tokens), slots
        )
        config = sizing.finalize_with_max_running_requests(config)
        config.mem_fraction_static = own.mem_fraction_static
        logger.info(
            "sglang_ext: %s state: %d request slots x %.1f MiB, out of a KV budget of %.1f GiB",
            policy.name, config.max_running_requests, per_slot / 2**20, available / 2**30,
        )  # fmt: skip
        return config

    return resolve


def layers_in_one_buffer(create_buffers, pool, *args, **kwargs):
    import torch
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    layout = getattr(pool, "kv_cache_layout", None)
    if pool.use_hnd or layout == "vectorized_5d" or pool.enable_custom_mem_pool:
        raise targets.EngineAdapterError(
            f"per-layer KV memory needs the token-major KV layout without a custom memory pool; "
            f"this pool has layout {layout!r}, head-major {pool.use_hnd}, custom pool "
            f"{pool.enable_custom_mem_pool}"
        )
    k_shape, v_shape = pool._kv_buffer_shapes()
    with pool.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
        keys = torch.zeros((pool.layer_num, *k_shape), dtype=pool.store_dtype, device=pool.device)
        values = torch.zeros((pool.layer_num, *v_shape), dtype=pool.store_dtype, device=pool.device)
    pool.k_buffer, pool.v_buffer = list(keys.unbind(0)), list(values.unbind(0))


def register(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.FREE, drop_holes, HookType.BEFORE)
    hooks.register(targets.UNCACHED_SIZES, count_evicted, HookType.AFTER)
    hooks.register(targets.CACHE_UNFINISHED, keep_prompt_own, HookType.AROUND)
    hooks.register(targets.PREFILL_ADDER, budget_prefill_adder(), HookType.REPLACE)
    hooks.register(targets.CHECK_DECODE_MEM, relieve_before_retracting, HookType.AROUND)
    hooks.register(targets.SCHEDULE_PREFILL, reopen_admission, HookType.BEFORE)


def register_request_pool(hooks, policy) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.RESOLVE_POOL, request_pool_by_memory(policy), HookType.AROUND)


def register_layer_pool(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.KV_POOL_BUFFERS, layers_in_one_buffer, HookType.AROUND)
