"""The real SGLang engine on CPU with SmolLM2 serving ``--policy delta`` and ``--policy tidal``,
beside ``--policy full``; and all of them with Lethe on one server (``--policy
lethe,delta,tidal,full``), each request decoding under the one it names, beside a single-policy
server of each with the same parameters."""

import ast
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server import policy_servers

pytestmark = pytest.mark.engine

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
]
# About 300 tokens: 19 pages, far more than the small budget's 4.
LONG_PROMPT = " ".join(
    f"Fact {i}: the {color} box holds {i * 7} marbles."
    for i, color in enumerate(["red", "blue", "green", "yellow", "white"] * 5)
) + " Question: how many marbles does the green box of fact 2 hold? Answer:"
CORRECTION_INTERVAL = 8
# float32: the correction test compares K/V that bf16 would round differently per chunking
COMMON = ["--max-total-tokens", "16384", "--log-level", "info", "--dtype", "float32"]
CONFIGS = {
    "full": None,
    "delta": None,  # the defaults (64 pages, 1024 tokens) cover every prompt here: exact
    "delta_small": {"budget_pages": 4, "recent_pages": 1},
    "tidal": None,  # 1024 tokens
    "tidal_small": {"budget_tokens": 64},
    "tidal_corrected": {"budget_tokens": 64, "correction_interval": CORRECTION_INTERVAL},
}
SMALL_BUDGET = {"delta": ("pages", 4, 16), "tidal": ("tokens", 64, 1)}  # unit, budget, unit size
# several policies on one server, with the single-policy servers' parameters
MIX_MEMBERS = {"lethe": "lethe", "delta": "delta_small", "tidal": "tidal_small", "full": "full"}
CONFIGS["lethe"] = {"evict_threshold": 128, "max_kv_ratio": 0.5}  # rounds from 128 tokens on
MIX = ",".join(MIX_MEMBERS)
MIX_CONFIG = {member: CONFIGS[name] for member, name in MIX_MEMBERS.items() if CONFIGS[name]}


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    configs = {name: (name.split("_")[0], config, COMMON) for name, config in CONFIGS.items()}
    configs["mix"] = (MIX, MIX_CONFIG, [*COMMON, "--enable-metrics", "--decode-log-interval", "1"])
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_the_backend_serves_with_the_configured_policy_and_model_layers(servers, policy):
    log = servers[f"{policy}_small"].log()
    described = re.search(r"PolicyTorchNativeAttnBackend decoding with policy (\{.*\})", log)
    assert described, "the policy backend was not used"
    params = ast.literal_eval(described[1])
    assert params["name"] == policy
    unit, budget, _ = SMALL_BUDGET[policy]
    assert params[f"budget_{unit}"] == budget
    assert params["full_layers"][:2] == [0, 1]  # resolved for SmolLM2's 30 layers
    selecting = params["delta_layers" if policy == "delta" else "selection_layers"]
    assert selecting[0] == 2 and max(selecting) < 30


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_a_budget_covering_the_context_gives_full_attentions_greedy_tokens(servers, policy):
    ours = servers[policy].generate(PROMPTS, max_new_tokens=32)
    theirs = servers["full"].generate(PROMPTS, max_new_tokens=32)
    assert [o["output_ids"] for o in ours] == [t["output_ids"] for t in theirs]
    assert all(len(o["output_ids"]) > 8 for o in ours)
    assert "first selected fewer" not in servers[policy].log()


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_a_small_budget_selects_the_budget_and_still_answers(servers, policy):
    server = servers[f"{policy}_small"]
    unit, budget, unit_size = SMALL_BUDGET[policy]
    out = server.generate(LONG_PROMPT, max_new_tokens=16)
    assert out["meta_info"]["prompt_tokens"] > 4 * budget * unit_size
    assert len(out["output_ids"]) > 0 and out["text"].strip()
    match = re.search(rf"{policy} layer 2 first selected fewer {unit} than a request has: "
                      r"\[(\d+)\] of \[(\d+)\]", server.log())  # fmt: skip
    assert match, "no selection was logged"
    assert int(match[1]) == budget < int(match[2])


