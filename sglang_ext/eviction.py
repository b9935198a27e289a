"""Lethe inside the engine: per-layer retained lists, pruning rounds, freed slots back to the pool.

State, per SGLang request slot (a row of ``req_to_token``) and per layer, on the device:
``positions`` (the retained logical positions, ascending), ``count`` and ``scores`` (RASR). A
prefill (extend) resets a row to every position it holds; each decode step appends the new token
to every layer's list; the decode attention reads only the list (``kernels.rasr``).

Memory: SGLang keeps its own view of a request (``seq_lens``, ``req_to_token``, the true
positions for RoPE) unchanged; a slot freed by a round leaves a hole, slot 0, in the request's
``req_to_token`` row. Slot 0 is SGLang's padding slot: never allocated, so a hole is never
attended and never a real slot. SGLang hooks (``sglang.srt.plugins.HookRegistry``):
- after ``ForwardBatch.init_new`` (which still sees the scheduler's requests): a prefill resets a
  request's host-side eviction state; a decode batch gets a plan of the requests whose retained
  KV passed their threshold, from host counters only;
- around ``ModelRunner.forward``: a prefill resets its rows' lists; a decode batch with a plan runs
  the pruning rounds first, frees the slots no layer keeps (``allocator.free``) and records the
  new retained size and threshold on the request;
- before ``TokenToKVPoolAllocator.free``: holes are dropped, so SGLang's own release of a finished,
  aborted or retracted request frees exactly the slots it still holds;
- after the scheduler's KV conservation check counts the slots running requests hold (their
  allocated length past the radix prefix), the slots they had evicted are taken off, so the check
  stays exact: available + evictable + protected + held == total.

Radix cache: positions before ``req.cache_protected_len`` belong to the radix tree (a prefix
matched at admission, shared); they are exempt: a layer may stop attending to them, but their
slots are never freed under this request. The request's own prompt stays its own: SGLang would
insert it into the tree right after its prefill (``maybe_cache_unfinished_req``), which would
make it exempt too, so another hook skips that insertion for lethe requests (chunks of a prompt
longer than ``--chunked-prefill-size`` are still inserted between chunks, as SGLang's chunked
prefill needs, and stay exempt). A request that lost a slot is not inserted into the tree when it
finishes (``skip_radix_cache_insert``): its row has holes; one that lost none is inserted then, as
usual. A retracted request is prefilled again from its tokens, which resets everything.

A round reads its request's lists back to the host (syncs), like SGLang's own retraction does;
decode steps without a round stay free of host syncs and keep their CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from sglang_ext import request_policy

logger = logging.getLogger(__name__)

PLAN_ATTR = "sglang_ext_eviction_plan"  # on a ForwardBatch: the requests due for a round
STATE_ATTR = "sglang_ext_lethe"  # on a Req: its RequestEviction
HOLE = 0  # SGLang's padding slot, never allocated: marks an evicted position in req_to_token
_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_FREE = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free"
_CACHE_UNFINISHED = "sglang.srt.mem_cache.common.maybe_cache_unfinished_req"
_UNCACHED = (
    "sglang.srt.managers.scheduler_components.invariant_checker."
    "SchedulerInvariantChecker._get_total_uncached_sizes"
)


@dataclasses.dataclass
class RequestEviction:
    """Host-side eviction state of one request."""

    threshold: int  # L_evict: a round runs once the retained KV passes it
    evicted: int = 0  # slots freed so far
    rounds: int = 0
    skips_radix_insert: bool = False  # we set req.skip_radix_cache_insert
    retained_per_layer: list[int] = dataclasses.field(default_factory=list)  # after the last round
    policy: Any = None  # the request's Lethe (the served one, or with its own parameters)


@dataclasses.dataclass
class EvictionStats:
    rounds: int = 0
    freed_slots: int = 0
    seconds: float = 0.0  # host time in rounds


STATS = EvictionStats()
_installed = False
RUNTIMES: list[LetheRuntime] = []  # this process's (one per attention backend), for the scheduler


class LetheRuntime:
    """Lethe's device state for one attention backend and its per-layer decode functions."""

    def __init__(self, policy, ctx):
        self.policy, self.ctx = policy, ctx
        RUNTIMES.append(self)
        rows, cap = ctx.req_to_token.shape
        self.trash_row = rows  # padded batch entries (CUDA graphs) write here, read nothing
        shape = (ctx.num_layers, rows + 1, cap)
        self.positions = torch.zeros(shape, dtype=torch.int32, device=ctx.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=ctx.device)
        self.count = torch.zeros(shape[:2], dtype=torch.int32, device=ctx.device)
        self._arange = torch.arange(cap, dtype=torch.int32, device=ctx.device)
        self._zero_score = torch.zeros((), dtype=torch.float32, device=ctx.device)
        self._logits = None  # CUDA scratch [max batch, q heads, cap], made on first decode
        size_gb = (self.positions.nbytes + self.scores.nbytes) / 2**30
        logger.info(
            "sglang_ext: lethe state for %d layers x %d request slots x %d positions: %.2f GiB",
            ctx.num_layers, rows, cap, size_gb,
        )  # fmt: skip

    def decode_fns(self) -> list:
        return [self._decode for _ in range(self.ctx.num_layers)]

    def _decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        from sglang_ext.kernels import rasr

        if save_kv_cache and k is not None and v is not None:
            self.ctx.write_kv(layer, forward_batch, k, v)
        lid = layer.layer_id
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        seq_lens, rows = forward_batch.seq_lens, forward_batch.req_pool_indices
        # A real decoding request holds >= 2 tokens; CUDA-graph padding has seq_len 1.
        state_rows = torch.where(seq_lens > 1, rows, self.trash_row)
        self._append(lid, state_rows, seq_lens)
        pool = self.ctx.kv_pool
        args = (
            q, pool.get_key_buffer(lid), pool.get_value_buffer(lid), self.ctx.req_to_token,
            rows, seq_lens, self.positions[lid], self.count[lid], self.scores[lid],
        )  # fmt: skip
        if q.is_cuda:
            out = rasr.retained_decode(
                *args, layer.scaling, self.policy.decay, self._logits_buffer(q),
                state_rows=state_rows,
            )  # fmt: skip
        else:
            out = rasr.retained_decode_ref(*args, layer.scaling, self.policy.decay)
        return out.view(q.shape[0], -1)

    def _append(self, lid: int, state_rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Add the token being decoded (position seq_len - 1) to layer ``lid``'s lists."""
        counts = self.count[lid]
        real = state_rows != self.trash_row
        at = torch.where(real, counts[state_rows], 0).long()
        self.positions[lid][state_rows, at] = (seq_lens - 1).to(torch.int32)
        # A device zero: a Python scalar would be copied from the host, which CUDA graphs forbid.
        self.scores[lid].index_put_((state_rows, at), self._zero_score)
        counts[state_rows] = torch.where(real, at + 1, 0).to(torch.int32)

    def _logits_buffer(self, q: torch.Tensor) -> torch.Tensor:
        if self._logits is None:
            shape = (self.ctx.max_batch_size, q.shape[1], self.positions.shape[2])
            self._logits = torch.empty(shape, dtype=torch.float32, device=q.device)
        return self._logits

    def reset_rows(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A prefill: each row retains every position it holds, with zero scores."""
        rows = req_pool_indices.long()
        self.positions[:, rows] = self._arange
        self.scores[:, rows] = 0.0
        self.count[:, rows] = seq_lens.to(torch.int32)

    def after_extend(self, q, layer, forward_batch) -> None:
        """Seed a prefilled request's scores in this layer: the attention its last
        ``observation_window`` prompt tokens pay to each of its tokens, summed over heads and
        those queries (Eq. 2). Its rows were reset to every position before the forward."""
        from sglang_ext.kernels import rasr

        window = self.policy.observation_window
        if window == 0 or forward_batch.extend_seq_lens_cpu is None:
            return
        lid = layer.layer_id
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        pool = self.ctx.kv_pool
        k_buffer = pool.get_key_buffer(lid)
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        start = 0
        for row, seq_len, extend_len in zip(
            rows, seq_lens, forward_batch.extend_seq_lens_cpu, strict=True
        ):
            n = min(window, extend_len)
            queries = q[start + extend_len - n : start + extend_len]
            start += extend_len
            slots = self.ctx.req_to_token[row, :seq_len].long()
            self.scores[lid, row, :seq_len] = rasr.window_scores(
                queries, k_buffer[slots], seq_len, layer.scaling, self.policy.observation_pool
            )

    def prune(self, req, row: int, length: int, allocator) -> None:
        """One pruning round of ``req`` (request slot ``row``) over its first ``length`` positions
        (the token being decoded is not in the lists yet)."""
        state: RequestEviction = getattr(req, STATE_ATTR)
        shrinks, kept, kept_scores = [], [], []
        for lid in range(self.ctx.num_layers):
            n = int(self.count[lid, row])
            positions, scores = self.positions[lid, row, :n], self.scores[lid, row, :n]
            shrink = state.policy.shrink_layer(positions, scores)
            shrinks.append(shrink)
            kept.append(positions[shrink.keep])
            kept_scores.append(scores[shrink.keep])
        kept_by_any = state.policy.cap_union(kept, kept_scores, length)
        per_layer = []
        for lid, (positions, scores) in enumerate(zip(kept, kept_scores, strict=True)):
            stays = kept_by_any[positions.long()]
            m = int(stays.sum())
            self.positions[lid, row, :m] = positions[stays]
            self.scores[lid, row, :m] = scores[stays]
            self.count[lid, row] = m
            per_layer.append(m)
        slots = self.ctx.req_to_token[row, :length]
        freeable = ~kept_by_any & (slots != HOLE)
        freeable[: req.cache_protected_len] = False  # owned by the radix tree
        freed = slots[freeable].to(torch.int64)
        slots[freeable] = HOLE
        available_before = allocator.available_size()
        allocator.free(freed)

        state.evicted += freed.numel()
        state.rounds += 1
        state.retained_per_layer = per_layer
        retained = length - state.evicted
        state.threshold = state.policy.next_threshold(
            state.threshold, shrinks, retained, length
        )
        if freed.numel() and not getattr(req, "skip_radix_cache_insert", False):
            req.skip_radix_cache_insert = state.skips_radix_insert = True
        STATS.rounds += 1
        STATS.freed_slots += freed.numel()
        logger.info(
            "sglang_ext: lethe round %d of %s: %d positions, freed %d slots (available %d -> %d), "
            "retained %d (radix-owned %d), next threshold %d, retained per layer %s",
            state.rounds, req.rid, length, freed.numel(), available_before,
            allocator.available_size(), retained, req.cache_protected_len, state.threshold,
            per_layer,
        )  # fmt: skip


    def prune_under_pressure(self, reqs, seq_lens: list[int], allocator) -> int:
        """Rounds now, whatever the thresholds, for each request that holds more than a round
        would leave; ``seq_lens`` count the cached tokens (all in the lists). Slots freed."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()  # the last decode step may still be appending to the lists
        freed = 0
        for req, length in zip(reqs, seq_lens, strict=True):
            state = getattr(req, STATE_ATTR, None)
            if state is None or req.req_pool_idx is None:
                continue
            held_past_radix = length - state.evicted - req.cache_protected_len
            if held_past_radix > state.policy.round_cap(length):
                before = state.evicted
                self.prune(req, req.req_pool_idx, length, allocator)
                freed += state.evicted - before
        return freed


def due_for_round(reqs, seq_lens_cpu) -> list[tuple]:
    """(req, row, positions before the token being decoded) for each request of a decode batch
    whose retained KV passed its threshold; host data only."""
    due = []
    for req, seq_len in zip(reqs, seq_lens_cpu.tolist(), strict=True):
        state = getattr(req, STATE_ATTR, None)
        if state is not None and seq_len - 1 - state.evicted > state.threshold:
            due.append((req, req.req_pool_idx, seq_len - 1))
    return due


def install(policy) -> None:
    """Register the hooks (from the plugin, before SGLang applies hooks); once per process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _installed
    if _installed:
        return
    _installed = True

    def plan_rounds(forward_batch, cls, batch, *args, **kwargs):
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_mixed():
            for req in batch.reqs:
                _reset_request(req, policy)
        elif mode.is_decode() and forward_batch.seq_lens_cpu is not None:
            due = due_for_round(batch.reqs, forward_batch.seq_lens_cpu)
            setattr(forward_batch, PLAN_ATTR, due or None)
        return forward_batch

    def prune_then_forward(forward, model_runner, forward_batch, *args, **kwargs):
        runtime = getattr(model_runner.attn_backend, "policy_runtime", None)
        if isinstance(runtime, LetheRuntime):
            mode = forward_batch.forward_mode
            if mode.is_extend() and not mode.is_mixed():
                runtime.reset_rows(forward_batch.req_pool_indices, forward_batch.seq_lens)
            started = time.perf_counter()
            for req, row, length in getattr(forward_batch, PLAN_ATTR, None) or ():
                runtime.prune(req, row, length, model_runner.token_to_kv_pool_allocator)
            STATS.seconds += time.perf_counter() - started
            setattr(forward_batch, PLAN_ATTR, None)
        return forward(model_runner, forward_batch, *args, **kwargs)

    def drop_holes(allocator, free_index, *args, **kwargs):
        if free_index.numel() and bool((free_index == HOLE).any()):
            free_index = free_index[free_index != HOLE]
        return (allocator, free_index, *args), kwargs

    def count_evicted(uncached, checker, *args, **kwargs):
        full, swa = uncached
        pair = (checker.get_last_batch(), checker.get_running_batch())
        batches = {id(b): b for b in pair if b is not None}
        evicted = sum(
            getattr(req, STATE_ATTR).evicted
            for batch in batches.values()
            for req in batch.reqs
            if req.kv is not None and getattr(req, STATE_ATTR, None) is not None
        )
        return full - evicted, swa

    def keep_prompt_own(cache_unfinished, req, tree_cache, **kwargs):
        if kwargs.get("chunked") or getattr(req, STATE_ATTR, None) is None:
            return cache_unfinished(req, tree_cache, **kwargs)
        return None

    HookRegistry.register(_CACHE_UNFINISHED, keep_prompt_own, HookType.AROUND)
    HookRegistry.register(_INIT_NEW, plan_rounds, HookType.AFTER)
    HookRegistry.register(_UNCACHED, count_evicted, HookType.AFTER)
    HookRegistry.register(_FORWARD, prune_then_forward, HookType.AROUND)
    HookRegistry.register(_FREE, drop_holes, HookType.BEFORE)
    logger.info("sglang_ext: lethe eviction hooks installed")


def _reset_request(req, policy) -> None:
    """A request being prefilled (new, next chunk, or retracted and re-run) holds every slot; one
    that chose full attention (sglang_ext.request_policy) gets no eviction state at all."""
    old = getattr(req, STATE_ATTR, None)
    if old is not None and old.skips_radix_insert:
        req.skip_radix_cache_insert = False
    own = request_policy.of_request(policy, req)
    if own is None:
        setattr(req, STATE_ATTR, None)
        return
    rounds = old.rounds if old is not None else 0
    setattr(req, STATE_ATTR, RequestEviction(threshold=own.evict_threshold, rounds=rounds, policy=own))
