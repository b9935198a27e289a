"""A request's own KV policy: ``custom_params.kv_policy`` in the native ``/generate``
sampling_params or the OpenAI body (SGLang carries ``custom_params`` to the scheduler's Req).

    {"kv_policy": {"name": "lethe", "recent_ratio": 0.5}}   # the served policy, own parameters
    {"kv_policy": {"name": "full"}}                          # opt out: keep every token

A request may choose the served policy (``name`` may be left out) with the parameters its class
lists in ``request_params``, or full attention where the class allows ``request_opt_out``; on a
server of several policies (``--policy lethe,delta,full``), any of them, the first by default. All
other parameters stay the server's (``--policy-config``). The HTTP process validates (a bad
field is an HTTP 400 naming ``kv_policy.FIELD``); the scheduler resolves it once per request,
into the request's state (``sglang_ext.engine.requests``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_ext.policies import KVPolicy, PolicyConfigError

KEY = "kv_policy"


def request_spec(custom_params: Any) -> Any:
    return custom_params.get(KEY) if isinstance(custom_params, dict) else None


def request_policy(served: KVPolicy, custom_params: Any) -> KVPolicy | None:
    """The policy a request decodes under: one of ``served.request_choices()`` (the first when it
    names none), with its own parameters; None for full attention opted out of the served policy.
    Raises PolicyConfigError("kv_policy.FIELD")."""
    choices = served.request_choices()
    default_name, default = next(iter(choices.items()))
    spec = request_spec(custom_params)
    if spec is None:
        return default
    if not isinstance(spec, dict):
        raise PolicyConfigError(KEY, f"expected an object, got {type(spec).__name__}")
    spec = dict(spec)
    name = spec.pop("name", default_name)
    if name not in choices:
        raise PolicyConfigError(
            f"{KEY}.name", f"this server serves {served.name}; got {name!r}", list(choices)
        )
    chosen_base = choices[name]
    if chosen_base is None or not chosen_base.schema():
        if spec:
            raise PolicyConfigError(f"{KEY}.{next(iter(spec))}", f"{name} takes no parameters")
        return chosen_base
    allowed = list(chosen_base.request_params)
    for key in spec:
        if key not in chosen_base.schema():
            raise PolicyConfigError(f"{KEY}.{key}", f"unknown parameter of {name}", allowed or None)
        if key not in allowed:
            raise PolicyConfigError(
                f"{KEY}.{key}", "set for the whole server by --policy-config, not per request",
                allowed or None,
            )  # fmt: skip
    try:
        chosen = dataclasses.replace(chosen_base, **spec)
        chosen_base.validate_request(chosen)
    except PolicyConfigError as err:
        raise PolicyConfigError(f"{KEY}.{err.field.rsplit('.', 1)[-1]}", err.detail) from None
    return chosen
