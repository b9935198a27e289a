"""The real SGLang engine on CPU with SmolLM2 serving ``--policy lethe``: pruning rounds free KV
slots back to SGLang's allocator, a needle survives them, and nothing leaks after abort or
retraction (SGLang's own conservation checks, made strict, run every step and at idle)."""

import json
import math
import re

import pytest
import requests
import transformers

from benchmarks import lookup_task
from server import assert_pool_exact, metric, policy_servers

pytestmark = pytest.mark.engine

THRESHOLD = 128
MAX_KV_RATIO = 0.3
ROUND = re.compile(
    r"lethe round (\d+) of (\w+): (\d+) positions, freed (\d+) slots, "
    r"retained (\d+) \(radix-owned (\d+)\), next threshold \d+, retained per list \[([\d, ]+)\]"
)
# the requests pruned at one step give their slots back in one call
FREED = re.compile(
    r"lethe rounds of (\d+) requests freed (\d+) slots \(available (\d+) -> (\d+)\)"
)
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
COMMON = ["--log-level", "info", "--dtype", "float32"]
SERVERS = {
    # rounds from 128 tokens on: every test request is pruned several times
    "lethe": (
        {"evict_threshold": THRESHOLD, "max_kv_ratio": MAX_KV_RATIO},
        ["--max-total-tokens", "16384"],
    ),
    # per-layer lists (the paper's rule) with per-layer memory: each layer keeps its own tokens
    "layers": (
        {"evict_threshold": THRESHOLD, "max_kv_ratio": MAX_KV_RATIO, "sparse_ratio": 2.0},
        ["--max-total-tokens", "16384", "--enable-metrics"],
    ),
    # lists per KV head (Lethe's default rule otherwise): each head of a layer its own tokens
    "heads": (
        {"evict_threshold": THRESHOLD, "max_kv_ratio": MAX_KV_RATIO, "per_kv_head": True},
        ["--max-total-tokens", "16384", "--enable-metrics"],
    ),
    # pools too small for 4 requests x 175 tokens at their full length
    "admit": ({"evict_threshold": 128}, ["--max-total-tokens", "425"]),
    # an optimistic admission lets all 4 in; the decode memory runs short long before a round
    # is due, so only the relief before retraction can free slots
    "prune": (
        {"evict_threshold": 4096},
        ["--max-total-tokens", "350", "--schedule-conservativeness", "0.05", "--enable-metrics"],
    ),
    # ... and where no cap frees memory (per-layer memory, the paper's rule at a ratio that
    # keeps most of SmolLM2's tokens), SGLang retracts
    "retract": (
        {"evict_threshold": 256, "max_kv_ratio": 1.0, "sparse_ratio": 1000.0},
        ["--max-total-tokens", "700", "--schedule-conservativeness", "0.05"],
    ),
}
RUNNING = re.compile(r"Decode batch, #running-req: (\d+)")


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lethe-logs")
    configs = {name: ("lethe", config, [*COMMON, *flags]) for name, (config, flags) in SERVERS.items()}
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started


def generate(server, text, max_new_tokens):
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    body = {"text": text, "sampling_params": sampling}
    response = requests.post(f"{server.url}/generate", json=body, timeout=900)
    response.raise_for_status()
    return response.json()


def rounds_of(server, rid):
    return [m for m in ROUND.finditer(server.log()) if m[2] == rid]


def story_with_rounds(server):
    """300 tokens of a story, pruned in two rounds at least: the answer and its rounds' lines."""
    out = generate(server, STORY, 300)
    rounds = rounds_of(server, out["meta_info"]["id"])
    assert len(rounds) >= 2, server.log()[-3000:]
    return out, rounds


def round_numbers(m):
    """positions, freed, retained, radix-owned of a round's log line."""
    return map(int, m.groups()[2:6])


def test_rounds_return_slots_and_keep_retained_kv_under_budget(servers):
    server = servers["lethe"]
    out, rounds = story_with_rounds(server)
    for m in rounds:
        positions, freed, retained, radix_owned = round_numbers(m)
        assert retained <= math.ceil(MAX_KV_RATIO * positions) + radix_owned
    assert sum(int(m[4]) for m in rounds) > 0
    assert_freed_slots_reached_the_pool(server)
    assert out["meta_info"]["completion_tokens"] == 300
    assert_pool_exact(server)


