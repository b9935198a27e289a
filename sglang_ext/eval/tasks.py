"""Long-context tasks in the style of RULER (Hsieh et al., 2024), generated from a seed, each case
exactly the requested number of tokens of the server's own tokenizer.

A case is a chat prompt: an instruction, a haystack of filler units with the task's needles at
seeded depths, a question, and the start of the assistant's answer (RULER's answer prefix: a
small model then answers in its first tokens). It is sent as token ids, so the length the model
sees is the length asked for. Every expected answer is one alphanumeric word (a number, a name,
a city), scored in ``scoring``.

Nothing is downloaded: the fillers are templated sentences (monotonous on purpose, so a needle is
the one sentence that stands out), the QA passage is a set of generated biographies.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import random
import re
import string
from collections.abc import Callable, Sequence
from typing import Protocol

ANSWER_WORD = re.compile(r"^[A-Za-z0-9]+$")  # what scoring.is_correct can find as a whole word


class Encoder(Protocol):
    """The server's tokenizer, as the tasks need it (``client.ServerEncoder``)."""

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, without special tokens."""

    def chat_frame(self) -> tuple[list[int], list[int]]:
        """The chat template's ids before a user message's content and after it, through the
        start of the assistant's turn."""


def split_frame(with_a: list[int], with_b: list[int]) -> tuple[list[int], list[int]]:
    """The template around a message, from the same chat rendered with two different contents:
    their common head and common tail."""
    head = 0
    while head < min(len(with_a), len(with_b)) and with_a[head] == with_b[head]:
        head += 1
    tail = 0
    while tail < min(len(with_a), len(with_b)) - head and with_a[-1 - tail] == with_b[-1 - tail]:
        tail += 1
    return with_a[:head], with_a[len(with_a) - tail :]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One case's content before sizing: the haystack's filler and the needles in it."""

    instruction: str
    question: str
    answer_prefix: str
    needles: tuple[str, ...]
    depths: tuple[float, ...]  # each needle's place in the haystack, 0 (start) to 1 (end)
    filler: Callable[[random.Random], str]  # one haystack unit
    answers: tuple[str, ...] = ()  # empty: counted from the finished haystack (``count_answers``)
    count_answers: Callable[[list[str]], tuple[str, ...]] | None = None

    def __post_init__(self):
        if len(self.needles) != len(self.depths):
            raise ValueError("a depth for each needle")
        if not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be in [0, 1], got {self.depths}")
        if bool(self.answers) == (self.count_answers is not None):
            raise ValueError("either fixed answers or a way to count them")


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], Spec]
    max_new_tokens: int  # enough for the full answer after the answer prefix
    about: str


@dataclasses.dataclass(frozen=True)
class Case:
    task: str
    length: int
    index: int
    seed: int
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]
    # where the needles that hold an answer start, as a share of the prompt (0: its first token)
    answer_depths: tuple[float, ...] = ()

    def __post_init__(self):
        if len(self.input_ids) != self.length:
            raise ValueError(f"{self.key}: built {len(self.input_ids)} tokens")
        if not self.answers or not all(ANSWER_WORD.match(a) for a in self.answers):
            raise ValueError(f"{self.key}: answers must be single words, got {self.answers}")

    @property
    def key(self) -> str:
        return case_key(self.task, self.length, self.index)


def case_key(task: str, length: int, index: int) -> str:
    """How results name a case (store.Result.case)."""
    return f"{task}/{length}/{index}"


# --- fillers and names ----------------------------------------------------------------------

FILLER_TEMPLATES = (
    "The {adj} {noun} stood near the {place} as the {time} went by.",
    "In the {place} the {noun} looked {adj} during the {time}.",
    "Nothing much happened to the {adj} {noun} by the {place} that {time}.",
    "People walked past the {noun} in the {place} on a {adj} {time}.",
)
FILLER_WORDS = {
    "adj": ("quiet", "old", "small", "grey", "calm", "plain", "simple", "ordinary"),
    "noun": ("house", "tree", "bench", "wall", "fence", "road", "garden", "window"),
    "place": ("village", "valley", "town", "field", "square", "park", "harbour", "street"),
    "time": ("morning", "afternoon", "evening", "day", "week", "season", "hour", "night"),
}
SYLLABLES = ("zeph", "quil", "mar", "ven", "dor", "ost", "rak", "bel", "san", "thorn",
             "vel", "kas", "tel", "ilv", "ret", "drum", "mon", "cal", "brix", "oth")  # fmt: skip


def filler_sentence(rng: random.Random) -> str:
    words = {slot: rng.choice(choices) for slot, choices in FILLER_WORDS.items()}
    return rng.choice(FILLER_TEMPLATES).format(**words)


def _names(rng: random.Random, count: int) -> list[str]:
    """Distinct invented names (keys that occur nowhere else in the prompt)."""
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize())
    return _shuffled(names, rng)


def _shuffled(items: set[str], rng: random.Random) -> list[str]:
    """A set in the generator's order (sorted first: a set's own order varies between runs)."""
    ordered = sorted(items)
    rng.shuffle(ordered)
    return ordered


def _numbers(rng: random.Random, count: int, digits: int = 6) -> list[str]:
    return [str(n) for n in rng.sample(range(10 ** (digits - 1), 10**digits), count)]


def _depths(rng: random.Random, count: int) -> tuple[float, ...]:
    return tuple(rng.random() for _ in range(count))


# --- needle in a haystack -------------------------------------------------------------------

NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards."
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."


def single_needle(rng: random.Random) -> Spec:
    (key,), (value,) = _names(rng, 1), _numbers(rng, 1)
    return Spec(
        NIAH_INSTRUCTION,
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is",
        (NEEDLE.format(key=key, value=value),), _depths(rng, 1), filler_sentence, (value,),
    )  # fmt: skip


def multi_key(rng: random.Random, keys: int = 4) -> Spec:
    """Needles of several keys; the question asks for one of them (the others distract)."""
    names, values = _names(rng, keys), _numbers(rng, keys)
    asked = rng.randrange(keys)
    return Spec(
        NIAH_INSTRUCTION,
        f"What is the special magic number for {names[asked]} mentioned in the provided text?",
        f"The special magic number for {names[asked]} mentioned in the provided text is",
        tuple(NEEDLE.format(key=k, value=v) for k, v in zip(names, values)),
        _depths(rng, keys), filler_sentence, (values[asked],),
    )  # fmt: skip


def multi_value(rng: random.Random, values: int = 4) -> Spec:
    """One key with several values; every value is asked for."""
    (key,), numbers = _names(rng, 1), _numbers(rng, values)
    return Spec(
        NIAH_INSTRUCTION,
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
        tuple(NEEDLE.format(key=key, value=v) for v in numbers),
        _depths(rng, values), filler_sentence, tuple(numbers),
    )  # fmt: skip


def multi_query(rng: random.Random, keys: int = 4) -> Spec:
    """Needles of several keys; every key is asked for."""
    names, values = _names(rng, keys), _numbers(rng, keys)
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    return Spec(
        NIAH_INSTRUCTION,
        f"What are the special magic numbers for {listed} mentioned in the provided text?",
        f"The special magic numbers for {listed} mentioned in the provided text are",
        tuple(NEEDLE.format(key=k, value=v) for k, v in zip(names, values)),
        _depths(rng, keys), filler_sentence, tuple(values),
    )  # fmt: skip


# --- variable tracking ----------------------------------------------------------------------


def variable_tracking(rng: random.Random, hops: int = 4, chains: int = 2) -> Spec:
    """Chains of assignments (``VAR B = VAR A.``) from a number; the question asks for every
    variable of the first chain, the others distract. Each chain's statements keep their order."""
    letters = set()
    while len(letters) < chains * (hops + 1):
        letters.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
    names = _shuffled(letters, rng)
    numbers = _numbers(rng, chains, digits=5)
    needles, depths = [], []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        needles += [f"VAR {chain[0]} = {numbers[c]}."]
        needles += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(chain)]
        depths += sorted(rng.random() for _ in chain)
    asked = names[: hops + 1]
    return Spec(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.",
        f"Find all variables that are assigned the value {numbers[0]} in the text above.",
        f"According to the chain(s) of variable assignment in the text above, {hops + 1} "
        f"variables are assigned the value {numbers[0]}, they are:",
        tuple(needles), tuple(depths), filler_sentence, tuple(asked),
    )  # fmt: skip


