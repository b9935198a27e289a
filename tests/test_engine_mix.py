"""The real SGLang engine on CPU with SmolLM2 serving several policies at once
(``--policy lethe,delta,tidal,full,snapkv,tova,h2o``): requests of four policies decode in one
batch, each giving the greedy tokens a batch of its own policy gives, under its own report and
metrics label, beside the radix cache, with SGLang's strict KV checks silent; SnapKV, TOVA and H2O
run on Lethe's eviction runtime, each request naming its own."""

import math
import re

import pytest
import requests

from server import assert_pool_exact, policy_servers

from sglang_ext.server.metrics import by_policy

pytestmark = pytest.mark.engine

COMMON = ["--max-total-tokens", "4096", "--log-level", "info", "--dtype", "float32"]
# member -> its config on the mix (None: defaults)
MIX_MEMBERS = {
    "lethe": {"evict_threshold": 128, "max_kv_ratio": 0.5},  # rounds from 128 tokens on
    "delta": {"budget_pages": 4, "recent_pages": 1},
    "tidal": {"budget_tokens": 64},
    "full": None,
}
# on the mix only: the public decode-time scorers, a round at the first decode step, then every
# 16 tokens
SCORERS = {name: {"compression_interval": 16} for name in ("snapkv", "tova", "h2o")}
MIX = ",".join([*MIX_MEMBERS, *SCORERS])


