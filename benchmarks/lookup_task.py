"""A key-value lookup task for long-context retrieval: one distinctive record among many similar
filler sentences, then a question whose answer is the record's value.

On SmolLM2-135M the classic passkey prompt fails past ~1k tokens even with full attention, while a
lookup of a distinctive key among similar filler holds to ~6.5k: the filler is monotonous on
purpose, so the record is the one sentence that stands out. Prompts are built on the model's chat
template and end inside the assistant's answer (``The magic number of <key> is``), so a correct
answer is the value within the first few generated tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import random

# Similar, uneventful sentences: every one is a slot-filled variant of a few templates.
FILLER_TEMPLATES = [
    "The {adj} {noun} stood near the {place} as the {time} went by.",
    "In the {place} the {noun} looked {adj} during the {time}.",
    "Nothing much happened to the {adj} {noun} by the {place} that {time}.",
    "People walked past the {noun} in the {place} on a {adj} {time}.",
]
FILLER_WORDS = {
    "adj": ["quiet", "old", "small", "grey", "calm", "plain", "simple", "ordinary"],
    "noun": ["house", "tree", "bench", "wall", "fence", "road", "garden", "window"],
    "place": ["village", "valley", "town", "field", "square", "park", "harbour", "street"],
    "time": ["morning", "afternoon", "evening", "day", "week", "season", "hour", "night"],
}
KEYS = ["Zephyrine", "Quillorath", "Marvendel", "Ostrakov", "Belisandra", "Thornquist",
        "Velmorra", "Kastellan", "Ilvaretta", "Drummondel"]  # fmt: skip
RECORD = "The magic number of {key} is {value}."
QUESTION = "What is the magic number of {key}?"
ANSWER_PREFIX = "The magic number of {key} is"
INSTRUCTION = (
    "Read the following text carefully. One sentence in it gives a magic number; "
    "you will be asked for it."
)
HAYSTACK_MARK = "<<haystack>>"


@dataclasses.dataclass(frozen=True)
class LookupCase:
    target_len: int
    depth: float  # fraction of the prompt's tokens before the record
    seed: int
    key: str
    value: str
    record: str  # the record sentence, as it appears in prompt_text
    prompt_text: str
    prompt_ids: list[int]


def _filler(rng: random.Random) -> str:
    words = {slot: rng.choice(choices) for slot, choices in FILLER_WORDS.items()}
    return rng.choice(FILLER_TEMPLATES).format(**words)


def _prompt_frame(tokenizer, key: str) -> tuple[str, str]:
    """The chat-template text before and after the haystack, ending in the answer's start."""
    user = f"{INSTRUCTION}\n\n{HAYSTACK_MARK}\n\n{QUESTION.format(key=key)}"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    before, after = text.split(HAYSTACK_MARK)
    return before, after + ANSWER_PREFIX.format(key=key)


def _token_len(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def make_case(tokenizer, target_len: int, depth: float, seed: int) -> LookupCase:
    """A prompt of about ``target_len`` tokens with the record ``depth`` of the way into it.

    Sentences are joined by spaces, where the tokenizer's pre-tokenization always splits, so a
    haystack's token count is the sum of its sentences' counts; the whole prompt is tokenized
    once at the end to measure it exactly.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"lookup-{target_len}-{depth}-{seed}")
    key, value = rng.choice(KEYS), str(rng.randrange(1000, 10000))
    record = RECORD.format(key=key, value=value)
    before, after = _prompt_frame(tokenizer, key)
    frame_len = _token_len(tokenizer, before) + _token_len(tokenizer, after)
    haystack_len = target_len - frame_len - _token_len(tokenizer, " " + record)
    fillers, ends = [], [0]  # ends[i]: the haystack's tokens after i filler sentences
    while ends[-1] < haystack_len:
        fillers.append(_filler(rng))
        ends.append(ends[-1] + _token_len(tokenizer, " " + fillers[-1]))
    if ends[-1] - haystack_len > haystack_len - ends[-2]:  # the closer of the two lengths
        fillers.pop()
    # The record goes after the filler sentence whose end is nearest the requested depth.
    wanted = depth * target_len - _token_len(tokenizer, before)
    at = min(bisect.bisect_left(ends, wanted), len(fillers))
    if at > 0 and wanted - ends[at - 1] < ends[at] - wanted:
        at -= 1
    sentences = [*fillers[:at], record, *fillers[at:]]
    prompt_text = before + "".join(" " + s for s in sentences).lstrip() + after
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
    return LookupCase(target_len, depth, seed, key, value, record, prompt_text, prompt_ids)


def record_depth(tokenizer, case: LookupCase) -> float:
    """The fraction of the prompt's tokens before the record, measured on the prompt text."""
    start = case.prompt_text.index(case.record)
    return _token_len(tokenizer, case.prompt_text[:start]) / len(case.prompt_ids)


def is_correct(case: LookupCase, generated_text: str) -> bool:
    """Whether the answer names the value (as a whole number, not inside a longer one)."""
    digits = "".join(ch if ch.isdigit() else " " for ch in generated_text).split()
    return case.value in digits
