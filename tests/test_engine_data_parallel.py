"""A policy under SGLang's data-parallel controller (``--dp-size 2``) on the CPU engine with
SmolLM2's real weights: each worker is its own scheduler process with its own KV pool, Lethe's
rounds and the policy's metrics (labelled ``dp_rank``, as SGLang's own). The GPU tier runs the
same under ``--tp-size 2`` (tests/test_engine_gpu_parallel.py)."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server import assert_pool_exact, metric, policy_servers

from sglang_ext.server.metrics import by_policy

pytestmark = pytest.mark.engine

THRESHOLD = 64
ROUND_LOG = re.compile(r" DP(\d)\] sglang_ext: lethe round ", re.M)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def server(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp-logs")
    config = {"evict_threshold": THRESHOLD}
    configs = {"lethe_dp2": ("lethe", config, ["--dp-size", "2", "--enable-metrics"])}
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started["lethe_dp2"]


def generate_all(server, specs: list) -> list[dict]:
    """One greedy request per entry (its ``kv_policy``, or None), all at once."""

    def one(index_spec):
        index, spec = index_spec
        sampling = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        if spec is not None:
            sampling["custom_params"] = {"kv_policy": spec}
        body = {"text": f"Story {index}: {PROMPT}", "sampling_params": sampling}
        response = requests.post(f"{server.url}/generate", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["meta_info"]

    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(one, enumerate(specs)))


def test_each_worker_evicts_its_requests_and_reports_them_under_its_dp_rank(server):
    metas = generate_all(server, [None] * 4)
    for meta in metas:
        total = meta["prompt_tokens"] + meta["completion_tokens"]
        assert meta["kv_evicted_tokens"][-1] > 0
        assert meta["kv_retained_tokens"][-1] + meta["kv_evicted_tokens"][-1] == total - 1
    rounds = {}
    for worker in ROUND_LOG.findall(server.log()):
        rounds[worker] = rounds.get(worker, 0) + 1
    assert set(rounds) == {"0", "1"}  # the controller spread the requests over both workers
    text = server.metrics()
    for worker, count in rounds.items():
        name = f'sglang_ext:eviction_rounds_total{{dp_rank="{worker}",policy="lethe",tp_rank="0"}}'
        assert metric(text, name) == count


def test_per_request_policies_hold_on_every_worker(server):
    metas = generate_all(server, [{"name": "full"}, {"name": "full"}, {"max_kv_ratio": 0.6}, None])
    assert [meta["kv_evicted_tokens"][-1] for meta in metas[:2]] == [0, 0]
    kept_own, kept_served = (meta["kv_retained_tokens"][-1] for meta in metas[2:])
    assert kept_own > kept_served > 0  # its own cap (0.6) keeps more than the server's (0.3)
    # the requests' series name the policy each decoded under; the rounds, the served one
    text = server.metrics()
    steps = by_policy(text, "sglang_ext:attended_tokens_per_step_count")
    assert steps.get("full", 0) >= 2 * 47 and steps.get("lethe", 0) >= 2 * 47
    assert set(by_policy(text, "sglang_ext:eviction_rounds_total")) == {"lethe"}


def test_each_workers_pool_stays_exact(server):
    # requests spread over both workers, pruned in rounds or opted out; one left mid-stream
    generate_all(server, [None, {"name": "full"}, None])
    server.abort_mid_stream(PROMPT)
    assert_pool_exact(server)  # every worker's pool
