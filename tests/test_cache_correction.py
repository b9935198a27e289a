"""Which tokens a decode step's cache correction re-fills, and the extend batch that re-fills them
(the engine run is in test_engine_selection)."""

import dataclasses
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang_ext.policies.tidal.cache_correction import plan_correction
from sglang_ext.engine.batches import correction_batch
from sglang_ext.policies import build_policy
from sglang_ext.policies.runtime import RequestState, StepRequest


def request(row, prompt_len, num_output, seq_len, state=None):
    return StepRequest(
        state=state or RequestState(policy=None), rid=f"r{row}", row=row, seq_len=seq_len,
        prompt_len=prompt_len, output_ids=array("q", range(num_output)), protected_len=0,
    )  # fmt: skip


def test_a_request_is_due_once_the_interval_was_decoded_past_its_prompt():
    # prompt 10; outputs known up to position 17 (position 18 is being decoded)
    plan = plan_correction([request(3, 10, 9, 19), request(5, 10, 7, 17)], interval=8)
    assert plan.req_pool_indices == [3]
    assert plan.starts == [10]  # the prompt came from a full-attention prefill: never re-filled
    assert plan.token_ids == [list(range(8))]  # positions 10..17
    assert plan.num_tokens == 8


def test_each_round_refills_what_was_decoded_since_the_last():
    state = RequestState(policy=None)
    assert plan_correction([request(0, 10, 30, 19, state)], interval=8).starts == [10]
    assert plan_correction([request(0, 10, 30, 26, state)], interval=8) is None  # 18..24: 7 tokens
    plan = plan_correction([request(0, 10, 30, 27, state)], interval=8)
    assert plan.starts == [18] and plan.token_ids == [list(range(8, 16))]  # positions 18..25
    assert state.corrected_until == 26


def test_tokens_not_yet_on_the_host_wait_for_a_later_round():
    # overlap scheduling: the host learns a token a step after the device
    req = request(0, 10, 6, 19)
    assert plan_correction([req], interval=8) is None
    req.output_ids.extend([6, 7, 8])
    later = dataclasses.replace(req, seq_len=20)
    assert plan_correction([later], interval=8).token_ids == [list(range(9))]


@pytest.mark.parametrize("name", ["tidal", "delta", "full"])
def test_correction_is_off_by_default(name):
    assert build_policy(name).cache_correction() is None
    assert build_policy("tidal", {"correction_interval": 4}).cache_correction().interval == 4


def test_the_correction_batch_reruns_each_token_into_its_own_slot():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    req_to_token = torch.arange(4 * 32, dtype=torch.int32).view(4, 32) + 1000
    decode = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=2, seq_lens=torch.tensor([20, 30]),
        input_ids=torch.tensor([7, 8]), req_pool_indices=torch.tensor([1, 3]),
        out_cache_loc=torch.tensor([5, 6]), sampling_info="decode's", spec_info="decode's",
    )  # fmt: skip
    plan = plan_correction([request(1, 10, 9, 20), request(3, 20, 9, 30)], interval=8)
    batch = correction_batch(decode, plan, req_to_token)
    assert batch.forward_mode == ForwardMode.EXTEND and batch.batch_size == 2
    assert batch.seq_lens.tolist() == [19, 29] and batch.extend_prefix_lens_cpu == [10, 20]
    assert batch.extend_seq_lens_cpu == [9, 9] and batch.extend_start_loc.tolist() == [0, 9]
    assert batch.positions.tolist() == [*range(10, 19), *range(20, 29)]
    assert batch.input_ids.tolist() == [*range(9), *range(9)]
    # the tokens' own cache slots: their K/V are overwritten in place
    assert batch.out_cache_loc.tolist() == [*req_to_token[1, 10:19].tolist(), *req_to_token[3, 20:29].tolist()]
    assert batch.sampling_info is None and batch.spec_info is None  # nothing of the decode step
    assert decode.forward_mode == ForwardMode.DECODE  # the decode batch itself is untouched
