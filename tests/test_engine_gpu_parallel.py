"""The GPU tier on two GPUs: policies under SGLang's tensor parallelism (``--tp-size 2``) and its
data-parallel controller (``--dp-size 2``), on qwen1.5b's shape with dummy weights (SmolLM2's 9
query heads do not split over 2 ranks), CUDA graphs on. Skipped with fewer than 2 GPUs; on the
GPU machine ``benchmarks/gpu_tests.sh parallel`` runs it."""

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from benchmarks.harness import shape_config, shape_path
from server import assert_pool_exact, metric, policy_servers

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

SHAPE = "qwen1.5b"
POOL_SIZED = "KV Cache is allocated"
COMMON = [
    "--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", "0.2",
    "--max-total-tokens", "65536", "--context-length", "8192", "--max-running-requests", "16",
    "--cuda-graph-max-bs", "16", "--disable-prefill-cuda-graph", "--enable-metrics",
    "--log-level", "info",
]  # fmt: skip
LETHE = {"evict_threshold": 256, "max_kv_ratio": 0.3}
TP2, DP2 = ["--tp-size", "2"], ["--dp-size", "2"]
# name -> (policy, its config, flags beyond COMMON)
CONFIGS = {
    "lethe_dp2": ("lethe", LETHE, DP2),
    "lethe_tp2": ("lethe", LETHE, TP2),
    # a list per KV head: each rank keeps its own head's lists (qwen1.5b: 2 KV heads)
    "lethe_heads_tp2": ("lethe", {**LETHE, "per_kv_head": True}, TP2),
    "art_tp2": ("art", None, TP2),
}
# GPU_PARALLEL_CONFIGS=lethe_tp2,art_tp2 starts only those (the others' tests are skipped)
if os.environ.get("GPU_PARALLEL_CONFIGS"):
    CONFIGS = {name: CONFIGS[name] for name in os.environ["GPU_PARALLEL_CONFIGS"].split(",")}
ROUND_LOG = re.compile(r" (TP|DP)(\d)\] sglang_ext: lethe round \d+ of \S+: (.*)$", re.M)


@pytest.fixture(scope="module")
def servers(strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gpu-parallel-logs")
    configs = {name: (policy, config, COMMON + more) for name, (policy, config, more) in CONFIGS.items()}
    model = shape_path(SHAPE)
    with policy_servers(model, strict_env, logs, configs, start_after=POOL_SIZED) as started:
        yield started


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = shape_config(SHAPE)["vocab_size"]
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def generate_all(server, input_ids: list[list[int]], max_new_tokens: int, kv_policies=None) -> list:
    """Each prompt as its own greedy request (with its ``kv_policy`` where given), all at once."""

    def one(ids, kv_policy):
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        if kv_policy is not None:
            sampling["custom_params"] = {"kv_policy": kv_policy}
        body = {"input_ids": ids, "sampling_params": sampling}
        response = requests.post(f"{server.url}/generate", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(len(input_ids)) as pool:
        return list(pool.map(one, input_ids, kv_policies or [None] * len(input_ids)))


def rounds_by_rank(log: str, kind: str) -> dict[int, list[str]]:
    """Each TP (or DP) rank's Lethe round lines, in order, without their timestamps."""
    found: dict[int, list[str]] = {}
    for rank_kind, rank, line in ROUND_LOG.findall(log):
        if rank_kind == kind:
            found.setdefault(int(rank), []).append(line)
    return found


def series(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of a Prometheus metric's samples."""
    return [
        dict(re.findall(r'(\w+)="([^"]*)"', labels))
        for labels in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} ", text, re.M)
    ]


def started(servers, name):
    if name not in servers:
        pytest.skip(f"{name} not started (GPU_PARALLEL_CONFIGS)")
    return servers[name]


@pytest.mark.parametrize("name", ["lethe_tp2", "lethe_heads_tp2"])
def test_lethe_under_tensor_parallelism_frees_alike_on_both_ranks(servers, name):
    server = started(servers, name)
    # one batch: four requests under Lethe, one that opted out to full attention
    outs = generate_all(server, prompts(5, 700), 300, kv_policies=[None] * 4 + [{"name": "full"}])
    for out in outs:
        meta = out["meta_info"]
        total = meta["prompt_tokens"] + meta["completion_tokens"]
        assert meta["kv_retained_tokens"][-1] + meta["kv_evicted_tokens"][-1] == total - 1
    assert all(out["meta_info"]["kv_evicted_tokens"][-1] > 0 for out in outs[:4])
    assert outs[4]["meta_info"]["kv_evicted_tokens"][-1] == 0  # opted out: full attention
    ranks = rounds_by_rank(server.log(), "TP")
    # the same rounds, each freeing as many slots from as many available, on both ranks
    assert set(ranks) == {0, 1} and len(ranks[0]) >= 4 and ranks[0] == ranks[1]
    text = server.metrics()
    assert series(text, "sglang_ext:eviction_rounds_total") == [{"policy": "lethe", "tp_rank": "0"}]
    assert metric(text, "sglang_ext:eviction_rounds_total") == len(ranks[0])
    assert_pool_exact(server)


def test_art_under_tensor_parallelism_counts_each_ranks_tiles(servers):
    server = started(servers, "art_tp2")
    generate_all(server, prompts(2, 3000), max_new_tokens=64)
    generate_all(server, prompts(1, 100), max_new_tokens=8)  # counts are copied back a step late
    text = server.metrics()
    ranks = sorted(labels["tp_rank"] for labels in series(text, "sglang_ext:art_tiles_total"))
    assert ranks == ["0", "1"]
    tiles = re.findall(r'^sglang_ext:art_tiles_total{[^}]*tp_rank="(\d)"} (\S+)$', text, re.M)
    assert all(float(value) > 0 for _, value in tiles)
    assert series(text, "sglang_ext:retained_kv_tokens") == [{"policy": "art", "tp_rank": "0"}]
    assert_pool_exact(server)


def test_data_parallel_workers_each_evict_and_report_their_own_requests(servers):
    server = started(servers, "lethe_dp2")
    outs = generate_all(server, prompts(8, 700, seed=2), max_new_tokens=300)
    assert all(out["meta_info"]["kv_evicted_tokens"][-1] > 0 for out in outs)
    workers = rounds_by_rank(server.log(), "DP")
    assert set(workers) == {0, 1}  # SGLang's controller spread the requests over both
    labels = series(server.metrics(), "sglang_ext:eviction_rounds_total")
    assert sorted(sample["dp_rank"] for sample in labels) == ["0", "1"]
    assert_pool_exact(server)


def test_every_rank_builds_the_policy_backend(servers):
    """The adapter runs in every scheduler process: each rank (or worker) built its backend."""
    for name, server in servers.items():
        built = re.findall(r" (?:TP|DP)(\d)\] sglang_ext: \w+ decoding with policy", server.log())
        assert sorted(set(built)) == ["0", "1"], name

