"""The GPU tier of the engine tests: the real SGLang engine on CUDA with SmolLM2's real weights,
CUDA graphs on, the policies on the FlashInfer base (the launcher's default there). Skipped
without CUDA; on the GPU machine ``benchmarks/gpu_tests.sh`` runs it with the kernel tests."""

import re
import sys

import pytest
import requests
import torch

from server import ServerProcess, free_port, policy_servers

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA"),
]

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three most important inventions of the twentieth century are",
]
# About 300 tokens: 19 pages, far more than the small budgets.
LONG_PROMPT = " ".join(
    f"Fact {i}: the {color} box holds {i * 7} marbles."
    for i, color in enumerate(["red", "blue", "green", "yellow", "white"] * 5)
) + " Question: how many marbles does the green box of fact 2 hold? Answer:"
# Six servers share one GPU: each takes a small share, and Lethe's per-slot state stays small.
COMMON = [
    "--mem-fraction-static", "0.08", "--max-total-tokens", "32768", "--context-length", "4096",
    "--max-running-requests", "16", "--cuda-graph-max-bs", "16", "--log-level", "info",
]  # fmt: skip
THRESHOLD, MAX_KV_RATIO = 128, 0.3
CONFIGS = {
    "full": ("full", None),
    "delta": ("delta", None),  # 64 pages: covers every prompt here
    "delta_small": ("delta", {"budget_pages": 4, "recent_pages": 1}),
    "tidal_small": ("tidal", {"budget_tokens": 64}),
    "lethe": ("lethe", {"evict_threshold": THRESHOLD, "max_kv_ratio": MAX_KV_RATIO}),
}
ROUND = re.compile(r"lethe round \d+ of (\w+): (\d+) positions, freed (\d+) slots")


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gpu-engine-logs")
    configs = {name: (policy, config, COMMON) for name, (policy, config) in CONFIGS.items()}
    port = free_port()
    vanilla_argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
        "--attention-backend", "flashinfer", "--host", "127.0.0.1", "--port", str(port), *COMMON,
    ]  # fmt: skip
    vanilla = ServerProcess(vanilla_argv, strict_env, logs / "vanilla.log", port).start()
    try:
        with policy_servers(model_path, strict_env, logs, configs) as started:
            vanilla.wait_ready()
            yield {"vanilla": vanilla, **started}
    finally:
        vanilla.stop()


def generate(server, text, max_new_tokens=32):
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    response = requests.post(
        f"{server.url}/generate", json={"text": text, "sampling_params": sampling}, timeout=600
    )
    response.raise_for_status()
    return response.json()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_exact_and_healthy(server):
    server.wait_idle()
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert "Mem Leak" not in server.log() and "Traceback" not in server.log()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_policies_decode_on_flashinfer_with_cuda_graphs(servers, name):
    log = servers[name].log()
    assert "PolicyFlashInferAttnBackend decoding with policy" in log
    assert "Capture cuda graph end" in log  # decode ran in captured graphs, not eagerly


def test_full_gives_vanilla_flashinfers_greedy_tokens(servers):
    ours = generate(servers["full"], PROMPTS)
    theirs = generate(servers["vanilla"], PROMPTS)
    assert [o["output_ids"] for o in ours] == [t["output_ids"] for t in theirs]


def test_delta_with_a_covering_budget_follows_full(servers):
    # bf16: our sparse kernel and FlashInfer round differently, so tokens may part after a while
    ours = generate(servers["delta"], PROMPTS)
    theirs = generate(servers["full"], PROMPTS)
    for o, t in zip(ours, theirs):
        assert common_prefix(o["output_ids"], t["output_ids"]) >= 8, (o["text"], t["text"])


@pytest.mark.parametrize("name", ["delta_small", "tidal_small"])
def test_small_budgets_attend_to_their_selection_and_answer(servers, name):
    out = generate(servers[name], LONG_PROMPT, max_new_tokens=16)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] > 256 and out["text"].strip()
    assert set(meta["kv_policy"]) == {CONFIGS[name][0]}
    # the sparse layers attend to the budget: the mean over layers is well under the context
    assert max(a for a in meta["kv_attended_tokens"] if a is not None) < 0.8 * meta["prompt_tokens"]
    assert_exact_and_healthy(servers[name])


def test_lethe_frees_slots_in_rounds_and_the_pool_stays_exact(servers):
    server = servers["lethe"]
    outs = [generate(server, text, max_new_tokens=300) for text in (PROMPTS[0], LONG_PROMPT)]
    for out in outs:
        rounds = [m for m in ROUND.finditer(server.log()) if m[1] == out["meta_info"]["id"]]
        assert len(rounds) >= 2 and sum(int(m[3]) for m in rounds) > 0
        assert out["meta_info"]["completion_tokens"] == 300
    assert_exact_and_healthy(server)
