"""Requests SGLang would take and then fail on, refused at the door with an HTTP 4xx instead.

- A body over ``--max-request-bytes`` is answered 413 before it is read whole (SGLang reads and
  tokenizes any size: a 50 MB prompt held the tokenizer for minutes).
- Through a HookRegistry BEFORE hook on ``TokenizerManager._validate_one_request`` (SGLang's own
  per-request check, whose ValueError its routes answer with 400): a token id outside the
  vocabulary (the scheduler's embedding lookup raises IndexError and takes the server down; SGLang
  has a vocabulary check but never calls it), ``text`` and ``input_ids`` together (SGLang silently
  drops the text), and a ``custom_params.kv_policy`` the served policy does not allow
  (sglang_ext.request_policy), the message naming the field.
- ``/v1/detokenize`` with a token id outside the vocabulary: 400 (the tokenizer's overflow was a
  500), through an AROUND hook on its handler.
- A request whose fields ``GenerateReqInput.normalize_batch_and_arguments`` cannot make sense of
  (schemathesis found ``"input_embeds": []`` and a batch's per-item lists shorter than the batch,
  IndexErrors and 500s): 400 with the error, through an AROUND hook that also splits a batch into
  its items there (SGLang does it next, and caches them), turning lookup and type errors into the
  ValueError SGLang answers with 400.
"""

from __future__ import annotations

from sglang_ext.policies import PolicyConfigError

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_NORMALIZE = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
_DETOKENIZE = (
    "sglang.srt.entrypoints.openai.serving_tokenize.OpenAIServingDetokenize._handle_non_streaming_request"
)


class RequestTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``, by its Content-Length or, for
    a chunked body, as soon as the bytes read pass it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge
            return message

        try:
            await self.app(scope, counted_receive, send)
        except RequestTooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = (
            b'{"error": {"message": "request body over the server\'s limit of '
            + str(self.max_bytes).encode()
            + b' bytes (--max-request-bytes)", "code": 413}}'
        )
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def check_request(tokenizer_manager, obj, input_ids, *args, **kwargs):
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_ext.config import active_policy
    from sglang_ext.request_policy import request_policy

    if isinstance(obj, GenerateReqInput):
        if obj.text is not None and obj.input_ids is not None:
            raise ValueError("text, input_ids: give one of them, not both")
        served = active_policy()
        if served is not None:
            try:
                request_policy(served, (obj.sampling_params or {}).get("custom_params"))
            except PolicyConfigError as err:
                raise ValueError(f"custom_params.{err.field}: {err.detail}") from None
    if input_ids:
        vocab = tokenizer_manager.model_config.vocab_size
        bad = next((t for t in input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    return None


def normalize_or_refuse(normalize, obj, *args, **kwargs):
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
    bad = next((t for t in flat if isinstance(t, int) and not 0 <= t < vocab), None)
    if bad is not None:
        return serving.create_error_response(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})")
    return await handle(serving, adapted_request, request, *args, **kwargs)


def install() -> None:
    """Register the request checks (from the plugin, before SGLang applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_VALIDATE, check_request, HookType.BEFORE)
    HookRegistry.register(_NORMALIZE, normalize_or_refuse, HookType.AROUND)
    HookRegistry.register(_DETOKENIZE, check_detokenize, HookType.AROUND)
