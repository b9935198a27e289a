"""A request's own policy (custom_params.kv_policy): what the served policy allows, errors naming
the field, and the body-size guard's arithmetic."""

import asyncio

import pytest
import torch

from sglang_ext.policies import PolicyConfigError, build_policy
from sglang_ext.request_policy import request_policy
from sglang_ext.server.validation import BodyLimit

LETHE = build_policy("lethe", {"evict_threshold": 256})
DELTA = build_policy("delta", {"budget_pages": 32, "recent_pages": 4})
TIDAL = build_policy("tidal", {"budget_tokens": 256})
ART = build_policy("art", {"patience": 3})


def test_no_spec_is_the_served_policy_and_full_opts_out():
    assert request_policy(LETHE, None) is LETHE
    assert request_policy(LETHE, {"other": 1}) is LETHE
    assert request_policy(LETHE, {"kv_policy": {"name": "full"}}) is None


def test_own_parameters_override_only_those_given():
    own = request_policy(LETHE, {"kv_policy": {"recent_ratio": 0.5}})
    assert own.recent_ratio == 0.5 and own.evict_threshold == 256 and own.decay == LETHE.decay


def test_selection_budgets_and_art_thresholds_per_request_become_kernel_values():
    own = request_policy(DELTA, {"kv_policy": {"name": "delta", "budget_pages": 8}})
    assert own.budget_pages == 8 and own.recent_pages == 4
    assert DELTA.request_columns(DELTA) == {"budget_pages": 32}
    assert DELTA.request_columns(own) == {"budget_pages": 8}
    tidal = request_policy(TIDAL, {"kv_policy": {"budget_tokens": 64}})
    assert TIDAL.request_columns(tidal) == {"budget_tokens": 64}
    own = request_policy(ART, {"kv_policy": {"tau": 1e-3, "patience": 1}})
    assert ART.request_columns(own) == {"tau": 1e-3, "phi": ART.phi, "patience": 1}
    opted_out = request_policy(ART, {"kv_policy": {"name": "full"}})
    assert ART.request_columns(opted_out) == {"tau": ART.tau, "phi": ART.phi, "patience": 0}
    assert LETHE.request_columns(LETHE) == {}  # its own values are the scheduler's, not a kernel's


def test_a_request_table_keeps_each_column_typed_and_writes_only_planned_rows():
    from sglang_ext.policies.request_table import RequestTable

    table = RequestTable({"budget_tokens": 256, "tau": 0.5}, rows=4, device="cpu")
    assert table["budget_tokens"].dtype == torch.int32 and table["tau"].dtype == torch.float32
    table.write(table.plan([2], [{"budget_tokens": 64, "tau": 1e-3}]))
    assert table["budget_tokens"].tolist() == [256, 256, 64, 256]
    assert table["tau"][2].item() == pytest.approx(1e-3) and table["tau"][0].item() == 0.5
    with pytest.raises(TypeError):
        RequestTable({"flag": True}, rows=1, device="cpu")


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
        (DELTA, {"name": "full"}, "kv_policy.name"),
        (DELTA, {"budget_pages": 33}, "kv_policy.budget_pages"),  # over the server's
        (DELTA, {"budget_pages": 3}, "kv_policy.recent_pages"),  # under its recent pages
        (DELTA, {"recent_pages": 2}, "kv_policy.recent_pages"),
        (TIDAL, {"budget_tokens": 0}, "kv_policy.budget_tokens"),
        (ART, {"patience": -1}, "kv_policy.patience"),
        (ART, {"num_kv_splits": 4}, "kv_policy.num_kv_splits"),
        (build_policy("delta+art", {}), {"budget_pages": 8}, "kv_policy.budget_pages"),
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


class QueuedReq:
    """What the scheduler-side check reads and calls on SGLang's Req."""

    def __init__(self, custom_params):
        self.rid, self.to_finish, self.aborted = "r", None, None
        self.sampling_params = type("Params", (), {"custom_params": custom_params})()

    def set_finish_with_abort(self, message):
        self.aborted = self.to_finish = message


def test_a_spec_the_scheduler_cannot_serve_ends_that_request_never_the_default(monkeypatch):
    from sglang_ext.engine import backends, requests

    runtime = type("Runtime", (), {"policy": LETHE})()
    monkeypatch.setattr(backends, "_RUNTIMES", [runtime])
    bad = QueuedReq({"kv_policy": {"name": "lethe", "decay": 0.5}})  # server-wide parameter
    requests.refuse_unusable(None, bad)
    assert "kv_policy.decay" in bad.aborted
    good = QueuedReq({"kv_policy": {"recent_ratio": 0.5}})
    requests.refuse_unusable(None, good)
    assert good.aborted is None
    assert requests.own_policy(LETHE, good).recent_ratio == 0.5  # parsed once, kept on the Req
    with pytest.raises(PolicyConfigError):
        requests.own_policy(LETHE, QueuedReq({"kv_policy": {"name": "tidal"}}))
