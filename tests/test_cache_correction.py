"""Which tokens a decode step's cache correction re-fills (the engine run is in test_engine_selection)."""

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang_ext.cache_correction import plan_correction
from sglang_ext.policies import build_policy


def request(pool_idx, prompt_len, num_output):
    return SimpleNamespace(
        req_pool_idx=pool_idx,
        origin_input_ids=array("q", range(1000, 1000 + prompt_len)),
        output_ids=array("q", range(num_output)),
    )


def seq_lens(*lengths):
    return torch.tensor(lengths, dtype=torch.int64)


def test_a_request_is_due_once_the_interval_was_decoded_past_its_prompt():
    # prompt 10; outputs known up to position 17 (position 18 is being decoded)
    reqs = [request(3, 10, 9), request(5, 10, 7)]
    plan = plan_correction(reqs, seq_lens(19, 17), interval=8)
    assert plan.req_pool_indices == [3]
    assert plan.starts == [10]  # the prompt came from a full-attention prefill: never re-filled
    assert plan.token_ids == [list(range(8))]  # positions 10..17
    assert plan.num_tokens == 8


def test_each_round_refills_what_was_decoded_since_the_last():
    req = request(0, 10, 30)
    assert plan_correction([req], seq_lens(19), interval=8).starts == [10]
    assert plan_correction([req], seq_lens(26), interval=8) is None  # 18..24: 7 tokens
    plan = plan_correction([req], seq_lens(27), interval=8)
    assert plan.starts == [18] and plan.token_ids == [list(range(8, 16))]  # positions 18..25


def test_tokens_not_yet_on_the_host_wait_for_a_later_round():
    # overlap scheduling: the host learns a token a step after the device
    req = request(0, 10, 6)
    assert plan_correction([req], seq_lens(19), interval=8) is None
    req.output_ids.extend([6, 7, 8])
    assert plan_correction([req], seq_lens(20), interval=8).token_ids == [list(range(9))]


@pytest.mark.parametrize("name", ["tidal", "delta", "full"])
def test_correction_is_off_by_default(name):
    assert build_policy(name).cache_correction_interval() == 0
    assert build_policy("tidal", {"correction_interval": 4}).cache_correction_interval() == 4
