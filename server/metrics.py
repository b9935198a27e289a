"""Prometheus metrics of the KV policy, beside SGLang's own (``--enable-metrics``), prefixed
``sglang_ext:``. SGLang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR,
set before its engine processes start), so metrics made in the scheduler process appear in the
HTTP server's ``/metrics`` with SGLang's.

Observed once per decode batch, from host data the scheduler already has (no device sync):
through a HookRegistry AFTER hook on ``ForwardBatch.init_new``, which runs in the scheduler
process for every batch it builds.
"""

from __future__ import annotations

import time

from sglang_ext import eviction

PREFIX = "sglang_ext:"
_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))
_SECOND_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class PolicyMetrics:
    def __init__(self, policy_name: str):
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"policy": policy_name}
        gauge = dict(labelnames=list(labels), multiprocess_mode="mostrecent")
        self.retained = Gauge(f"{PREFIX}retained_kv_tokens",
                              "KV tokens the running requests hold (after eviction)", **gauge).labels(**labels)
        self.logical = Gauge(f"{PREFIX}logical_kv_tokens",
                             "tokens of the running requests: what full attention would hold", **gauge).labels(**labels)
        self.evicted = Counter(f"{PREFIX}evicted_tokens", "KV slots freed by eviction rounds",
                               list(labels)).labels(**labels)
        self.rounds = Counter(f"{PREFIX}eviction_rounds", "eviction rounds run", list(labels)).labels(**labels)
        self.attended = Histogram(f"{PREFIX}attended_tokens_per_step",
                                  "tokens one request attends to per decode step, mean over layers",
                                  list(labels), buckets=_TOKEN_BUCKETS).labels(**labels)
        self.overhead = Histogram(f"{PREFIX}policy_overhead_seconds",
                                  "host time of the policy per decode batch (eviction rounds, bookkeeping)",
                                  list(labels), buckets=_SECOND_BUCKETS).labels(**labels)  # fmt: skip
        self._seen = eviction.EvictionStats()

    def observe_decode(self, policy, reqs, seq_lens: list[int], num_layers: int) -> None:
        started = time.perf_counter()
        logical = retained = 0
        for req, seq_len in zip(reqs, seq_lens, strict=True):
            state = getattr(req, eviction.STATE_ATTR, None)
            held = seq_len - state.evicted if state is not None else seq_len
            logical += seq_len
            retained += held
            self.attended.observe(held if state is not None else policy.attended_tokens(seq_len, num_layers))
        self.logical.set(logical)
        self.retained.set(retained)
        stats = eviction.STATS
        self.rounds.inc(stats.rounds - self._seen.rounds)
        self.evicted.inc(stats.freed_slots - self._seen.freed_slots)
        self.overhead.observe(stats.seconds - self._seen.seconds + time.perf_counter() - started)
        self._seen = eviction.EvictionStats(stats.rounds, stats.freed_slots, stats.seconds)


_metrics: PolicyMetrics | None = None


def install() -> None:
    """Register the hook (from the plugin, before SGLang applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def observe(forward_batch, cls, batch, model_runner, *args, **kwargs):
        global _metrics
        policy = getattr(model_runner.attn_backend, "kv_policy", None)
        if (
            policy is None
            or not model_runner.server_args.enable_metrics
            or not forward_batch.forward_mode.is_decode()
            or forward_batch.seq_lens_cpu is None
        ):
            return forward_batch
        if _metrics is None:
            _metrics = PolicyMetrics(policy.name)
        _metrics.observe_decode(
            policy, batch.reqs, forward_batch.seq_lens_cpu.tolist(),
            model_runner.model_config.num_hidden_layers,
        )  # fmt: skip
        return forward_batch

    HookRegistry.register(_INIT_NEW, observe, HookType.AFTER)
