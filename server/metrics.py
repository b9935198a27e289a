"""Prometheus metrics of the KV policy, beside SGLang's own (``--enable-metrics``), prefixed
``sglang_ext:``. SGLang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR,
set before its engine processes start), so metrics made in the scheduler process appear in the
HTTP server's ``/metrics`` with SGLang's.

Observed once per decode batch in the scheduler process, from host data it already has (no
device sync), after the step (``sglang_ext.engine.steps``): each request's
``PolicyRuntime.report``, the same the per-request report gets, and the runtime's stats. ART's
tile counts are accumulated by its kernel on the device and copied back without waiting
(``DeviceCounts``), so they lag a step or so.

The running requests' series (KV held, logical tokens, tokens attended) are labelled by the policy
each request decodes under (``full`` for one that opted out), the rest by the served policy.
Where layers keep lists of their own (Lethe's per-layer memory), ``retained_kv_entries_per_layer``
sums the entries each layer's lists hold over the running requests, labelled by ``layer``.

Under parallelism the series carry SGLang's own labels, ``tp_rank`` and (data parallelism)
``dp_rank``: each data-parallel worker reports its requests; within a worker the first
attention-TP rank reports them, as SGLang's metrics do (every rank decides alike), and every rank
counts the ART tiles of its own heads (sum over ``tp_rank`` for all of them).
"""

from __future__ import annotations

import dataclasses
import re
import time

import torch

from sglang_ext.policies.runtime import PolicyRuntime, RequestReport, RuntimeStats, StepRequest

PREFIX = "sglang_ext:"
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))
_SECOND_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def by_policy(text: str, name: str) -> dict[str, float]:
    """Read back from ``/metrics`` text: the samples of series ``name`` (a histogram's
    ``NAME_count`` or ``NAME_sum``, a counter's ``NAME_total``) summed by their ``policy`` label."""
    sums: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        policy = re.search(r'policy="([^"]*)"', labels)
        if policy is not None:
            sums[policy[1]] = sums.get(policy[1], 0.0) + float(value)
    return sums


