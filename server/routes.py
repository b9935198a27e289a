"""The extension's own HTTP routes on SGLang's FastAPI app (so SGLang's ``--api-key`` middleware
guards them like its own routes)."""

from __future__ import annotations

from typing import Any

from sglang_ext.policies import KVPolicy, policy_names
from sglang_ext.policies.build import composition_names


def policy_info(policy: KVPolicy) -> dict[str, Any]:
    """What ``GET /policy`` answers: the policy served, its parameters' schema, what a request
    may choose for itself (sglang_ext.request_policy: the policies it may name, the first its
    default, each with the parameters it may set), the names a ``--policy`` may take."""
    choices = policy.request_choices()
    return {
        "policy": policy.describe(),
        "parameters": policy.schema(),
        "per_request": {
            "parameters": list(policy.request_params), "full": policy.request_opt_out,
            "policies": {name: list(p.request_params) if p else [] for name, p in choices.items()},
        },  # fmt: skip
        "available": [*policy_names(), *composition_names()],
    }


def install(app, policy: KVPolicy) -> None:
    """Add the routes to SGLang's HTTP app (sglang.srt.entrypoints.http_server.app)."""
    info = policy_info(policy)  # fixed for the server's life: built once, not per request

    @app.get("/policy")
    async def get_policy() -> dict[str, Any]:
        return info