def test_a_request_may_choose_a_smaller_budget_of_its_own(servers):
    """On the 1024-token tidal server, a request asking for 64 tokens decodes as the 64-token
    server does, in one batch with a request that asks nothing (which decodes as before)."""
    own = {"custom_params": {"kv_policy": {"budget_tokens": 64}}}
    prompt = {"text": LONG_PROMPT}
    with ThreadPoolExecutor(2) as pool:
        mine, default = pool.map(
            lambda extra: _greedy(servers["tidal"], None, 12, **prompt, sampling_extra=extra),
            [own, {}],
        )
    assert mine["output_ids"] == _greedy(servers["tidal_small"], None, 12, **prompt)["output_ids"]
    assert default["output_ids"] == _greedy(servers["tidal"], None, 12, **prompt)["output_ids"]
    held = default["meta_info"]["kv_retained_tokens"][-1]
    assert default["meta_info"]["kv_attended_tokens"][-1] == held  # 1024 tokens cover it all
    assert 64 < mine["meta_info"]["kv_attended_tokens"][-1] < held
    over = {"text": "hi", "sampling_params": {"custom_params": {"kv_policy": {"budget_pages": 65}}}}
    refused = requests.post(f"{servers['delta'].url}/generate", json=over, timeout=60)
    assert refused.status_code == 400 and "kv_policy.budget_pages" in refused.text


# About 300 tokens each: more than DELTA's 4 pages and Tidal's 64 tokens, past Lethe's threshold;
# each its own first words, so no radix prefix is shared with another test's prompts
MIX_PROMPTS = [
    f"Ledger {k}. " + " ".join(f"Fact {i}: the {color} box holds {i * k} marbles." for i, color in
                               enumerate(["red", "blue", "green", "yellow", "white"] * 5))
    + f" Question {k}: how many marbles does the green box of fact 2 hold? Answer:"
    for k in (3, 5, 9, 11)
]  # fmt: skip
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
ROUND = re.compile(r"lethe round \d+ of (\w+): (\d+) positions, freed (\d+) slots .* "
                   r"retained \d+ \(radix-owned (\d+)\)")  # fmt: skip


def _batch(server, texts, kv_policies, max_new_tokens=24):
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


def _assert_healthy_and_exact(server):
    server.wait_idle()
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    assert "Mem Leak" not in server.log() and "Traceback" not in server.log()


def test_four_policies_in_one_batch_each_give_their_own_servers_tokens(servers):
    mixed = _batch(servers["mix"], MIX_PROMPTS, [{"name": name} for name in MIX_MEMBERS])
    batch = re.findall(r"Decode batch, #running-req: (\d+)", servers["mix"].log())
    assert max(int(n) for n in batch) == 4  # decoded together
    for i, (name, alone_on) in enumerate(MIX_MEMBERS.items()):
        # its own server decodes the same four prompts, so every row's batch is the same shape
        alone = _batch(servers[alone_on], MIX_PROMPTS, [None] * 4)
        assert mixed[i]["output_ids"] == alone[i]["output_ids"], name
        assert mixed[i]["meta_info"]["kv_policy"][-1] == name
    lethe = mixed[0]["meta_info"]
    assert lethe["kv_evicted_tokens"][-1] > 0
    assert all(m["meta_info"]["kv_evicted_tokens"][-1] == 0 for m in mixed[1:])
    assert "delta layer 2 first selected fewer pages" in servers["mix"].log()
    assert "tidal layer 2 first selected fewer tokens" in servers["mix"].log()
    # the requests' series are labelled by the policy each decoded under
    series = r'^sglang_ext:attended_tokens_per_step_count{[^}]*policy="(\w+)"[^}]*} (\S+)$'
    steps = re.findall(series, servers["mix"].metrics(), re.M)
    assert {name: float(n) >= 23 for name, n in steps} == dict.fromkeys(MIX_MEMBERS, True)
    _assert_healthy_and_exact(servers["mix"])


