"""A request's own KV policy: ``custom_params.kv_policy`` in the native ``/generate``
sampling_params or the OpenAI body (SGLang carries ``custom_params`` to the scheduler's Req).

    {"kv_policy": {"name": "lethe", "recent_ratio": 0.5}}   # the served policy, own parameters
    {"kv_policy": {"name": "full"}}                          # opt out: keep every token

A request may choose the served policy (``name`` may be left out) with the parameters its class
lists in ``request_params``, or full attention where the class allows ``request_opt_out``; all
other parameters stay the server's (``--policy-config``). The HTTP process validates (a bad
field is an HTTP 400 naming ``kv_policy.FIELD``); the scheduler resolves the same spec again, once per request (``of_request``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang_ext.policies import KVPolicy, PolicyConfigError

logger = logging.getLogger(__name__)

_INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
KEY = "kv_policy"
FULL = "full"


def request_spec(custom_params: Any) -> Any:
    return custom_params.get(KEY) if isinstance(custom_params, dict) else None


def request_policy(served: KVPolicy, custom_params: Any) -> KVPolicy | None:
    """The policy a request decodes under: ``served`` when it asks nothing, ``served`` with its
    own parameters, or None for full attention. Raises PolicyConfigError("kv_policy.FIELD")."""
    spec = request_spec(custom_params)
    if spec is None:
        return served
    if not isinstance(spec, dict):
        raise PolicyConfigError(KEY, f"expected an object, got {type(spec).__name__}")
    spec = dict(spec)
    name = spec.pop("name", served.name)
    choices = [served.name] + ([FULL] if served.request_opt_out and served.name != FULL else [])
    if name not in choices:
        raise PolicyConfigError(f"{KEY}.name", f"this server serves {served.name}; got {name!r}", choices)
    if name == FULL and served.name != FULL:
        if spec:
            raise PolicyConfigError(f"{KEY}.{next(iter(spec))}", "full attention takes no parameters")
        return None
    allowed = list(served.request_params)
    for key in spec:
        if key not in served.schema():
            raise PolicyConfigError(f"{KEY}.{key}", f"unknown parameter of {served.name}", allowed or None)
        if key not in allowed:
            raise PolicyConfigError(
                f"{KEY}.{key}", "set for the whole server by --policy-config, not per request",
                allowed or None,
            )  # fmt: skip
    try:
        chosen = dataclasses.replace(served, **spec)
        served.validate_request(chosen)
    except PolicyConfigError as err:
        raise PolicyConfigError(f"{KEY}.{err.field.rsplit('.', 1)[-1]}", err.detail) from None
    return chosen


_ATTR = "_sglang_ext_policy"


def of_request(served: KVPolicy, req) -> KVPolicy | None:
    """``request_policy`` of a scheduler Req, resolved once per served policy object (the
    scheduler's, or the backend's with the model's layer lists) and kept on it. The HTTP process
    refused invalid specs already; one that got past it (an engine used without the HTTP
    server) is served the server's policy rather than crash the scheduler."""
    resolved = getattr(req, _ATTR, None)
    if resolved is None:
        resolved = {}
        setattr(req, _ATTR, resolved)
    key = id(served)  # served policies live as long as the server
    if key not in resolved:
        try:
            resolved[key] = request_policy(served, req.sampling_params.custom_params)
        except PolicyConfigError as err:
            logger.warning("sglang_ext: request %s: %s; serving %s", req.rid, err, served.name)
            resolved[key] = served
    return resolved[key]


def install() -> None:
    """Where the decode kernels read per-request values (DecodeContext.request_values), write
    each request's own into its request pool row at its prefill: a HookRegistry AFTER hook on
    ``ForwardBatch.init_new``, once per extend batch; decode batches read the rows as they are."""
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def fill_rows(forward_batch, cls, batch, model_runner, *args, **kwargs):
        backend = model_runner.attn_backend
        table = getattr(backend, "request_values", None)
        reqs = getattr(batch, "reqs", None)
        if table is None or not reqs or not forward_batch.forward_mode.is_extend():
            return forward_batch
        served = backend.kv_policy
        values = [served.request_values(of_request(served, req)) for req in reqs]
        table[forward_batch.req_pool_indices] = torch.tensor(values, dtype=table.dtype).to(table.device)
        return forward_batch

    HookRegistry.register(_INIT_NEW, fill_rows, HookType.AFTER)
