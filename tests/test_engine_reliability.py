"""Bad input, aborts and shutdown against the real SGLang engine (CPU, SmolLM2) serving
``--policy lethe`` with rounds from 64 tokens on: every answer is the expected HTTP status naming
what is wrong, and afterwards the server is healthy and SGLang's KV conservation checks (strict,
every step and at idle) hold. Also per-request policies (``custom_params.kv_policy``) and the
policy's Prometheus metrics."""

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from server import ServerProcess, assert_pool_exact, free_port, metric, policy_servers
from tools import tool
from sglang_ext.server import report

pytestmark = pytest.mark.engine

CONTEXT = 2048
QUEUE_CAP = 2
FLAGS = [
    "--log-level", "info", "--dtype", "float32", "--max-total-tokens", "16384",
    "--context-length", str(CONTEXT), "--max-queued-requests", str(QUEUE_CAP),
    "--max-running-requests", "4", "--enable-metrics",
]  # fmt: skip
LETHE = {"evict_threshold": 64}
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
ROUND = re.compile(r"lethe round \d+ of (\w+):")


@pytest.fixture(scope="module")
def server(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("reliability-logs")
    with policy_servers(model_path, strict_env, logs, {"lethe": ("lethe", LETHE, FLAGS)}) as started:
        yield started["lethe"]


@pytest.fixture
def healthy_after(server):
    """The server still serves, its KV pool is exact at idle, and nothing crashed."""
    yield server
    assert_pool_exact(server)


def native(text=STORY, **sampling):
    return {"text": text, "sampling_params": {"max_new_tokens": 8, **sampling}}


def with_policy(spec):
    return native(custom_params={"kv_policy": spec})


JSON = {"Content-Type": "application/json"}
BAD_REQUESTS = {
    "malformed JSON": dict(data=b'{"text": "hi", ', headers=JSON),
    "wrong content type": dict(data=b"text=hi", headers={"Content-Type": "text/plain"}),
    "empty prompt": dict(json=native("")),
    "text and input_ids": dict(json={**native(), "input_ids": [1, 2, 3]}),
    "temperature -1": dict(json=native(temperature=-1)),
    "temperature NaN": dict(data=b'{"text": "hi", "sampling_params": {"temperature": NaN}}', headers=JSON),
    "top_p 0": dict(json=native(top_p=0)),
    "token id past the vocabulary": dict(json={"input_ids": [1, 10**6], "sampling_params": {}}),
    "negative token id": dict(json={"input_ids": [1, -5], "sampling_params": {}}),
    "prompt over the context": dict(json={"input_ids": [42] * (CONTEXT + 10)}),
    "prompt and max tokens over the context": dict(
        json={"input_ids": [42] * (CONTEXT - 100), "sampling_params": {"max_new_tokens": 200}}
    ),
    "unknown policy field": dict(json=with_policy({"budget": 1024})),
    "policy parameter out of range": dict(json=with_policy({"recent_ratio": 1.5})),
    "server-wide policy parameter": dict(json=with_policy({"decay": 0.5})),
    "policy the server does not serve": dict(json=with_policy({"name": "delta"})),
    "policy spec not an object": dict(json=with_policy("lethe")),
    # found by schemathesis: IndexErrors in SGLang's normalization, 500s
    "empty input_embeds": dict(json={"input_embeds": [], "sampling_params": {}}),
    "batch with a short per-item list": dict(
        json={"text": ["a", "b"], "multi_item_delimiter_indices": [[1]], "sampling_params": {}}
    ),
}
# what the error must name, where the cause is a field of ours
NAMED = {
    "text and input_ids": "input_ids",
    "token id past the vocabulary": "input_ids",
    "negative token id": "input_ids",
    "unknown policy field": "kv_policy.budget",
    "policy parameter out of range": "kv_policy.recent_ratio",
    "server-wide policy parameter": "kv_policy.decay",
    "policy the server does not serve": "kv_policy.name",
    "policy spec not an object": "kv_policy",
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_native_requests_get_400(healthy_after, case):
    response = requests.post(f"{healthy_after.url}/generate", timeout=120, **BAD_REQUESTS[case])
    assert response.status_code == 400, (response.status_code, response.text[:300])
    assert NAMED.get(case, "") in response.text


def test_a_50_mb_body_gets_413_before_it_is_read(healthy_after):
    body = b'{"text": "' + b"a" * (50 * 2**20) + b'"}'
    started = time.monotonic()
    response = requests.post(f"{healthy_after.url}/generate", data=body, headers=JSON, timeout=120)
    assert response.status_code == 413 and "--max-request-bytes" in response.text
    assert time.monotonic() - started < 30


def test_openai_bad_policy_field_gets_400_naming_it(healthy_after):
    body = {
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "custom_params": {"kv_policy": {"recent_ratio": -1}},
    }  # fmt: skip
    response = requests.post(f"{healthy_after.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400 and "kv_policy.recent_ratio" in response.text


def rounds_of(server, rid: str) -> int:
    return sum(1 for found in ROUND.findall(server.log()) if found == rid)


def test_a_request_may_opt_out_or_set_its_own_lethe_parameters(healthy_after):
    server = healthy_after
    runs = {}
    for label, spec in {"served": None, "full": {"name": "full"}, "late": {"evict_threshold": 4096}}.items():
        body = native(max_new_tokens=96, temperature=0, ignore_eos=True)
        if spec is not None:
            body["sampling_params"]["custom_params"] = {"kv_policy": spec}
        answer = requests.post(f"{server.url}/generate", json=body, timeout=600).json()
        runs[label] = rounds_of(server, answer["meta_info"]["id"]), answer["meta_info"]
    assert runs["served"][0] >= 1  # 18 prompt + 96 new tokens pass the threshold of 64
    assert runs["full"][0] == 0 and runs["late"][0] == 0
    # each answer reports, per output token, the policy and the KV it held, evicted and attended
    for label, (_, meta) in runs.items():
        assert all(len(meta[key]) == 96 for key in report.KEYS), label
        assert meta["kv_policy"][-1] == ("full" if label == "full" else "lethe")
    total = runs["full"][1]["prompt_tokens"] + 96
    served, full = runs["served"][1], runs["full"][1]
    assert served["kv_evicted_tokens"][-1] > 0 and served["kv_retained_tokens"][-1] < total - 1
    assert served["kv_retained_tokens"][-1] + served["kv_evicted_tokens"][-1] == total - 1
    assert full["kv_evicted_tokens"][-1] == 0 and full["kv_retained_tokens"][-1] == total - 1
    assert full["kv_attended_tokens"][-1] == total - 1


def test_openai_request_chooses_its_policy(healthy_after):
    body = {
        "model": "default", "messages": [{"role": "user", "content": STORY}], "max_tokens": 96,
        "temperature": 0, "ignore_eos": True, "custom_params": {"kv_policy": {"name": "full"}},
    }  # fmt: skip
    before = len(ROUND.findall(healthy_after.log()))
    response = requests.post(f"{healthy_after.url}/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["completion_tokens"] == 96
    reported = response.json()["sglext"]["kv_policy"]
    assert reported["name"] == "full" and reported["evicted_tokens"] == 0
    assert len(ROUND.findall(healthy_after.log())) == before  # one request at a time here


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_an_openai_stream_ends_with_its_report(healthy_after, route):
    body = {"model": "default", "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if route == "/v1/completions":
        body["prompt"] = STORY
    else:
        body["messages"] = [{"role": "user", "content": STORY}]
    with requests.post(f"{healthy_after.url}{route}", json=body, stream=True, timeout=600) as response:
        assert response.status_code == 200, response.text[:300]
        lines = [line for line in response.iter_lines() if line.startswith(b"data:")]
    assert lines[-1] == b"data: [DONE]"
    events = [json.loads(line[5:]) for line in lines[:-1]]
    usage = next(e["usage"] for e in events if e.get("usage"))
    last = events[-1]
    assert last["choices"] == [] and last["object"].endswith("chunk" if "chat" in route else "completion")
    reported = last["sglext"]["kv_policy"]
    assert reported["name"] == "lethe" and reported["evicted_tokens"] > 0  # rounds from 64 tokens
    held = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert reported["retained_kv_tokens"] + reported["evicted_tokens"] == held


def test_client_disconnect_mid_stream_frees_the_request(healthy_after):
    body = native(max_new_tokens=400, ignore_eos=True)
    body["stream"] = True
    with requests.post(f"{healthy_after.url}/generate", json=body, stream=True, timeout=120) as response:
        chunks = response.iter_lines()
        received = [next(chunks) for _ in range(3)]
    assert all(line.startswith(b"data:") for line in received if line)
    healthy_after.wait_idle(timeout=120)  # the scheduler dropped the request


def test_abort_all_during_eviction_rounds(healthy_after):
    server = healthy_after
    results = []

    def long_request():
        body = native(max_new_tokens=1500, ignore_eos=True)
        results.append(requests.post(f"{server.url}/generate", json=body, timeout=600))

    before = len(ROUND.findall(server.log()))
    # no more than the queue cap: sent at once, they may all wait before the first is admitted
    workers = [threading.Thread(target=long_request) for _ in range(QUEUE_CAP)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 300
    while len(ROUND.findall(server.log())) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(ROUND.findall(server.log())) >= before + 3, "no eviction rounds ran"
    requests.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()
    for worker in workers:
        worker.join(timeout=300)
    assert len(results) == QUEUE_CAP
    for response in results:
        finish = response.json()["meta_info"]["finish_reason"] if response.ok else response.json()
        assert "abort" in json.dumps(finish).lower(), finish


def test_a_burst_over_the_queue_cap_gets_503(healthy_after):
    statuses = []

    def one():
        body = native(max_new_tokens=48, ignore_eos=True)
        statuses.append(requests.post(f"{healthy_after.url}/generate", json=body, timeout=600).status_code)

    burst = [threading.Thread(target=one) for _ in range(12)]
    for worker in burst:
        worker.start()
    for worker in burst:
        worker.join()
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses, statuses


def test_sigterm_drains_the_requests_in_flight(model_path, strict_env, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "sglang_ext.launch", "--policy", "lethe",
            "--policy-config", json.dumps(LETHE), "--model-path", str(model_path),
            "--port", str(port), *FLAGS]  # fmt: skip
    server = ServerProcess(argv, strict_env, tmp_path / "sigterm.log", port).start()
    try:
        server.wait_ready()
        results = []  # (when it was answered, the response)
        body = native(max_new_tokens=200, ignore_eos=True)

        def in_flight():
            response = requests.post(f"{server.url}/generate", json=body, timeout=600)
            results.append((time.monotonic(), response))

        worker = threading.Thread(target=in_flight)
        worker.start()
        while "Decode batch" not in server.log():
            time.sleep(0.2)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        worker.join(timeout=600)
        assert results, "the request in flight got no answer"
        answered, response = results[0]
        assert response.status_code == 200, response.text[:300]
        assert response.json()["meta_info"]["completion_tokens"] == 200 and answered > signalled
        # SGLang drains (it logs the requests left every 5 s until none is), then ends its process
        # tree and itself with SIGKILL (kill_process_tree): SIGTERM's own death would cut it short
        assert server.proc.wait(timeout=120) == -signal.SIGKILL
        log = server.log()
        assert "Draining requests" in log and "Remaining number of requests 0" in log
        assert log.index("Remaining number of requests 0") < log.index("kill_process_tree called")
    finally:
        server.stop()


def test_policy_metrics_are_exported_beside_sglangs(healthy_after):
    before = requests.get(f"{healthy_after.url}/metrics", timeout=60).text
    healthy_after.generate(STORY, max_new_tokens=96)
    after = requests.get(f"{healthy_after.url}/metrics", timeout=60).text
    assert "sglang:" in after  # SGLang's own
    assert metric(after, "sglang_ext:eviction_rounds_total") > metric(before, "sglang_ext:eviction_rounds_total")
    assert metric(after, "sglang_ext:evicted_tokens_total") > metric(before, "sglang_ext:evicted_tokens_total")
    assert metric(after, "sglang_ext:attended_tokens_per_step_count") >= 95 + metric(
        before, "sglang_ext:attended_tokens_per_step_count"
    )
    assert metric(after, "sglang_ext:policy_overhead_seconds_count") > 0
    # the last decode step held fewer KV tokens than it had tokens: rounds freed some
    assert 0 < metric(after, "sglang_ext:retained_kv_tokens") < metric(after, "sglang_ext:logical_kv_tokens")


# Routes whose request schemas schemathesis can generate for on this CPU: from SGLang's schemas of
# the generation routes, hypothesis produced no example in 15 minutes on 2 cores; for /generate its
# coverage phase (deterministic cases from the schema) runs in seconds, for the OpenAI generation
# routes not even that (none in 15 minutes): those have the hand-written cases above.
FUZZED_ROUTES = r"^/(v1/models|policy|v1/tokenize|v1/detokenize|model_info)$"


def test_schemathesis_finds_no_server_error(healthy_after, tmp_path):
    run = subprocess.run(
        [tool("st"), "run", f"{healthy_after.url}/openapi.json", "--include-path-regex", FUZZED_ROUTES,
         "--checks", "not_a_server_error", "--max-examples", "10", "--seed", "1", "--workers", "1",
         "--request-timeout", "60"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    assert "Tested: 5" in run.stdout, run.stdout[-2000:]


def test_schemathesis_coverage_of_generate_finds_no_server_error(healthy_after, tmp_path):
    run = subprocess.run(
        [tool("st"), "run", f"{healthy_after.url}/openapi.json", "--include-path-regex", "^/generate$",
         "--phases", "coverage", "--checks", "not_a_server_error", "--seed", "1", "--workers", "1",
         "--request-timeout", "120"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert generated and int(generated[1]) > 100 and generated[1] == generated[2], run.stdout[-2000:]