class DeviceCounts:
    """Counters the decode kernels accumulate on the device, read without stalling them: each
    poll starts a copy into pinned host memory and returns what the previous copy brought once
    it has landed (None until then)."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts
        self.on_cuda = counts.is_cuda
        self.host = torch.zeros(counts.shape, dtype=counts.dtype, pin_memory=self.on_cuda)
        self.copied = torch.cuda.Event() if self.on_cuda else None
        self.pending = False

    def poll(self) -> list[int] | None:
        if not self.on_cuda:
            return self.counts.tolist()
        if self.pending and not self.copied.query():
            return None
        landed = self.host.tolist() if self.pending else None
        self.host.copy_(self.counts, non_blocking=True)
        self.copied.record()
        self.pending = True
        return landed


class ArtMetrics:
    def __init__(self, labels: dict[str, str], counts: torch.Tensor):
        from prometheus_client import Counter, Gauge

        self.read = Counter(f"{PREFIX}art_tiles_read", "KV tiles ART's kernel read",
                            list(labels)).labels(**labels)
        self.available = Counter(f"{PREFIX}art_tiles", "KV tiles in ART's traversals (read or skipped)",
                                 list(labels)).labels(**labels)
        self.skipped_ratio = Gauge(f"{PREFIX}art_skipped_tiles_ratio",
                                   "share of KV tiles ART skipped, over the tiles counted since the last update",
                                   list(labels), multiprocess_mode="mostrecent").labels(**labels)  # fmt: skip
        self.device = DeviceCounts(counts)
        self.seen = [0, 0]

    def observe(self) -> None:
        counts = self.device.poll()
        if counts is None:
            return
        read, available = counts[0] - self.seen[0], counts[1] - self.seen[1]
        self.seen = counts
        if available > 0:
            self.read.inc(read)
            self.available.inc(available)
            self.skipped_ratio.set(1.0 - read / available)


@dataclasses.dataclass(frozen=True)
class Worker:
    """The scheduler process that observes: its ranks (SGLang's metric labels), and whether it
    reports the requests or only its own ART tiles."""

    tp_rank: int
    dp_rank: int | None  # None without SGLang's data-parallel controller
    reports_requests: bool

    def labels(self, policy_name: str) -> dict[str, str]:
        labels = {"policy": policy_name, "tp_rank": str(self.tp_rank)}
        return labels if self.dp_rank is None else {**labels, "dp_rank": str(self.dp_rank)}


class RequestSeries:
    """The running requests' series, labelled by the policy each request decodes under: the
    served one, or ``full`` for a request that opted out."""

    def __init__(self, worker: Worker):
        from prometheus_client import Gauge, Histogram

        names = list(worker.labels(""))
        gauge = dict(labelnames=names, multiprocess_mode="mostrecent")
        self._retained = Gauge(
            f"{PREFIX}retained_kv_tokens", "KV tokens the running requests hold (after eviction)",
            **gauge,
        )
        self._logical = Gauge(
            f"{PREFIX}logical_kv_tokens",
            "tokens of the running requests: what full attention would hold", **gauge,
        )
        self._attended = Histogram(
            f"{PREFIX}attended_tokens_per_step",
            "tokens one request attends to per decode step, mean over layers", names,
            buckets=_TOKEN_BUCKETS,
        )
        self._per_layer = Gauge(
            f"{PREFIX}retained_kv_entries_per_layer",
            "KV entries each layer's lists hold over the running requests (per-layer memory)",
            labelnames=[*names, "layer"], multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.worker = worker
        self._by_policy: dict[str, tuple] = {}  # name -> its (retained, logical, attended) children
        self._layer_gauges: list = []  # the per-layer children, made on first use

    def _children(self, policy_name: str) -> tuple:
        if policy_name not in self._by_policy:
            labels = self.worker.labels(policy_name)
            series = (self._retained, self._logical, self._attended)
            self._by_policy[policy_name] = tuple(metric.labels(**labels) for metric in series)
        return self._by_policy[policy_name]

    def observe(
        self, runtime: PolicyRuntime, step: list[StepRequest], reports: list[RequestReport]
    ) -> None:
        sums = {name: [0, 0] for name in self._by_policy}  # a policy now idle drops to 0
        for request, report in zip(step, reports, strict=True):
            self._children(report.policy)[2].observe(report.attended)
            totals = sums.setdefault(report.policy, [0, 0])
            totals[0] += report.held
            totals[1] += request.seq_len
        for name, (retained, logical) in sums.items():
            retained_gauge, logical_gauge, _ = self._children(name)
            retained_gauge.set(retained)
            logical_gauge.set(logical)
        layered = [
            (report.policy, held) for request, report in zip(step, reports, strict=True)
            if (held := runtime.held_per_layer(request)) is not None
        ]  # fmt: skip
        if layered and not self._layer_gauges:  # one policy keeps per-layer lists (Lethe's)
            labels = self.worker.labels(layered[0][0])
            self._layer_gauges = [
                self._per_layer.labels(**labels, layer=str(layer))
                for layer in range(len(layered[0][1]))
            ]
        totals = [sum(column) for column in zip(*(held for _, held in layered))]
        for layer, gauge in enumerate(self._layer_gauges):  # no such request running: 0
            gauge.set(totals[layer] if totals else 0)


class PolicyMetrics:
    """The served policy's work: rounds, freed slots, host time; and its requests' series."""

    def __init__(self, worker: Worker, policy_name: str):
        from prometheus_client import Counter, Histogram

        labels = worker.labels(policy_name)

        def counter(name: str, documentation: str):
            return Counter(f"{PREFIX}{name}", documentation, list(labels)).labels(**labels)

        self.requests = RequestSeries(worker)
        self.evicted = counter("evicted_tokens", "KV slots freed by eviction rounds")
        self.relieved = counter(
            "memory_relief_tokens",
            "KV slots freed because the next decode step did not fit (else SGLang retracts)",
        )
        self.rounds = counter("eviction_rounds", "eviction rounds run")
        self.overhead = Histogram(
            f"{PREFIX}policy_overhead_seconds",
            "host time of the policy per decode batch (eviction rounds, bookkeeping)",
            list(labels), buckets=_SECOND_BUCKETS,
        ).labels(**labels)
        self._seen = RuntimeStats()

    def observe_decode(
        self, runtime: PolicyRuntime, step: list[StepRequest], reports: list[RequestReport]
    ) -> None:
        started = time.perf_counter()
        self.requests.observe(runtime, step, reports)
        stats = runtime.stats
        self.rounds.inc(stats.rounds - self._seen.rounds)
        self.evicted.inc(stats.freed_slots - self._seen.freed_slots)
        self.relieved.inc(stats.relief_slots - self._seen.relief_slots)
        self.overhead.observe(stats.seconds - self._seen.seconds + time.perf_counter() - started)
        self._seen = dataclasses.replace(stats)


_metrics: tuple[PolicyMetrics | None, ArtMetrics | None] | None = None


def observe_decode(
    runtime: PolicyRuntime, step: list[StepRequest], reports: list[RequestReport], worker: Worker
) -> None:
    """A decode batch of this process's runtime, with each request's report after the step (its
    metrics are made at the first)."""
    global _metrics
    if _metrics is None:
        requests = PolicyMetrics(worker, runtime.policy.name) if worker.reports_requests else None
        tiles = runtime.tile_counts
        labels = worker.labels(runtime.policy.name)
        _metrics = (requests, ArtMetrics(labels, tiles) if tiles is not None else None)
    requests, art = _metrics
    if requests is not None:
        requests.observe_decode(runtime, step, reports)
    if art is not None:
        art.observe()
