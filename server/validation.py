"""Requests SGLang would take and then fail on, refused at the door with an HTTP 4xx instead.

- A body over ``--max-request-bytes`` is answered 413 before it is read whole (SGLang reads and
  tokenizes any size, holding the tokenizer for minutes on a huge prompt).
- In SGLang's own per-request check (``TokenizerManager._validate_one_request``, whose ValueError
  its routes answer with 400; the hook is in ``sglang_ext.engine.http``): a token id outside the
  vocabulary (the scheduler's embedding lookup raises IndexError and takes the server down; SGLang
  has a vocabulary check but never calls it), ``text`` and ``input_ids`` together (SGLang silently
  drops the text), and a ``custom_params.kv_policy`` the served policy does not allow
  (sglang_ext.request_policy), the message naming the field.
- ``/v1/detokenize`` with a token id outside the vocabulary: 400 (the tokenizer's overflow was a
  500).
- A request whose fields SGLang's request normalization cannot make sense of (schemathesis found
  ``"input_embeds": []`` and a batch's per-item lists shorter than the batch, IndexErrors and
  500s): 400 with the error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sglang_ext.policies import KVPolicy, PolicyConfigError
from sglang_ext.request_policy import request_policy

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


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


def policy_error(served: KVPolicy, custom_params: Any) -> str | None:
    """Why a request's ``custom_params.kv_policy`` is refused, naming the field; None: it is fine."""
    try:
        request_policy(served, custom_params)
    except PolicyConfigError as err:
        return f"custom_params.{err.field}: {err.detail}"
    return None


def out_of_vocabulary(token_ids: Iterable, vocab_size: int):
    """The first integer token id outside [0, vocab_size), or None."""
    return next(
        (t for t in token_ids if isinstance(t, int) and not 0 <= t < vocab_size), None
    )
