"""The served policy's step, driven from two points of SGLang's scheduler process:

- after ``ForwardBatch.init_new`` (it still sees the scheduler's requests): a prefill gives each
  request its state (``requests.begin_prefill``); every batch gets the runtime's host-side plan
  (``plan_step``, from ``seq_lens_cpu``: no device sync);
- around ``ModelRunner.forward``: the plan runs first (``run_plan``: a prefill's rows, eviction
  rounds, cache correction, decode buffers sized for the batch), then the forward; then each
  request's report, made once, goes into the step's ``customized_info`` (SGLang's per-token
  channel to the response's meta_info) and, for a decode batch, into the metrics;
- around the decode CUDA graph runner's ``can_run_graph``: a step that the runtime's recorded
  buffers cannot take (``PolicyRuntime.graphable``) runs eagerly.
"""

from __future__ import annotations

import dataclasses

from sglang_ext.engine import requests, targets
from sglang_ext.engine.batches import correction_batch
from sglang_ext.engine.backends import runtime_of
from sglang_ext.policies.runtime import EngineOps, StepPlan
from sglang_ext.server import metrics, report

_STEP = "sglang_ext_step"  # on a ForwardBatch: its _Step


@dataclasses.dataclass
class _Step:
    plan: StepPlan
    reqs: list  # the scheduler's Req objects, in batch order


def plan_batch(forward_batch, cls, batch, model_runner, *args, **kwargs):
    runtime = runtime_of(model_runner)
    reqs = getattr(batch, "reqs", None)
    mode = forward_batch.forward_mode
    decode, prefill = mode.is_decode(), mode.is_extend() and not mode.is_mixed()
    if runtime is None or not reqs or forward_batch.seq_lens_cpu is None or not (decode or prefill):
        return forward_batch
    if prefill:
        for req in reqs:
            requests.begin_prefill(runtime, req)
    step = requests.step_requests(runtime, reqs, forward_batch.seq_lens_cpu.tolist())
    setattr(forward_batch, _STEP, _Step(runtime.plan_step(step, decode), reqs))
    return forward_batch


def run_step(forward, model_runner, forward_batch, *args, **kwargs):
    step = getattr(forward_batch, _STEP, None)
    if step is None:
        return forward(model_runner, forward_batch, *args, **kwargs)
    setattr(forward_batch, _STEP, None)  # a correction batch copies this one: it must not rerun it
    runtime = runtime_of(model_runner)
    runtime.run_plan(step.plan, forward_batch, engine_ops(model_runner))
    if step.plan.rounds:
        for req in step.reqs:
            requests.mark_evicted(req)
    output = forward(model_runner, forward_batch, *args, **kwargs)
    logits = getattr(output, "logits_output", None)
    observe = step.plan.decode and model_runner.server_args.enable_metrics
    if not (observe or hasattr(logits, "customized_info")):
        return output
    reports = [runtime.report(r, extend=not step.plan.decode) for r in step.plan.requests]
    if hasattr(logits, "customized_info"):
        logits.customized_info = {**(logits.customized_info or {}), **report.step_entries(reports)}
    if observe:
        metrics.observe_decode(runtime, step.plan.requests, reports, metrics_worker(model_runner))
    return output


_WORKER = "sglang_ext_worker"  # on a ModelRunner: its metrics.Worker, made once


def metrics_worker(model_runner) -> metrics.Worker:
    worker = getattr(model_runner, _WORKER, None)
    if worker is None:
        ranks = model_runner.ps  # SGLang's ParallelState of this scheduler process
        worker = metrics.Worker(ranks.tp_rank, ranks.dp_rank, ranks.attn_tp_rank == 0)
        setattr(model_runner, _WORKER, worker)
    return worker


def graph_fits(can_run_graph, graph_runner, forward_batch, *args, **kwargs):
    runtime = runtime_of(graph_runner.model_runner)
    fits = runtime is None or runtime.graphable
    return fits and can_run_graph(graph_runner, forward_batch, *args, **kwargs)


_OPS = "sglang_ext_ops"  # on a ModelRunner: its EngineOps, made once


def engine_ops(model_runner) -> EngineOps:
    ops = getattr(model_runner, _OPS, None)
    if ops is None:
        allocator = model_runner.token_to_kv_pool_allocator
        ops = EngineOps(
            allocator.free, allocator.available_size,
            rerun_extend=lambda plan, decode_batch: _rerun_extend(model_runner, decode_batch, plan),
        )  # fmt: skip
        setattr(model_runner, _OPS, ops)
    return ops


def _rerun_extend(model_runner, decode_batch, plan) -> None:
    batch = correction_batch(decode_batch, plan, model_runner.req_to_token_pool.req_to_token)
    model_runner.forward(batch)  # the extend writes K/V at out_cache_loc: the tokens' own slots


def register(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.INIT_NEW, plan_batch, HookType.AFTER)
    hooks.register(targets.FORWARD, run_step, HookType.AROUND)
    hooks.register(targets.CAN_RUN_GRAPH, graph_fits, HookType.AROUND)