# --- frequent words -------------------------------------------------------------------------

FREQUENT_SHARES = (20.0, 14.0, 10.0)  # per cent of the words, the three to find
RARE_WORDS = 40  # sharing the rest evenly: each about a tenth of the third's share


def frequent_words(rng: random.Random) -> Spec:
    """A coded text of invented words, three of them far more frequent than the rest."""
    vocabulary: set[str] = set()
    while len(vocabulary) < len(FREQUENT_SHARES) + RARE_WORDS:
        vocabulary.add("".join(rng.choice(string.ascii_lowercase) for _ in range(5)))
    words = _shuffled(vocabulary, rng)
    rare_share = (100.0 - sum(FREQUENT_SHARES)) / RARE_WORDS
    weights = [*FREQUENT_SHARES, *[rare_share] * RARE_WORDS]

    def filler(unit_rng: random.Random) -> str:
        return unit_rng.choices(words, weights)[0]

    return Spec(
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words.",
        "What are the three most frequently appeared words in the above coded text?",
        "According to the coded text above, the three most frequently appeared words are:",
        (), (), filler, count_answers=three_most_frequent,
    )  # fmt: skip


def three_most_frequent(words: list[str]) -> tuple[str, ...]:
    counts = collections.Counter(words).most_common()
    if len(counts) < 4 or counts[2][1] <= counts[3][1]:
        raise ValueError("too short for three clearly most frequent words")
    return tuple(word for word, _ in counts[:3])


