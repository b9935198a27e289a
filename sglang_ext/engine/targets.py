"""Every SGLang internal this project hooks, by its dotted path, and the check that they exist.

SGLang's HookRegistry only logs a target it cannot resolve and runs on without the hook; for us
that would mean, say, Lethe's holes reaching the allocator. So every target is resolved before
a hook is registered, and a missing one stops the engine with its name and the pinned version.
"""

from __future__ import annotations

import pkgutil

PINNED_SGLANG = "0.5.17"

_FB = "sglang.srt.model_executor.forward_batch_info"
_OPENAI = "sglang.srt.entrypoints.openai"

# scheduler process: every batch, the model's forward
INIT_NEW = f"{_FB}.ForwardBatch.init_new"
FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
CAN_RUN_GRAPH = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph"
)
# scheduler process: memory (policies that evict)
FREE = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free"
CACHE_UNFINISHED = "sglang.srt.mem_cache.common.maybe_cache_unfinished_req"
UNCACHED_SIZES = (
    "sglang.srt.managers.scheduler_components.invariant_checker."
    "SchedulerInvariantChecker._get_total_uncached_sizes"
)
PREFILL_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
RESOLVE_POOL = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_memory_pool_config"
)
KV_POOL_BUFFERS = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
CHECK_DECODE_MEM = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"
SCHEDULE_PREFILL = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
# scheduler process: a request's own policy, parsed when it is queued
QUEUE_REQUEST = "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue"
# HTTP process: request checks and the per-request report
VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
NORMALIZE = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
DETOKENIZE = f"{_OPENAI}.serving_tokenize.OpenAIServingDetokenize._handle_non_streaming_request"
GENERATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
CHAT = f"{_OPENAI}.serving_chat.OpenAIServingChat._build_chat_response"
CHAT_STREAM = f"{_OPENAI}.serving_chat.OpenAIServingChat._generate_chat_stream"
COMPLETION = f"{_OPENAI}.serving_completions.OpenAIServingCompletion._build_completion_response"
COMPLETION_STREAM = f"{_OPENAI}.serving_completions.OpenAIServingCompletion._generate_completion_stream"

ALL = (
    INIT_NEW, FORWARD, CAN_RUN_GRAPH, FREE, CACHE_UNFINISHED, UNCACHED_SIZES, PREFILL_ADDER, CHECK_DECODE_MEM,
    SCHEDULE_PREFILL, RESOLVE_POOL, KV_POOL_BUFFERS, QUEUE_REQUEST,
    VALIDATE, NORMALIZE, DETOKENIZE, GENERATE, CHAT, CHAT_STREAM, COMPLETION, COMPLETION_STREAM,
)  # fmt: skip


class EngineAdapterError(RuntimeError):
    """SGLang does not have what this adapter was written against."""


def verify(targets=ALL) -> None:
    """Resolve every target; raise EngineAdapterError naming the ones SGLang lacks."""
    import sglang

    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    if missing:
        raise EngineAdapterError(
            f"SGLang {sglang.__version__} lacks {', '.join(missing)}: sglang_ext is written "
            f"against sglang=={PINNED_SGLANG} (pip install sglang=={PINNED_SGLANG})"
        )
