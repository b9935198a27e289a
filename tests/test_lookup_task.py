"""The lookup task's prompts, with SmolLM2's real tokenizer."""

import dataclasses

import pytest

from benchmarks.lookup_task import is_correct, make_case, record_depth


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.mark.parametrize("target_len", [512, 2048, 7680])
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_prompt_hits_the_length_and_puts_the_record_at_the_depth(tokenizer, target_len, depth):
    case = make_case(tokenizer, target_len, depth, seed=0)
    assert abs(len(case.prompt_ids) - target_len) <= 16
    assert case.prompt_ids == tokenizer(case.prompt_text, add_special_tokens=False).input_ids
    assert abs(record_depth(tokenizer, case) - depth) < 0.03
    assert case.prompt_text.count(case.record) == 1
    assert case.prompt_text.count(case.key) == 3  # the record, the question, the answer's start
    assert case.prompt_text.endswith(f"The magic number of {case.key} is")


def test_prompt_is_chat_formatted_and_asks_for_the_records_key(tokenizer):
    case = make_case(tokenizer, 1024, 0.5, seed=3)
    assert case.prompt_text.startswith("<|im_start|>")
    assert f"What is the magic number of {case.key}?<|im_end|>" in case.prompt_text
    assert f"The magic number of {case.key} is {case.value}." == case.record


def test_same_seed_same_prompt_other_seed_other_prompt(tokenizer):
    first, again = make_case(tokenizer, 1024, 0.5, 7), make_case(tokenizer, 1024, 0.5, 7)
    assert first == again
    others = [make_case(tokenizer, 1024, 0.5, seed) for seed in range(8, 11)]
    assert all(other.prompt_ids != first.prompt_ids for other in others)
    assert len({(c.key, c.value) for c in [first, *others]}) > 1


def test_depth_outside_the_prompt_is_refused(tokenizer):
    with pytest.raises(ValueError, match="depth"):
        make_case(tokenizer, 1024, 1.5, 0)


@pytest.mark.parametrize(
    "answer, correct",
    [
        (" 4721.", True),
        (" 4721", True),
        (" **4721**, as stated.", True),
        (" 47210.", False),  # a longer number only contains it
        (" 14721", False),
        (" 4712.", False),
        (" unknown", False),
        ("", False),
    ],
)
def test_scoring_wants_the_value_as_a_whole_number(tokenizer, answer, correct):
    case = dataclasses.replace(make_case(tokenizer, 512, 0.5, 0), value="4721")
    assert is_correct(case, answer) == correct
