"""The real SGLang engine on CPU with SmolLM2 serving ``--policy art`` and ``--policy delta+art``
beside ``--policy full``: termination off reads everything (full's greedy tokens), on it keeps
full's answers, compositions serve, and no KV leaks."""

import ast
import re

import pytest
import requests
import transformers

from benchmarks import lookup_task
from benchmarks.harness import art_tiles
from server import assert_pool_exact, policy_servers

pytestmark = pytest.mark.engine

PROMPTS = ["Once upon a time, in a small village by the sea,", "def fibonacci(n):\n    "]
COMMON = ["--max-total-tokens", "4096", "--log-level", "info", "--dtype", "float32"]
CONFIGS = {
    "full": ("full", None),
    "art": ("art", None),
    "delta+art": ("delta+art", {"budget_pages": 16, "recent_pages": 2}),
}
# a looser ART that skips tiles on short prompts, so its metrics have something to count
LOOSE = {"tau": 1e-2, "phi": 1e-1, "patience": 1}


@pytest.fixture(scope="module")
def servers(model_path, strict_env, tmp_path_factory):
    logs = tmp_path_factory.mktemp("art-logs")
    configs = {name: (policy, config, COMMON) for name, (policy, config) in CONFIGS.items()}
    configs["art"] = (*configs["art"][:2], [*COMMON, "--enable-metrics"])
    with policy_servers(model_path, strict_env, logs, configs) as started:
        yield started


def test_termination_off_gives_full_attentions_greedy_tokens(servers):
    off = {"kv_policy": {"patience": 0}}
    sampling = {"max_new_tokens": 24, "temperature": 0, "custom_params": off}
    body = {"text": PROMPTS, "sampling_params": sampling}
    response = requests.post(f"{servers['art'].url}/generate", json=body, timeout=300)
    response.raise_for_status()
    theirs = servers["full"].generate(PROMPTS, max_new_tokens=24)
    assert [o["output_ids"] for o in response.json()] == [t["output_ids"] for t in theirs]


@pytest.mark.parametrize("name", ["art", "delta+art"])
def test_with_termination_the_lookup_full_answers_is_answered(servers, model_path, name):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    case = lookup_task.make_case(tokenizer, 1024, 0.5, seed=0)
    body = {"input_ids": case.prompt_ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    answers = {
        server: requests.post(f"{servers[server].url}/generate", json=body, timeout=300).json()["text"]
        for server in ("full", name)
    }  # fmt: skip
    assert lookup_task.is_correct(case, answers["full"]), answers["full"]
    assert lookup_task.is_correct(case, answers[name]), answers[name]


def test_the_composition_is_served_as_configured(servers):
    log = servers["delta+art"].log()
    described = re.search(r"decoding with policy (\{.*\})", log)
    assert described, "the policy backend was not used"
    params = ast.literal_eval(described[1])
    assert params["name"] == "delta+art" and params["budget_pages"] == 16
    assert params["art"]["patience"] == 5


def _greedy_ids(server, prompt: str, kv_policy: dict | None = None) -> list[int]:
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    if kv_policy is not None:
        sampling["custom_params"] = {"kv_policy": kv_policy}
    response = requests.post(f"{server.url}/generate", json={"text": prompt, "sampling_params": sampling}, timeout=300)
    response.raise_for_status()
    return response.json()["output_ids"]


def test_a_request_may_set_its_own_thresholds_or_read_everything(servers):
    """patience 0 or {"name": "full"} in a request is termination off for it alone: full
    attention's tokens; its own looser thresholds make it the looser setting's request."""
    art = servers["art"]
    for opt_out in ({"name": "full"}, {"patience": 0}):
        assert _greedy_ids(art, PROMPTS[1], opt_out) == _greedy_ids(servers["full"], PROMPTS[1])
    long_prompt = " ".join(f"Note {i}: the weather was mild and the market was calm." for i in range(60))
    before = art_tiles(art.url)
    _greedy_ids(art, long_prompt, {"name": "full"})
    read_all = art_tiles(art.url)
    _greedy_ids(art, long_prompt, LOOSE)
    loose = art_tiles(art.url)
    assert read_all[0] - before[0] == read_all[1] - before[1] > 0  # every tile read
    assert loose[0] - read_all[0] < loose[1] - read_all[1]  # some skipped


def test_no_kv_leak_after_a_batch_and_an_abort(servers):
    for server in servers.values():
        server.generate(PROMPTS, max_new_tokens=16)
        server.abort_mid_stream(PROMPTS[0])
    assert_pool_exact(*servers.values())


def test_the_policy_endpoint_describes_the_served_policy(servers):
    info = requests.get(f"{servers['delta+art'].url}/policy", timeout=30).json()
    assert info["policy"]["name"] == "delta+art" and info["policy"]["art"]["tau"] == 1e-5
    assert info["parameters"]["budget_pages"] == {"type": "int", "default": 64}
    assert info["parameters"]["art"]["patience"] == {"type": "int", "default": 5}
    assert {"lethe", "art", "tidal+art"} <= set(info["available"])
    assert info["per_request"] == {  # a composition: server-wide
        "parameters": [], "full": False, "policies": {"delta+art": []},
    }  # fmt: skip
    art = requests.get(f"{servers['art'].url}/policy", timeout=30).json()
    assert art["per_request"] == {
        "parameters": ["tau", "phi", "patience"], "full": True,
        "policies": {"art": ["tau", "phi", "patience"], "full": []},
    }  # fmt: skip