# --- question answering over a passage ------------------------------------------------------

FIRST_NAMES = ("Amara", "Bastian", "Corinne", "Dmitri", "Elodie", "Farid", "Greta", "Hiro",
               "Ingrid", "Joaquin", "Katya", "Lorenzo", "Maren", "Nikolai", "Odile", "Pavel",
               "Quinta", "Rafael", "Solveig", "Tomasz")  # fmt: skip
LAST_NAMES = ("Abernathy", "Brandvold", "Castellanos", "Dunmore", "Eriksen", "Fairbrother",
              "Galloway", "Halvorsen", "Ivanova", "Jablonski", "Kowalczyk", "Lindqvist",
              "Marchetti", "Novak", "Okonkwo", "Pemberton", "Quintero", "Rasmussen")  # fmt: skip
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Zurich", "Cairo", "Quito",
          "Perth", "Seville", "Krakow", "Osaka", "Tbilisi", "Bergen", "Porto")  # fmt: skip
JOBS = ("baker", "pilot", "tailor", "surgeon", "architect", "librarian", "carpenter", "chemist",
        "sailor", "painter", "jeweller", "florist", "geologist", "translator")  # fmt: skip
INSTRUMENTS = ("violin", "cello", "flute", "piano", "harp", "oboe", "trumpet", "accordion")
BIOGRAPHY = (
    "{name} was born in {city} in the year {year}. {name} worked as a {job} for many years "
    "and played the {instrument} in the evenings."
)
# what is asked about the chosen person: (fact, question, answer prefix)
QUESTIONS = (
    ("city", "In which city was {name} born?", "{name} was born in the city of"),
    ("job", "What did {name} work as?", "{name} worked as a"),
    ("year", "In which year was {name} born?", "{name} was born in the year"),
)


def _biography(rng: random.Random, name: str) -> tuple[str, dict[str, str]]:
    facts = {
        "city": rng.choice(CITIES), "job": rng.choice(JOBS),
        "year": str(rng.randrange(1850, 2000)), "instrument": rng.choice(INSTRUMENTS),
    }  # fmt: skip
    return BIOGRAPHY.format(name=name, **facts), facts


