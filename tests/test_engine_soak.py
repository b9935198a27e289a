"""CI's soak: loadtest.soak for one minute (locust against a lethe,delta,tidal,full CPU server,
each request one of them, with rounds, selections and aborts; strict KV checks): no request
failed that was not aborted on purpose, and the server is idle, healthy, leak-free afterwards. The 10-minute run is in
benchmarks/RESULTS.md."""

import json

import pytest
from tools import tool

from loadtest import soak

pytestmark = pytest.mark.engine


def test_a_minute_of_load_with_aborts_and_eviction(tmp_path):
    out = tmp_path / "soak"
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--duration", "60s", "--locust", tool("locust"), "--out-dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert exit_.value.code == 0, summary
    assert summary["failed"] == 0 and summary["requests"] >= 10
    assert summary["aborted_on_purpose"] >= 1 and summary["eviction_rounds"] >= 1
    assert summary["selected"] == ["delta", "tidal"]  # their requests shared the batches
    assert sorted(summary["decoded_by_policy"]) == ["delta", "full", "lethe", "tidal"]
