"""SGLang's router (sglang-router, from .venv-tools) in front of two Lethe servers on the CPU
engine with SmolLM2's real weights: requests spread over both, each server's rounds and pool
stay its own, and what of a request's own policy survives the router."""

import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server import assert_pool_exact, free_port, policy_servers
from tools import tool

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20
CONFIG = {"evict_threshold": 64}


@pytest.fixture(scope="module")
def stack(model_path, strict_env, tmp_path_factory):
    """(router URL, the two servers)."""
    logs = tmp_path_factory.mktemp("router-logs")
    configs = {name: ("lethe", CONFIG, []) for name in ("worker_a", "worker_b")}
    with policy_servers(model_path, strict_env, logs, configs) as servers:
        port = free_port()
        argv = [
            tool("python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin",
            "--worker-urls", *(server.url for server in servers.values()),
        ]  # fmt: skip
        with open(logs / "router.log", "wb") as log:
            router = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_routing(url, router)
            yield url, list(servers.values())
        finally:
            router.terminate()
            router.wait(timeout=30)


def _wait_until_routing(url: str, router: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert router.poll() is None, "the router exited"
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"router not routing after {timeout_s}s")


def completions(url: str, custom_params_list: list) -> list[requests.Response]:
    def one(index_params):
        index, custom_params = index_params
        prompt = f"Story {index}: {PROMPT}"
        body = {"model": "smol", "prompt": prompt, "max_tokens": 40, "temperature": 0}
        if custom_params is not None:
            body["custom_params"] = custom_params
        return requests.post(f"{url}/v1/completions", json=body, timeout=600)

    with ThreadPoolExecutor(len(custom_params_list)) as pool:
        return list(pool.map(one, enumerate(custom_params_list)))


def rounds(server) -> int:
    return len(re.findall(r"sglang_ext: lethe round ", server.log()))


def test_requests_spread_over_both_servers_and_each_evicts_its_own(stack):
    url, servers = stack
    responses = completions(url, [None] * 4)
    reports = [response.json()["sglext"]["kv_policy"] for response in responses]
    assert all(report["name"] == "lethe" and report["evicted_tokens"] > 0 for report in reports)
    assert all(rounds(server) > 0 for server in servers)


def test_a_requests_own_policy_passes_the_router_on_v1_completions(stack):
    url, _ = stack
    specs = [{"kv_policy": {"name": "full"}}, {"kv_policy": {"max_kv_ratio": 0.6}}, None]
    opted_out, own, served = (r.json()["sglext"]["kv_policy"] for r in completions(url, specs))
    assert opted_out["name"] == "full" and opted_out["evicted_tokens"] == 0
    assert own["retained_kv_tokens"] > served["retained_kv_tokens"] > 0  # its cap 0.6, not 0.3
    [bad] = completions(url, [{"kv_policy": {"recent_ratio": -1}}])
    assert bad.status_code == 400 and "kv_policy.recent_ratio" in bad.text


def test_the_router_drops_custom_params_of_generate_and_chat(stack):
    """sglang-router 0.3.2 rebuilds /generate and /v1/chat/completions bodies from its own types,
    without ``custom_params``: a request there gets the served policy (README's limits)."""
    url, _ = stack
    spec = {"kv_policy": {"name": "full"}}
    body = {
        "text": f"Story: {PROMPT}",
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "custom_params": spec},
    }
    meta = requests.post(f"{url}/generate", json=body, timeout=600).json()["meta_info"]
    assert meta["kv_evicted_tokens"][-1] > 0
    chat = {
        "model": "smol", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
        "custom_params": spec,
    }  # fmt: skip
    report = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=600).json()["sglext"]
    assert report["kv_policy"]["name"] == "lethe"


def test_both_pools_stay_exact(stack):
    url, servers = stack
    responses = completions(url, [None, {"kv_policy": {"name": "full"}}, None, None])
    assert all(response.status_code == 200 for response in responses)
    assert_pool_exact(*servers)