def assert_freed_slots_reached_the_pool(server):
    """Each step's rounds grew the allocator's free size by what they freed, and the rounds' own
    lines add up to it."""
    log = server.log()
    calls = list(FREED.finditer(log))
    assert calls
    for m in calls:
        requests, freed, before, after = map(int, m.groups())
        assert after == before + freed
    assert sum(int(m[2]) for m in calls) == sum(int(m[4]) for m in ROUND.finditer(log))


@pytest.mark.parametrize("depth", [0.1, 0.5])
def test_needle_is_answered_after_eviction(servers, model_path, depth):
    server = servers["lethe"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    case = lookup_task.make_case(tokenizer, 1024, depth, seed=0)
    body = {"input_ids": case.prompt_ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    out = requests.post(f"{server.url}/generate", json=body, timeout=300).json()
    (first, *_) = rounds_of(server, out["meta_info"]["id"])
    assert int(first[4]) > 0.5 * len(case.prompt_ids)  # most of the prompt was freed first
    assert lookup_task.is_correct(case, out["text"]), (case.value, out["text"])
    assert_pool_exact(server)


def test_per_layer_memory_holds_the_sum_of_the_layers_lists(servers):
    server = servers["layers"]
    out, rounds = story_with_rounds(server)
    for m in rounds:
        positions, freed, retained, radix_owned = round_numbers(m)
        per_layer = [int(n) for n in m[7].split(",")]
        assert radix_owned == 0
        # each layer at most the cap; the request's slots hold the layers' entries packed
        assert max(per_layer) <= math.ceil(MAX_KV_RATIO * positions)
        assert retained == math.ceil(sum(per_layer) / len(per_layer))
    last_per_layer = [int(n) for n in rounds[-1][7].split(",")]
    assert int(rounds[-1][5]) < max(last_per_layer)  # less than a slot per token any layer keeps
    assert out["meta_info"]["completion_tokens"] == 300
    # /metrics: each layer's entries at the last step, its list after the last round plus the
    # tokens decoded since (every layer appends each)
    per_layer = {
        int(layer): float(value) for layer, value in re.findall(
            r'^sglang_ext:retained_kv_entries_per_layer{[^}]*layer="(\d+)"[^}]*} ([0-9.e+-]+)$',
            server.metrics(), re.M,
        )
    }  # fmt: skip
    assert sorted(per_layer) == list(range(len(last_per_layer)))
    since = {per_layer[layer] - kept for layer, kept in enumerate(last_per_layer)}
    assert len(since) == 1 and 0 < since.pop() <= THRESHOLD
    assert_pool_exact(server)


def test_lists_per_kv_head_hold_the_most_any_heads_lists_need(servers, model_path):
    server = servers["heads"]
    heads = transformers.AutoConfig.from_pretrained(model_path).num_key_value_heads
    out, rounds = story_with_rounds(server)
    for m in rounds:
        positions, freed, retained, radix_owned = round_numbers(m)
        per_list = [int(n) for n in m[7].split(",")]  # layer-major: (layer, KV head)
        layers = len(per_list) // heads
        assert len(per_list) == layers * heads and max(per_list) <= math.ceil(
            MAX_KV_RATIO * positions
        )  # fmt: skip
        per_head = [sum(per_list[h::heads]) for h in range(heads)]
        assert retained == max(math.ceil(n / layers) for n in per_head)
    assert out["meta_info"]["completion_tokens"] == 300
    layer_gauges = re.findall(
        r'^sglang_ext:retained_kv_entries_per_layer{[^}]*layer="(\d+)"', server.metrics(), re.M
    )
    assert len(layer_gauges) == layers  # a layer's longest list, per layer
    assert_pool_exact(server)


@pytest.mark.parametrize("name", ["lethe", "layers", "heads"])
def test_abort_mid_stream_after_rounds_leaks_nothing(servers, name):
    server = servers[name]
    body = {"text": STORY, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            meta = json.loads(line[5:])["meta_info"]
            if meta["completion_tokens"] >= 250:
                rid = meta["id"]
                break
    # the client left: SGLang aborts the request and releases its KV, holes and all
    assert len(rounds_of(server, rid)) >= 2
    assert_pool_exact(server)


@pytest.mark.parametrize("name", ["lethe", "layers"])
def test_radix_prefix_reused_under_rounds_is_never_freed(servers, name):
    server = servers[name]
    prefix = " ".join([STORY] * 4)  # about 80 tokens: finishes under the threshold, no holes
    first = generate(server, prefix, 8)
    assert not rounds_of(server, first["meta_info"]["id"])  # inserted whole into the tree
    longer = generate(server, prefix + " One morning", 300)
    rounds = rounds_of(server, longer["meta_info"]["id"])
    assert rounds and all(int(m[6]) >= 64 for m in rounds)  # the cached prefix, exempt
    assert sum(int(m[4]) for m in rounds) > 0
    # the tree's slots were not freed under the longer request: the prefix still reads back
    assert generate(server, prefix, 8)["text"] == first["text"]
    assert_pool_exact(server)


def four_at_once(server, max_new_tokens: int = 300) -> list[dict]:
    """Four requests of one batched call: they reach the scheduler together (four separate
    calls may arrive steps apart on a loaded machine and never compete for memory)."""
    outs = generate(server, [f"{STORY} (story {i})" for i in range(4)], max_new_tokens)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [max_new_tokens] * 4
    return outs


def test_admission_counts_requests_at_their_expected_retained_kv(servers):
    # At full length (175 tokens) SGLang's own admission runs 2 of them in 425 slots; counted at
    # lethe's expected 128 tokens (its first round's threshold), 3 fit.
    server = servers["admit"]
    four_at_once(server, 150)
    assert max(int(n) for n in RUNNING.findall(server.log())) >= 3
    assert "Retract requests" not in server.log()
    assert_pool_exact(server)


def test_slots_a_round_frees_admit_a_waiting_request(servers):
    # A decodes, counted at its expected 130 of 425 slots (a round's cap of its 219 tokens and
    # a round's interval). B and C, 150-token prompts, arrive together: B fits, C does not
    # (151 > 425 - 130 - 151), and SGLang stops trying its queue. B's first round, its next step,
    # frees most of its prompt (then counted at its expected 128): C fits beside A and B, and
    # runs with them rather than once B has finished.
    server = servers["admit"]
    seen = len(server.log())
    sampling = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    body = {"text": STORY, "stream": True, "sampling_params": sampling}
    with requests.post(f"{server.url}/generate", json=body, stream=True, timeout=300) as first:
        lines = first.iter_lines()  # one iterator: a dropped one closes the stream (an abort)
        next(line for line in lines if line.startswith(b"data:"))  # A decodes
        prompts = [[100 + (37 * (j + 300 * i)) % 40000 for j in range(150)] for i in range(2)]
        sampling = {**sampling, "max_new_tokens": 50}
        response = requests.post(
            f"{server.url}/generate", json={"input_ids": prompts, "sampling_params": sampling},
            timeout=300,
        )  # fmt: skip
        assert sum(1 for line in lines if line.startswith(b"data:")) > 1  # A to its end
    response.raise_for_status()
    outs = response.json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [50, 50]
    assert int(rounds_of(server, outs[0]["meta_info"]["id"])[0][4]) > 75
    assert max(int(n) for n in RUNNING.findall(server.log()[seen:])) == 3
    assert "Retract requests" not in server.log()
    assert_pool_exact(server)


def test_short_decode_memory_prunes_instead_of_retracting(servers):
    server = servers["prune"]
    # 3 x 149 tokens > 350 slots: short of memory even if one of the four is admitted late
    four_at_once(server, 125)
    assert metric(server.metrics(), "sglang_ext:memory_relief_tokens_total") > 0
    assert "Retract requests" not in server.log()
    assert_pool_exact(server)


def test_retraction_and_readmission_leak_nothing(servers):
    server = servers["retract"]
    outs = four_at_once(server)
    assert "Retract requests" in server.log()
    assert any(rounds_of(server, o["meta_info"]["id"]) for o in outs)
    assert_pool_exact(server)
