"""The real SGLang engine on CPU with SmolLM2 serving ``--policy delta`` and ``--policy tidal``,
beside ``--policy full``: one server of the three at their default budgets (each request names
its policy and may ask a smaller budget), one of the two at small budgets, and Tidal at a small
budget correcting its cache."""

import ast
import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server import assert_pool_exact, policy_servers

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
COMMON = ["--max-total-tokens", "4096", "--log-level", "info", "--dtype", "float32"]
# unit, default budget (covers every prompt here: exact), small budget, unit size
BUDGETS = {"delta": ("pages", 64, 4, 16), "tidal": ("tokens", 1024, 64, 1)}
SERVERS = {
    # full first: a request naming no policy decodes with full attention
    "mix": ("full,delta,tidal", {"delta": {"recent_pages": 1}}),
    # tidal first: the uncorrected beside tidal_corrected
    "small": ("tidal,delta", {"tidal": {"budget_tokens": 64},
                              "delta": {"budget_pages": 4, "recent_pages": 1}}),
    "tidal_corrected": ("tidal", {"budget_tokens": 64, "correction_interval": CORRECTION_INTERVAL}),
}


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engine-logs")
    configs = {name: (policy, config, COMMON) for name, (policy, config) in SERVERS.items()}
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started


def _own(policy: str, budget: str = "default") -> dict:
    """A request's sampling parameters naming its policy, at the small budget if asked."""
    unit, _, small, _ = BUDGETS[policy]
    kv_policy = {"name": policy, **({f"budget_{unit}": small} if budget == "small" else {})}
    return {"custom_params": {"kv_policy": kv_policy}}


def _described(server) -> dict:
    pattern = r"PolicyTorchNativeAttnBackend decoding with policy (\{.*\})"
    described = re.search(pattern, server.log())
    assert described, "the policy backend was not used"
    return ast.literal_eval(described[1])


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_the_backend_serves_with_the_configured_policy_and_model_layers(servers, policy):
    unit, budget, small, _ = BUDGETS[policy]
    for name, expected in (("mix", budget), ("small", small)):
        params = _described(servers[name])[policy]
        assert params[f"budget_{unit}"] == expected
        # resolved for SmolLM2's 30 layers (its calibration): the full layers, then the first
        # selection
        full = params["full_layers"]
        selecting = params["delta_layers" if policy == "delta" else "selection_layers"]
        assert full == list(range(len(full))) and selecting[0] == len(full) and max(selecting) < 30


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_a_budget_covering_the_context_gives_full_attentions_greedy_tokens(servers, policy):
    mix = servers["mix"]
    ours = [_greedy(mix, None, 32, text=p, sampling_extra=_own(policy)) for p in PROMPTS]
    theirs = [_greedy(mix, None, 32, text=p) for p in PROMPTS]
    assert [o["output_ids"] for o in ours] == [t["output_ids"] for t in theirs]
    assert all(len(o["output_ids"]) > 8 for o in ours)
    assert all(o["meta_info"]["kv_policy"][-1] == policy for o in ours)
    # no layer selected fewer tokens than a request has (this module's first selection follows)
    assert not re.search(rf"{policy} layer \d+ first selected fewer", mix.log())


@pytest.mark.parametrize("policy", ["delta", "tidal"])
def test_a_small_budget_selects_the_budget_and_still_answers(servers, policy):
    unit, _, budget, unit_size = BUDGETS[policy]
    server = servers["small"]
    out = _greedy(server, None, 16, text=LONG_PROMPT, sampling_extra=_own(policy))
    assert out["meta_info"]["prompt_tokens"] > 4 * budget * unit_size
    assert len(out["output_ids"]) > 0 and out["text"].strip()
    match = re.search(rf"{policy} layer \d+ first selected fewer {unit} than a request has: "
                      r"\[(\d+)\] of \[(\d+)\]", server.log())  # fmt: skip
    assert match, "no selection was logged"
    assert int(match[1]) == budget < int(match[2])


def test_a_request_may_choose_a_smaller_budget_of_its_own(servers):
    """On the mix's 1024-token tidal, a request asking for 64 tokens decodes as the 64-token
    server does, in one batch with a request that asks nothing more (which decodes as before)."""
    prompt = {"text": LONG_PROMPT}
    with ThreadPoolExecutor(2) as pool:
        mine, default = pool.map(
            lambda budget: _greedy(servers["mix"], None, 12, **prompt,
                                   sampling_extra=_own("tidal", budget)),
            ["small", "default"],
        )  # fmt: skip
    assert mine["output_ids"] == _greedy(servers["small"], None, 12, **prompt)["output_ids"]
    alone = _greedy(servers["mix"], None, 12, **prompt, sampling_extra=_own("tidal"))
    assert default["output_ids"] == alone["output_ids"]
    held = default["meta_info"]["kv_retained_tokens"][-1]
    assert default["meta_info"]["kv_attended_tokens"][-1] == held  # 1024 tokens cover it all
    assert 64 < mine["meta_info"]["kv_attended_tokens"][-1] < held
    over = {"text": "hi", "sampling_params": {
        "custom_params": {"kv_policy": {"name": "delta", "budget_pages": 65}}}}  # fmt: skip
    refused = requests.post(f"{servers['mix'].url}/generate", json=over, timeout=60)
    assert refused.status_code == 400 and "kv_policy.budget_pages" in refused.text


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
    # the mix's default, full attention, with nothing cached: its radix tree holds tokens its
    # other policies decoded, whose K/V full attention would not have computed
    requests.post(f"{servers['mix'].url}/flush_cache", timeout=60).raise_for_status()
    theirs = _next_token_logprobs(servers["mix"], continued)
    shared = ours.keys() & theirs.keys()
    assert len(shared) >= 5
    return max(abs(ours[t] - theirs[t]) for t in shared)


def test_cache_correction_refills_sparsely_decoded_tokens_with_full_attentions_kv(servers, model_path):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_path)(LONG_PROMPT)["input_ids"]
    corrected = _kv_error_after_decoding(servers, "tidal_corrected", prompt_ids)
    uncorrected = _kv_error_after_decoding(servers, "small", prompt_ids)
    print(f"next-token log-prob error vs full: corrected {corrected:.4f}, uncorrected {uncorrected:.4f}")
    assert "first cache correction re-filled" in servers["tidal_corrected"].log()
    assert "cache correction" not in servers["small"].log()
    assert uncorrected > 0.05, "sparse decoding should leave K/V that full attention would not"
    assert corrected < 1e-3  # float32: the corrected K/V are full attention's, to rounding


def test_no_kv_leak_after_a_batch_and_an_abort(servers):
    for server in servers.values():
        server.generate([LONG_PROMPT, PROMPTS[0]], max_new_tokens=8)  # the small budgets select
        server.abort_mid_stream(LONG_PROMPT)
    for name, policy in itertools.product(("mix", "small"), BUDGETS):  # each member selects
        body = {"text": [LONG_PROMPT, PROMPTS[0]], "sampling_params": [
            {"max_new_tokens": 8, **_own(policy, "small")}, {"max_new_tokens": 8, **_own(policy)}]}
        requests.post(f"{servers[name].url}/generate", json=body, timeout=300).raise_for_status()
    assert_pool_exact(*servers.values())
