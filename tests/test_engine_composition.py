"""The real SGLang engine on CPU with SmolLM2 serving eviction under selection (``lethe+tidal``,
``lethe+delta``, ``snapkv+tidal``) beside Lethe alone, in one mix: with a selection budget that
covers what Lethe keeps, a composed request gives Lethe's greedy tokens; with a small one its
sparse layers read a part of it; a public scorer composes as Lethe does; the rounds free slots
and SGLang's strict KV checks stay silent."""

import re

import pytest
import requests

from server import assert_pool_exact, policy_servers

pytestmark = pytest.mark.engine

# Rounds from 128 tokens on whose choice reads no score (the recent window fills the cap but for
# the sinks): the eviction alone and under a selection keep the same tokens, whichever layers
# score them.
EVICTION = {"evict_threshold": 128, "max_kv_ratio": 0.5, "recent_ratio": 0.99}
MIX = "lethe,lethe+tidal,lethe+delta,snapkv+tidal,full"
CONFIG = {
    "lethe": EVICTION,
    "lethe+tidal": {**EVICTION, "tidal": {"budget_tokens": 1024}},  # more than Lethe keeps
    "lethe+delta": {**EVICTION, "delta": {"budget_pages": 2, "recent_pages": 1}},  # 32 tokens
    "snapkv+tidal": {"compression_ratio": 0.5, "compression_interval": 32,
                     "tidal": {"budget_tokens": 64}},
}  # fmt: skip
PROMPTS = [
    f"Ledger {k}. " + " ".join(f"Fact {i}: the {color} box holds {i * k} marbles." for i, color in
                               enumerate(["red", "blue", "green", "yellow", "white"] * 5))
    + f" Question {k}: how many marbles does the green box of fact 2 hold? Answer:"
    for k in (3, 5)
]  # fmt: skip
ROUND = re.compile(r"(\w+)\+(tidal|delta) round \d+ of (\w+): (\d+) positions, freed (\d+) slots")


@pytest.fixture(scope="module")
def server(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("composition-logs")
    flags = ["--max-total-tokens", "4096", "--log-level", "info", "--dtype", "float32"]
    with policy_servers(model_path, strict_env, logs, {"mix": (MIX, CONFIG, flags)}) as started:
        yield started["mix"]


def _generate(server, names, max_new_tokens=48):
    texts = [prompt for _ in names for prompt in PROMPTS]
    params = [
        {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
         "custom_params": {"kv_policy": {"name": name}}}
        for name in names for _ in PROMPTS
    ]  # fmt: skip
    response = requests.post(
        f"{server.url}/generate", json={"text": texts, "sampling_params": params}, timeout=900
    )
    response.raise_for_status()
    out = response.json()
    return {name: out[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i, name in enumerate(names)}


def test_eviction_under_selection_reads_only_what_the_eviction_keeps(server):
    out = _generate(server, ["lethe", "lethe+tidal", "lethe+delta", "snapkv+tidal"])
    alone, tidal, delta = out["lethe"], out["lethe+tidal"], out["lethe+delta"]
    for lethe, composed in zip(alone, tidal, strict=True):
        assert composed["output_ids"] == lethe["output_ids"]  # its selection covers Lethe's set
        meta, own = composed["meta_info"], lethe["meta_info"]
        assert meta["kv_policy"][-1] == "lethe+tidal"
        assert meta["kv_evicted_tokens"][-1] == own["kv_evicted_tokens"][-1] > 0
    for composed in delta:  # 32 tokens of what Lethe keeps at its sparse layers
        meta = composed["meta_info"]
        assert meta["kv_evicted_tokens"][-1] > 0
        assert meta["kv_attended_tokens"][-1] < meta["kv_retained_tokens"][-1]
    for composed in out["snapkv+tidal"]:  # 64 of the half of the prompt SnapKV keeps
        meta = composed["meta_info"]
        assert meta["kv_policy"][-1] == "snapkv+tidal"
        assert meta["kv_evicted_tokens"][-1] > 0
        assert meta["kv_attended_tokens"][-1] < meta["kv_retained_tokens"][-1]
    rounds = ROUND.findall(server.log())
    assert {(base, top) for base, top, *_ in rounds} == {
        ("lethe", "tidal"), ("lethe", "delta"), ("snapkv", "tidal")
    }
    assert all(int(freed) > 0 for *_, freed in rounds)
    assert_pool_exact(server)


def test_a_composed_request_may_opt_out_to_full_attention(server):
    body = {"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "custom_params": {"kv_policy": {"name": "full"}}}}
    info = requests.get(f"{server.url}/policy", timeout=30).json()
    assert list(info["per_request"]["policies"]) == MIX.split(",")
    assert info["policy"]["lethe+tidal"]["tidal"]["budget_tokens"] == 1024
    assert {"lethe+tidal", "lethe+delta", "snapkv+tidal"} <= set(info["available"])
    full = requests.post(f"{server.url}/generate", json=body, timeout=300).json()
    assert full["meta_info"]["kv_evicted_tokens"][-1] == 0
    assert_pool_exact(server)
