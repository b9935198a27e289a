"""How an answer is scored against the expected words and against full attention's tokens."""

from __future__ import annotations

import re
from collections.abc import Sequence

WORD = re.compile(r"[A-Za-z0-9]+")


def is_correct(answers: Sequence[str], text: str) -> bool:
    """Exact match as RULER scores it, on whole words: every expected answer appears in the
    generated text as a word of its own, case aside (``123456`` in ``is 123456.`` counts, in
    ``1234567`` it does not). Answers are single words (tasks.Case checks)."""
    said = {word.lower() for word in WORD.findall(text)}
    return all(answer.lower() in said for answer in answers)


def agreed_tokens(output_ids: Sequence[int], reference_ids: Sequence[int]) -> int:
    """Generated tokens equal to the reference's before the first that differs."""
    agreed = 0
    for ours, theirs in zip(output_ids, reference_ids):
        if ours != theirs:
            break
        agreed += 1
    return agreed


def agreement(output_ids: Sequence[int], reference_ids: Sequence[int]) -> float:
    """The share of the longer output that agrees with the reference from its start: 1.0 only
    for identical outputs (an output stopping earlier or later than the reference's falls
    short)."""
    longest = max(len(output_ids), len(reference_ids))
    return agreed_tokens(output_ids, reference_ids) / longest if longest else 1.0
