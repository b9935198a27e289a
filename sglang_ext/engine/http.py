"""SGLang's HTTP process: request checks at the door, the report in OpenAI responses, and the
extension's routes and body limit on SGLang's FastAPI app."""

from __future__ import annotations

import time

from sglang_ext.engine import targets
from sglang_ext.policies import KVPolicy
from sglang_ext.server import report, routes, validation

_LAST_META = "_sglang_ext_last_meta"  # on a streamed OpenAI request's GenerateReqInput
_DONE = "data: [DONE]\n\n"


def request_checks(served: KVPolicy):
    """A BEFORE hook on SGLang's per-request check: its ValueError is SGLang's 400."""

    def check_request(tokenizer_manager, obj, input_ids, *args, **kwargs):
        from sglang.srt.managers.io_struct import GenerateReqInput

        if isinstance(obj, GenerateReqInput):
            if obj.text is not None and obj.input_ids is not None:
                raise ValueError("text, input_ids: give one of them, not both")
            error = validation.policy_error(served, (obj.sampling_params or {}).get("custom_params"))
            if error is not None:
                raise ValueError(error)
        if input_ids:
            vocab = tokenizer_manager.model_config.vocab_size
            bad = validation.out_of_vocabulary(input_ids, vocab)
            if bad is not None:
                raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        return None

    return check_request


def normalize_or_refuse(normalize, obj, *args, **kwargs):
    """Around ``GenerateReqInput.normalize_batch_and_arguments``: it also splits a batch into its
    items (SGLang does it next, and caches them), turning lookup and type errors into the
    ValueError SGLang answers with 400."""
    try:
        result = normalize(obj, *args, **kwargs)
        if not getattr(obj, "is_single", True):
            for i in range(len(obj.rid)):
                obj[i]  # noqa: B018 (the item, built and cached as SGLang's next step does)
        return result
    except (ValueError, IndexError, KeyError, TypeError, AttributeError) as err:
        if not hasattr(obj, "is_single"):  # SGLang's abort task after the 400 reads it
            obj.is_single = not isinstance(obj.rid, list)
        if isinstance(err, ValueError):
            raise
        raise ValueError(f"malformed request: {err}") from None


async def check_detokenize(handle, serving, adapted_request, request, *args, **kwargs):
    vocab = serving.tokenizer_manager.model_config.vocab_size
    tokens = request.tokens if isinstance(request.tokens, list) else []
    flat = [t for row in tokens for t in (row if isinstance(row, list) else [row])]
    bad = validation.out_of_vocabulary(flat, vocab)
    if bad is not None:
        return serving.create_error_response(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})")
    return await handle(serving, adapted_request, request, *args, **kwargs)


def with_summary(response, serving, request, ret, *args, **kwargs):
    """After an OpenAI response builder: ``sglext.kv_policy`` from the first choice's meta_info."""
    from fastapi.responses import ORJSONResponse

    items = ret if isinstance(ret, list) else [ret]
    summary = report.summary(items[0].get("meta_info", {})) if items else None
    if summary is None or isinstance(response, ORJSONResponse):
        return response
    body = response.model_dump()
    body["sglext"] = {**(body.get("sglext") or {}), "kv_policy": summary}
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
            summary = report.summary(meta) if chunk == _DONE and meta else None
            if summary is not None:
                body = {"id": meta["id"], "object": chunk_object, "created": int(time.time()),
                        "model": request.model, "choices": [], "sglext": {"kv_policy": summary}}  # fmt: skip
                yield f"data: {orjson.dumps(body).decode()}\n\n"
            yield chunk

    return stream


def register(hooks, served: KVPolicy) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    hooks.register(targets.VALIDATE, request_checks(served), HookType.BEFORE)
    hooks.register(targets.NORMALIZE, normalize_or_refuse, HookType.AROUND)
    hooks.register(targets.DETOKENIZE, check_detokenize, HookType.AROUND)
    hooks.register(targets.CHAT, with_summary, HookType.AFTER)
    hooks.register(targets.COMPLETION, with_summary, HookType.AFTER)
    hooks.register(targets.GENERATE, keep_last_meta, HookType.AROUND)
    hooks.register(targets.CHAT_STREAM, stream_with_report("chat.completion.chunk"), HookType.AROUND)
    hooks.register(targets.COMPLETION_STREAM, stream_with_report("text_completion"), HookType.AROUND)


def install_app(policy: KVPolicy, max_request_bytes: int) -> None:
    """The extension's routes and the body limit on SGLang's FastAPI app (launcher process)."""
    from sglang.srt.entrypoints.http_server import app

    routes.install(app, policy)
    app.add_middleware(validation.BodyLimit, max_bytes=max_request_bytes)