def passage_qa(rng: random.Random) -> Spec:
    """A passage of short biographies; the question asks one fact of one person in it."""
    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    biography, facts = _biography(rng, name)
    fact, question, prefix = rng.choice(QUESTIONS)

    def filler(unit_rng: random.Random) -> str:
        while (other := f"{unit_rng.choice(FIRST_NAMES)} {unit_rng.choice(LAST_NAMES)}") == name:
            pass
        return _biography(unit_rng, other)[0]

    return Spec(
        "Answer the question based on the following biographies.",
        question.format(name=name), prefix.format(name=name),
        (biography,), _depths(rng, 1), filler, (facts[fact],),
    )  # fmt: skip


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("single_needle", single_needle, 16, "one number under one key"),
        Task("multi_key", multi_key, 16, "one key's number among four keys' needles"),
        Task("multi_value", multi_value, 48, "all four numbers of one key"),
        Task("multi_query", multi_query, 48, "the numbers of four keys, all asked at once"),
        Task("variable_tracking", variable_tracking, 32, "every variable of an assignment chain"),
        Task("frequent_words", frequent_words, 24, "the three most frequent words of a coded text"),
        Task("qa", passage_qa, 16, "one fact of one person in a passage of biographies"),
    )
}


# --- sizing ---------------------------------------------------------------------------------


def build_case(encoder: Encoder, task: str, length: int, index: int, seed: int) -> Case:
    """Case ``index`` of ``task`` at exactly ``length`` tokens. The content (keys, values,
    depths) depends on the seed alone; the haystack is drawn from its own generator until it
    fills the tokens left, and its first unit is cut at the front to land exactly (a haystack
    that starts mid-sentence, as RULER's excerpts do). Raises ValueError where ``length`` cannot
    hold the task."""
    spec = TASKS[task].make(random.Random(f"{seed}/{task}/{length}/{index}"))
    before, after = encoder.chat_frame()
    head, question, prefix, *needles = encoder.encode(
        [spec.instruction + "\n\n", "\n\n" + spec.question, spec.answer_prefix,
         *(" " + needle for needle in spec.needles)]
    )  # fmt: skip
    fixed = len(before) + len(head) + len(question) + len(after) + len(prefix)
    budget = length - fixed - sum(map(len, needles))
    if budget < 1:
        raise ValueError(f"{task} needs more than {length} tokens (at least {length - budget + 1})")
    filler_rng = random.Random(f"{seed}/{task}/{length}/{index}/haystack")
    units = _haystack(encoder, spec.filler, filler_rng, budget)
    answers = spec.answers or spec.count_answers([text for text, _ in units if text is not None])
    # needles between the units nearest their depths; in depth order (a chain keeps its order)
    placed = sorted(zip(spec.depths, range(len(needles))))
    slots = collections.defaultdict(list)
    for depth, n in placed:
        slots[round(depth * len(units))].append(n)
    haystack: list[int] = []
    starts: dict[int, int] = {}  # needle -> its first token in the haystack
    for at in range(len(units) + 1):
        for n in slots.get(at, ()):
            starts[n] = len(haystack)
            haystack += needles[n]
        if at < len(units):
            haystack += units[at][1]
    ids = before + head + haystack + question + after + prefix
    offset = len(before) + len(head)
    depths = sorted(
        round((offset + start) / length, 3) for n, start in starts.items()
        if any(answer in spec.needles[n] for answer in answers)
    )  # fmt: skip
    return Case(task, length, index, seed, tuple(ids), tuple(answers), tuple(depths))


def _haystack(
    encoder: Encoder, filler: Callable[[random.Random], str], rng: random.Random, budget: int
) -> list[tuple[str | None, list[int]]]:
    """Filler units of exactly ``budget`` tokens: (text, ids), text None for the cut first one.
    Units are tokenized in batches (one tokenizer call each), each with its leading space: the
    space is where tokenizers split words, so the ids joined are the text's own."""
    units: list[tuple[str | None, list[int]]] = []
    total, batch = 0, 64
    while total < budget:
        texts = [filler(rng) for _ in range(batch)]
        for text, ids in zip(texts, encoder.encode([" " + t for t in texts])):
            if total >= budget:
                break
            units.append((text, ids))
            total += len(ids)
        # the next batch: what is left at the mean unit length so far, and some over
        batch = max(16, math.ceil((budget - total) / (total / len(units)) * 1.1))
    over = total - budget
    while over:
        text, ids = units[0]
        if len(ids) <= over:
            units.pop(0)
            over -= len(ids)
        else:
            units[0], over = (None, ids[over:]), 0
    return units
