"""A request's own KV policy: ``custom_params.kv_policy`` in the native ``/generate``
sampling_params or the OpenAI body (SGLang carries ``custom_params`` to the scheduler's Req).

    {"kv_policy": {"name": "lethe", "recent_ratio": 0.5}}   # the served policy, own parameters
    {"kv_policy": {"name": "full"}}                          # opt out: keep every token

A request may choose the served policy (``name`` may be left out) with the parameters its class
lists in ``request_params``, or full attention where the class allows ``request_opt_out``; all
other parameters stay the server's (``--policy-config``). The HTTP process validates (a bad
field is an HTTP 400 naming ``kv_policy.FIELD``); the scheduler resolves it once per request,
into the request's state (``sglang_ext.engine.requests``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_ext.policies import KVPolicy, PolicyConfigError
from sglang_ext.policies.runtime import FULL

KEY = "kv_policy"


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
