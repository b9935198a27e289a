"""A request's own policy (custom_params.kv_policy): what the served policy allows, errors naming
the field, and the body-size guard's arithmetic."""

import asyncio

import pytest

from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.request_policy import request_policy
from sglang_ext.server.validation import BodyLimit

LETHE = build_policy("lethe", {"evict_threshold": 256})


def test_no_spec_is_the_served_policy_and_full_opts_out():
    assert request_policy(LETHE, None) is LETHE
    assert request_policy(LETHE, {"other": 1}) is LETHE
    assert request_policy(LETHE, {"kv_policy": {"name": "full"}}) is None


def test_own_parameters_override_only_those_given():
    own = request_policy(LETHE, {"kv_policy": {"recent_ratio": 0.5}})
    assert own.recent_ratio == 0.5 and own.evict_threshold == 256 and own.decay == LETHE.decay


@pytest.mark.parametrize(
    "served, spec, field",
    [
        (LETHE, {"recent_ratio": 1.0}, "kv_policy.recent_ratio"),
        (LETHE, {"evict_threshold": "many"}, "kv_policy.evict_threshold"),
        (LETHE, {"decay": 0.5}, "kv_policy.decay"),
        (LETHE, {"budget": 1}, "kv_policy.budget"),
        (LETHE, {"name": "tidal"}, "kv_policy.name"),
        (LETHE, {"name": "full", "recent_ratio": 0.5}, "kv_policy.recent_ratio"),
        (LETHE, [1, 2], "kv_policy"),
        (build_policy("delta", {}), {"name": "full"}, "kv_policy.name"),
        (build_policy("delta", {}), {"budget_pages": 8}, "kv_policy.budget_pages"),
    ],
)
def test_what_a_request_may_not_choose_is_refused_naming_the_field(served, spec, field):
    with pytest.raises(PolicyConfigError) as err:
        request_policy(served, {"kv_policy": spec})
    assert err.value.field == field


def run_asgi(max_bytes: int, chunks: list[bytes], declared: int | None) -> list[int]:
    """Statuses the guarded app answered to one request sent in ``chunks``."""
    sent = []

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def main():
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                 for i, c in enumerate(chunks)]  # fmt: skip
        headers = [] if declared is None else [(b"content-length", str(declared).encode())]

        async def receive():
            return queue.pop(0)

        async def send(message):
            if message["type"] == "http.response.start":
                sent.append(message["status"])

        await BodyLimit(app, max_bytes)({"type": "http", "headers": headers}, receive, send)

    asyncio.run(main())
    return sent


def test_body_limit_by_declared_length_and_by_bytes_read():
    assert run_asgi(10, [b"x" * 10], declared=10) == [200]
    assert run_asgi(10, [b"x" * 11], declared=11) == [413]
    assert run_asgi(10, [b"x" * 6, b"x" * 6], declared=None) == [413]  # chunked, no length
    assert run_asgi(10, [b"x" * 5, b"x" * 5], declared=None) == [200]
