"""The real SGLang engine on CPU with SmolLM2: vanilla SGLang and ``--policy full`` side by side,
the latter behind ``--api-key``."""

import sys
import time

import psutil
import pytest
import requests

from server import ServerProcess, assert_pool_exact, free_port
from sglang_ext.platform import cpu

pytestmark = pytest.mark.engine

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
]
COMMON = ["--max-total-tokens", "4096", "--log-level", "info"]
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    vanilla_port, full_port = free_port(), free_port()
    vanilla = ServerProcess(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
         "--host", "127.0.0.1", "--port", str(vanilla_port), *cpu.as_argv(cpu.server_flags()), *COMMON],
        strict_env, logs / "vanilla.log", vanilla_port,
    )
    full = ServerProcess(
        [sys.executable, "-m", "sglang_ext.launch", "--policy", "full", "--port", str(full_port),
         "--api-key", API_KEY, *COMMON],
        strict_env, logs / "full.log", full_port,
    )
    try:
        for server in (vanilla.start(), full.start()):  # both boot at once
            server.wait_ready()
        yield {"vanilla": vanilla, "full": full}
    finally:
        full.stop()
        vanilla.stop()


def test_launcher_serves_the_embedded_model_on_localhost(servers):
    log = servers["full"].log()
    assert f"at http://127.0.0.1:{servers['full'].port}" in log
    assert "SmolLM2-135M-Instruct" in log


def test_policy_backend_decodes_and_vanilla_is_untouched(servers):
    assert "PolicyTorchNativeAttnBackend decoding with policy {'name': 'full'}" in servers["full"].log()
    assert "decoding with policy" not in servers["vanilla"].log()
    full, vanilla = servers["full"], servers["vanilla"]
    served = requests.get(f"{full.url}/policy", headers=full.headers, timeout=30)
    assert served.status_code == 200 and served.json()["policy"]["name"] == "full"
    # without a policy the package adds nothing to SGLang: not even its route
    assert requests.get(f"{vanilla.url}/policy", timeout=30).status_code == 404


def test_the_embedded_model_is_served_under_its_name(servers):
    full = servers["full"]
    models = requests.get(f"{full.url}/v1/models", headers=full.headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]


def test_full_policy_gives_vanilla_greedy_tokens(servers):
    for prompt in PROMPTS:
        ours = servers["full"].generate(prompt, max_new_tokens=48)
        theirs = servers["vanilla"].generate(prompt, max_new_tokens=48)
        assert ours["output_ids"] == theirs["output_ids"], prompt
        assert len(ours["output_ids"]) > 8


def test_full_policy_gives_vanilla_greedy_tokens_in_a_batch(servers):
    ours = servers["full"].generate(PROMPTS, max_new_tokens=32)
    theirs = servers["vanilla"].generate(PROMPTS, max_new_tokens=32)
    assert [o["output_ids"] for o in ours] == [t["output_ids"] for t in theirs]


def test_chat_completion_knows_the_capital_of_france(servers):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 32,
    }
    full = servers["full"]
    response = requests.post(f"{full.url}/v1/chat/completions", json=body, headers=full.headers, timeout=300)
    response.raise_for_status()
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


def test_the_api_key_guards_the_extensions_routes_as_sglangs(servers):
    full = servers["full"]
    for path in ("/policy", "/v1/models"):  # ours, SGLang's
        assert requests.get(f"{full.url}{path}", timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert requests.get(f"{full.url}{path}", headers=wrong, timeout=30).status_code == 401
        assert requests.get(f"{full.url}{path}", headers=full.headers, timeout=30).status_code == 200
    refused = requests.post(f"{full.url}/generate", json={"text": "hi"}, timeout=30)
    assert refused.status_code == 401
    assert requests.get(f"{full.url}/health", timeout=30).status_code == 200  # open, as SGLang's


def test_an_idle_server_leaves_the_cores_to_the_others(servers):
    # the CPU defaults' --sleep-on-idle: an idle scheduler waits on its sockets (it polled them in a
    # busy loop, a whole core of the two here, 94 % measured)
    for server in (servers["full"], servers["vanilla"]):
        server.wait_idle()
        launcher = psutil.Process(server.proc.pid)
        processes = [launcher, *launcher.children(recursive=True)]
        before = sum(sum(p.cpu_times()[:2]) for p in processes)
        time.sleep(3)
        assert sum(sum(p.cpu_times()[:2]) for p in processes) - before < 0.6


def test_no_kv_leak_after_a_batch_and_an_abort(servers):
    for server in (servers["full"], servers["vanilla"]):
        server.generate(PROMPTS, max_new_tokens=16)
        server.abort_mid_stream(PROMPTS[0])
    assert_pool_exact(servers["full"], servers["vanilla"])