def test_the_policy_endpoint_lists_the_enabled_policies(servers):
    info = requests.get(f"{servers['mix'].url}/policy", timeout=30).json()
    assert info["policy"]["name"] == MIX and info["policy"]["delta"]["budget_pages"] == 4
    assert list(info["per_request"]["policies"]) == list(MIX_MEMBERS)
    assert info["per_request"]["policies"]["tidal"] == ["budget_tokens"]
    body = {"text": STORY, "sampling_params": {"custom_params": {"kv_policy": {"name": "art"}}}}
    refused = requests.post(f"{servers['mix'].url}/generate", json=body, timeout=60)
    assert refused.status_code == 400 and "kv_policy.name" in refused.text
    assert "(valid: lethe, delta, tidal, full)" in refused.text


def test_a_prefix_shared_by_a_full_and_a_lethe_request_is_never_freed(servers):
    server = servers["mix"]
    prefix = " ".join([STORY] * 4)  # about 80 tokens, cached whole by the full request
    first = _batch(server, [prefix], [{"name": "full"}], max_new_tokens=8)[0]
    longer = _batch(server, [prefix + " One morning"], [{"name": "lethe"}], 200)[0]
    rounds = [m for m in ROUND.finditer(server.log()) if m[1] == longer["meta_info"]["id"]]
    assert rounds and sum(int(m[3]) for m in rounds) > 0
    assert all(int(m[4]) >= 64 for m in rounds)  # the full request's cached prefix, exempt
    again = _batch(server, [prefix], [{"name": "full"}], max_new_tokens=8)[0]
    assert again["output_ids"] == first["output_ids"]
    _assert_healthy_and_exact(server)


def test_no_kv_leak_after_the_requests(servers):
    for server in servers.values():
        server.wait_idle()
        assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
        assert "leak" not in server.log().lower()


def _greedy(server, input_ids, max_new_tokens, sampling_extra=None, **extra):
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **(sampling_extra or {})}
    payload = {**({"input_ids": input_ids} if input_ids is not None else {}), **extra, "sampling_params": sampling}
    response = requests.post(f"{server.url}/generate", json=payload, timeout=300)
    response.raise_for_status()
    return response.json()


def _next_token_logprobs(server, input_ids) -> dict[int, float]:
    out = _greedy(server, input_ids, 1, return_logprob=True, top_logprobs_num=10)
    return {token: logprob for logprob, token, _ in out["meta_info"]["output_top_logprobs"][0]}


def _kv_error_after_decoding(servers, name, prompt_ids) -> float:
    """Decode greedily on ``name``, then continue from the tokens every correction covered: the
    radix cache reuses their K/V as ``name`` stored them, whereas full attention recomputes them.
    The largest difference of the next token's top log-probabilities measures the K/V drift."""
    corrected = 3 * CORRECTION_INTERVAL  # three rounds; the last tokens stay as decoded
    output_ids = _greedy(servers[name], prompt_ids, corrected + 5)["output_ids"]
    continued = prompt_ids + output_ids[:corrected]
    ours = _next_token_logprobs(servers[name], continued)
    theirs = _next_token_logprobs(servers["full"], continued)
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 5
    return max(abs(ours[t] - theirs[t]) for t in shared)


def test_cache_correction_refills_sparsely_decoded_tokens_with_full_attentions_kv(servers, model_path):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_path)(LONG_PROMPT)["input_ids"]
    corrected = _kv_error_after_decoding(servers, "tidal_corrected", prompt_ids)
    uncorrected = _kv_error_after_decoding(servers, "tidal_small", prompt_ids)
    print(f"next-token log-prob error vs full: corrected {corrected:.4f}, uncorrected {uncorrected:.4f}")
    assert "first cache correction re-filled" in servers["tidal_corrected"].log()
    assert "cache correction" not in servers["tidal_small"].log()
    assert uncorrected > 0.05, "sparse decoding should leave K/V that full attention would not"
    assert corrected < 1e-3  # float32: the corrected K/V are full attention's, to rounding