@pytest.fixture(scope="module")
def server(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("mix-logs")
    mix_config = {name: config for name, config in {**MIX_MEMBERS, **SCORERS}.items() if config}
    mix_flags = [*COMMON, "--enable-metrics", "--decode-log-interval", "1"]
    configs = {"mix": (MIX, mix_config, mix_flags)}
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started["mix"]


# About 300 tokens each: more than DELTA's 4 pages and Tidal's 64 tokens, past Lethe's threshold;
MIX_PROMPTS = [
    f"Ledger {k}. " + " ".join(f"Fact {i}: the {color} box holds {i * k} marbles." for i, color in
                               enumerate(["red", "blue", "green", "yellow", "white"] * 5))
    + f" Question {k}: how many marbles does the green box of fact 2 hold? Answer:"
    for k in (3, 5, 9, 11)
]  # fmt: skip
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
ROUND = re.compile(r"lethe round \d+ of (\w+): (\d+) positions, freed (\d+) slots, "
                   r"retained \d+ \(radix-owned (\d+)\)")  # fmt: skip


def _batch(server, texts, kv_policies, max_new_tokens=16):
    """One batched call (its requests reach the scheduler together), each with its policy."""
    params = [
        {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
         **({"custom_params": {"kv_policy": p}} if p else {})}
        for p in kv_policies
    ]  # fmt: skip
    body = {"text": texts, "sampling_params": params}
    response = requests.post(f"{server.url}/generate", json=body, timeout=900)
    response.raise_for_status()
    return response.json()


def test_four_policies_in_one_batch_each_give_their_own_tokens(server):
    mixed = _batch(server, MIX_PROMPTS, [{"name": name} for name in MIX_MEMBERS])
    batch = re.findall(r"Decode batch, #running-req: (\d+)", server.log())
    assert max(int(n) for n in batch) == 4  # decoded together
    for i, name in enumerate(MIX_MEMBERS):
        # the same four prompts, all under this member: every row's batch is the same shape
        alone = _batch(server, MIX_PROMPTS, [{"name": name}] * 4)
        assert mixed[i]["output_ids"] == alone[i]["output_ids"], name
        assert mixed[i]["meta_info"]["kv_policy"][-1] == name
    lethe = mixed[0]["meta_info"]
    assert lethe["kv_evicted_tokens"][-1] > 0
    assert all(m["meta_info"]["kv_evicted_tokens"][-1] == 0 for m in mixed[1:])
    # at SmolLM2's first selection layers (its calibration)
    assert re.search(r"delta layer \d+ first selected fewer pages", server.log())
    assert re.search(r"tidal layer \d+ first selected fewer tokens", server.log())
    # the requests' series are labelled by the policy each decoded under
    steps = by_policy(server.metrics(), "sglang_ext:attended_tokens_per_step_count")
    own = {name: n >= 15 for name, n in steps.items() if name not in SCORERS}
    assert own == dict.fromkeys(MIX_MEMBERS, True)
    assert_pool_exact(server)


def test_the_policy_endpoint_lists_the_enabled_policies(server):
    info = requests.get(f"{server.url}/policy", timeout=30).json()
    assert info["policy"]["name"] == MIX and info["policy"]["delta"]["budget_pages"] == 4
    assert list(info["per_request"]["policies"]) == MIX.split(",")
    assert info["per_request"]["policies"]["tidal"] == ["budget_tokens"]
    body = {"text": STORY, "sampling_params": {"custom_params": {"kv_policy": {"name": "art"}}}}
    refused = requests.post(f"{server.url}/generate", json=body, timeout=60)
    assert refused.status_code == 400 and "kv_policy.name" in refused.text
    assert f"(valid: {MIX.replace(',', ', ')})" in refused.text


def test_a_prefix_shared_by_a_full_and_a_lethe_request_is_never_freed(server):
    prefix = " ".join([STORY] * 4)  # about 80 tokens, cached whole by the full request
    first = _batch(server, [prefix], [{"name": "full"}], max_new_tokens=8)[0]
    longer = _batch(server, [prefix + " One morning"], [{"name": "lethe"}], 160)[0]
    rounds = [m for m in ROUND.finditer(server.log()) if m[1] == longer["meta_info"]["id"]]
    assert rounds and sum(int(m[3]) for m in rounds) > 0
    assert all(int(m[4]) >= 64 for m in rounds)  # the full request's cached prefix, exempt
    again = _batch(server, [prefix], [{"name": "full"}], max_new_tokens=8)[0]
    assert again["output_ids"] == first["output_ids"]
    assert_pool_exact(server)


SCORER_ROUND = re.compile(
    r"(\w+) round \d+ of (\w+): (\d+) positions, freed \d+ slots, retained (\d+) "
    r"\(radix-owned (\d+)\), next threshold \d+, retained per list \[([\d, ]+)\]"
)


def test_snapkv_tova_and_h2o_each_evict_under_its_own_rule_and_cap(server):
    specs = [{"name": "snapkv"}, {"name": "tova", "compression_ratio": 0.75}, {"name": "h2o"}]
    # prompts of their own: no longer prefix of them is in the radix tree
    prompts = [f"{spec['name']}: {prompt}" for spec, prompt in zip(specs, MIX_PROMPTS)]
    outs = _batch(server, prompts, specs, max_new_tokens=40)
    for spec, out in zip(specs, outs, strict=True):
        meta = out["meta_info"]
        assert meta["kv_policy"][-1] == spec["name"] and meta["kv_evicted_tokens"][-1] > 0
        rounds = [m for m in SCORER_ROUND.finditer(server.log()) if m[2] == meta["id"]]
        # the prompt at the first decode step, then every 16 tokens: decode steps 1, 17 and 33
        assert [m[1] for m in rounds] == [spec["name"]] * 3
        assert [int(m[3]) for m in rounds] == [int(rounds[0][3]) + k * 16 for k in range(3)]
        keep = 1 - spec.get("compression_ratio", 0.5)
        for m in rounds:
            positions, retained, radix_owned = int(m[3]), int(m[4]), int(m[5])
            per_layer = [int(n) for n in m[6].split(",")]
            # each layer cut to the cap by its own scores, the layers' entries packed into slots
            # (beside any slot of a radix-cached prefix, never freed: a probe's token may match)
            assert max(per_layer) <= math.ceil(keep * positions)
            packed = math.ceil(sum(per_layer) / len(per_layer))
            assert packed <= retained <= packed + radix_owned
    assert_pool_exact(server)
