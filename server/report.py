"""What each request's policy did, reported with its answer.

Native ``/generate``: ``meta_info`` carries, per output token (SGLang's ``customized_info``
channel: one entry per token, accumulated over a stream), ``kv_policy`` (the policy that decoded
it: the served one, or ``full`` for a request that opted out), ``kv_retained_tokens`` (KV tokens
the request held after that step), ``kv_evicted_tokens`` (freed by eviction so far) and
``kv_attended_tokens`` (tokens attended at that step, mean over layers, before ART's early stop).
The last entries are the request's state at its end.

OpenAI ``/v1/chat/completions`` and ``/v1/completions``: the response's ``sglext`` object (SGLang's
place for extension fields) gets ``kv_policy``: {name, retained_kv_tokens, evicted_tokens,
mean_attended_tokens}, of the first choice; a stream gets it in a last chunk of its own (no
choices, as SGLang's own ``sglext`` chunk) before ``[DONE]``.

Hooks (HookRegistry): ``ForwardBatch.init_new`` AFTER keeps the batch's requests on the forward
batch; ``ModelRunner.forward`` AROUND fills the step's entries into its ``logits_output``, from
host data only; the OpenAI builders AFTER add the summary; for streams, an AROUND hook on each
stream generator marks its request, and one on ``TokenizerManager.generate_request`` keeps the
latest meta_info on a marked request.
"""

from __future__ import annotations

import time
from statistics import fmean

from sglang_ext import eviction, request_policy

KEYS = ("kv_policy", "kv_retained_tokens", "kv_evicted_tokens", "kv_attended_tokens")
_REQS_ATTR = "sglang_ext_reqs"
_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response"
_COMPLETION = (
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response"
)
_GENERATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
_CHAT_STREAM = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream"
_COMPLETION_STREAM = (
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._generate_completion_stream"
)
_LAST_META = "_sglang_ext_last_meta"  # on a streamed OpenAI request's GenerateReqInput
_DONE = "data: [DONE]\n\n"


def request_step(policy, req, seq_len: int, num_layers: int, extend: bool = False):
    """(own policy or None for full attention, KV tokens held, evicted so far, tokens attended
    at this step) of one request of a batch; metrics observe the same."""
    own = request_policy.of_request(policy, req)
    state = getattr(req, eviction.STATE_ATTR, None)
    evicted = state.evicted if state is not None else 0
    held = seq_len - evicted
    if extend or own is None:
        attended = float(seq_len)
    elif state is not None:
        attended = float(held)
    else:
        attended = own.attended_tokens(seq_len, num_layers)
    return own, held, evicted, attended


def step_entries(policy, reqs, seq_lens: list[int], num_layers: int, extend: bool) -> dict[str, list]:
    """One entry per request of a batch for each of KEYS."""
    entries = {key: [] for key in KEYS}
    for req, seq_len in zip(reqs, seq_lens, strict=True):
        own, held, evicted, attended = request_step(policy, req, seq_len, num_layers, extend)
        entries["kv_policy"].append(request_policy.FULL if own is None else policy.name)
        entries["kv_retained_tokens"].append(held)
        entries["kv_evicted_tokens"].append(evicted)
        entries["kv_attended_tokens"].append(round(attended, 1))
    return entries


def summary(meta_info: dict) -> dict | None:
    """A request's report in one object, from its meta_info's per-token entries."""
    if not meta_info.get("kv_policy"):
        return None
    attended = [a for a in meta_info["kv_attended_tokens"] if a is not None]
    return {
        "name": meta_info["kv_policy"][-1],
        "retained_kv_tokens": meta_info["kv_retained_tokens"][-1],
        "evicted_tokens": meta_info["kv_evicted_tokens"][-1],
        "mean_attended_tokens": round(fmean(attended), 1) if attended else None,
    }


def _with_summary(response, ret):
    from fastapi.responses import ORJSONResponse

    items = ret if isinstance(ret, list) else [ret]
    report = summary(items[0].get("meta_info", {})) if items else None
    if report is None or isinstance(response, ORJSONResponse):
        return response
    body = response.model_dump()
    body["sglext"] = {**(body.get("sglext") or {}), "kv_policy": report}
    return ORJSONResponse(content=body)


async def keep_last_meta(generate, manager, obj, *args, **kwargs):
    """TokenizerManager.generate_request, keeping the latest meta_info of the first output on a
    request a stream marked (``_LAST_META``); others pass through untouched."""
    marked = hasattr(obj, _LAST_META)
    async for out in generate(manager, obj, *args, **kwargs):
        first = out[0] if isinstance(out, list) and out else out
        if marked and isinstance(first, dict) and "meta_info" in first:
            setattr(obj, _LAST_META, first["meta_info"])
        yield out


def stream_with_report(chunk_object: str):
    """An AROUND hook for an OpenAI stream generator: its chunks, then the report before [DONE]."""
    import orjson

    async def stream(generate_stream, serving, adapted_request, request, *args, **kwargs):
        setattr(adapted_request, _LAST_META, None)
        async for chunk in generate_stream(serving, adapted_request, request, *args, **kwargs):
            meta = getattr(adapted_request, _LAST_META)
            report = summary(meta) if chunk == _DONE and meta else None
            if report is not None:
                body = {"id": meta["id"], "object": chunk_object, "created": int(time.time()),
                        "model": request.model, "choices": [], "sglext": {"kv_policy": report}}  # fmt: skip
                yield f"data: {orjson.dumps(body).decode()}\n\n"
            yield chunk

    return stream


def install() -> None:
    """Register the hooks (from the plugin, before SGLang applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def keep_reqs(forward_batch, cls, batch, *args, **kwargs):
        setattr(forward_batch, _REQS_ATTR, getattr(batch, "reqs", None))
        return forward_batch

    def report_step(forward, model_runner, forward_batch, *args, **kwargs):
        output = forward(model_runner, forward_batch, *args, **kwargs)
        policy = getattr(model_runner.attn_backend, "kv_policy", None)
        reqs = getattr(forward_batch, _REQS_ATTR, None)
        logits = getattr(output, "logits_output", None)
        mode = forward_batch.forward_mode
        if (
            policy is None or not reqs or forward_batch.seq_lens_cpu is None
            or not hasattr(logits, "customized_info")
            or not (mode.is_decode() or mode.is_extend())
        ):  # fmt: skip
            return output
        entries = step_entries(
            policy, reqs, forward_batch.seq_lens_cpu.tolist(),
            model_runner.model_config.num_hidden_layers, extend=mode.is_extend(),
        )  # fmt: skip
        logits.customized_info = {**(logits.customized_info or {}), **entries}
        return output

    def chat_summary(response, serving, request, ret, *args, **kwargs):
        return _with_summary(response, ret)

    HookRegistry.register(_INIT_NEW, keep_reqs, HookType.AFTER)
    HookRegistry.register(_FORWARD, report_step, HookType.AROUND)
    HookRegistry.register(_CHAT, chat_summary, HookType.AFTER)
    HookRegistry.register(_COMPLETION, chat_summary, HookType.AFTER)
    HookRegistry.register(_GENERATE, keep_last_meta, HookType.AROUND)
    HookRegistry.register(_CHAT_STREAM, stream_with_report("chat.completion.chunk"), HookType.AROUND)
    HookRegistry.register(_COMPLETION_STREAM, stream_with_report("text_completion"), HookType.AROUND)
