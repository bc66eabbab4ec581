"""The embedded corpus: deterministic documents with structure a small model can learn.

Nothing is downloaded. Every document is generated from a seeded `random.Random` (whose sequence is
stable across Python versions and platforms), so every machine sees the same text. The documents are
built so that their continuations are *predictable*: counting and arithmetic sequences, times tables,
repeated patterns, templated sentences over small vocabularies, key: value records, code-like lines and
short ChatML conversations. A drafter learns to predict the target's argmax; the target, trained on
this corpus, has confident and mostly correct argmaxes on it, so acceptance lengths mean something.

The held-out split is disjoint from train by construction: documents are deduplicated while they are
generated, and every `HELDOUT_EVERY`-th unique document goes to held-out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache
from typing import Literal

CORPUS_SEED = 20260415
NUM_DOCUMENTS = 3400
HELDOUT_EVERY = 17  # 3400 / 17 = 200 held-out documents, 3200 train documents

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar"]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Oslo", "Dublin", "Prague", "Athens"]
COUNTRIES = ["France", "Germany", "Spain", "Italy", "Portugal", "Austria", "Norway", "Ireland", "Czechia", "Greece"]
JOBS = ["baker", "teacher", "pilot", "farmer", "doctor", "painter", "nurse", "chef", "engineer", "writer"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "bear", "mouse", "goat", "duck"]
ADJECTIVES = ["small", "big", "quick", "lazy", "happy", "quiet", "old", "young", "brave", "sleepy"]
VERBS = ["sees", "likes", "chases", "finds", "follows", "helps", "watches", "meets"]
OBJECTS = ["ball", "box", "tree", "river", "house", "garden", "hill", "road", "bridge", "boat"]
PLACES = ["in the park", "near the river", "at the farm", "on the hill", "by the lake", "in the garden"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]
FRUITS = {"banana": "yellow", "apple": "red", "lime": "green", "plum": "purple", "orange": "orange",
          "cherry": "red", "kiwi": "green", "lemon": "yellow"}


def _counting(rng: random.Random) -> str:
    start, step = rng.randint(0, 200), rng.choice([1, 2, 3, 5, 10, 11])
    count = rng.randint(24, 60)
    numbers = ", ".join(str(start + i * step) for i in range(count))
    return f"Count from {start} by {step}: {numbers}."


def _times_table(rng: random.Random) -> str:
    n = rng.randint(2, 19)
    first = rng.randint(1, 4)
    rows = [f"{n} x {i} = {n * i}" for i in range(first, first + rng.randint(8, 16))]
    return f"The {n} times table:\n" + "\n".join(rows)


def _arithmetic_facts(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    a = rng.randint(1, 30)
    lines = []
    for b in range(1, rng.randint(8, 16)):
        result = a + b if op == "plus" else a - b if op == "minus" else a * b
        lines.append(f"{a} {op} {b} is {result}.")
    return " ".join(lines)


def _cycle(rng: random.Random) -> str:
    items = rng.choice([WEEKDAYS, MONTHS, NUMBER_WORDS[1:], list("abcdefghijklmnopqrstuvwxyz")])
    offset = rng.randrange(len(items))
    length = rng.randint(30, 80)
    return " ".join(items[(offset + i) % len(items)] for i in range(length))


def _repeated_pattern(rng: random.Random) -> str:
    pool = rng.choice([COLOURS, ANIMALS, OBJECTS])
    pattern = rng.sample(pool, rng.randint(2, 4))
    repeats = rng.randint(6, 14)
    return "Pattern: " + " ".join(pattern * repeats) + "."


def _story(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(4, 9)):
        adj, animal = rng.choice(ADJECTIVES), rng.choice(ANIMALS)
        verb, obj, place = rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES)
        sentences.append(f"The {adj} {animal} {verb} the {obj} {place}.")
    return " ".join(sentences)


def _records(rng: random.Random) -> str:
    records = []
    for _ in range(rng.randint(2, 5)):
        i = rng.randrange(len(CITIES))
        records.append(
            f"name: {rng.choice(NAMES)}\nage: {rng.randint(18, 80)}\ncity: {CITIES[i]}\n"
            f"country: {COUNTRIES[i]}\njob: {rng.choice(JOBS)}"
        )
    return "\n\n".join(records)


def _code(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        k = rng.randint(1, 9)
        lines = [f"def add_{k}(x):", f"    return x + {k}", ""]
        lines += [f"assert add_{k}({i}) == {i + k}" for i in range(rng.randint(6, 14))]
    elif kind == 1:
        start, step = rng.randint(0, 9), rng.randint(1, 5)
        lines = [f"x0 = {start}"]
        lines += [f"x{i} = x{i - 1} + {step}  # {start + i * step}" for i in range(1, rng.randint(8, 16))]
    else:
        word = rng.choice(ANIMALS + OBJECTS)
        n = rng.randint(4, 9)
        lines = [f"for i in range({n}):", f"    print(i, '{word}')", "", "# output:"]
        lines += [f"# {i} {word}" for i in range(n)]
    return "\n".join(lines)


def _chat_turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        i = rng.randrange(len(CITIES))
        return f"What is the capital of {COUNTRIES[i]}?", f"The capital of {COUNTRIES[i]} is {CITIES[i]}."
    if kind == 2:
        fruit = rng.choice(sorted(FRUITS))
        return f"What colour is a {fruit}?", f"A {fruit} is {FRUITS[fruit]}."
    if kind == 3:
        word = rng.choice(ANIMALS + OBJECTS + COLOURS)
        return f"Spell the word {word}.", f"{word} is spelled " + "-".join(word.upper()) + "."
    day = rng.randrange(7)
    return f"What day comes after {WEEKDAYS[day]}?", f"The day after {WEEKDAYS[day]} is {WEEKDAYS[(day + 1) % 7]}."


def _chat(rng: random.Random) -> str:
    # ChatML, the same format as the embedded tokenizer's chat template, so the target learns where
    # assistant turns start and end.
    parts = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"] if rng.random() < 0.5 else []
    for _ in range(rng.randint(2, 4)):
        question, answer = _chat_turn(rng)
        parts.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
    return "".join(parts)


GENERATORS: list[Callable[[random.Random], str]] = [
    _counting, _times_table, _arithmetic_facts, _cycle, _repeated_pattern, _story, _records, _code, _chat,
]


@lru_cache(maxsize=1)
def _all_documents() -> tuple[str, ...]:
    rng = random.Random(CORPUS_SEED)
    seen: set[str] = set()
    documents: list[str] = []
    while len(documents) < NUM_DOCUMENTS:
        text = rng.choice(GENERATORS)(rng)
        if text not in seen:  # uniqueness is what makes the held-out split disjoint from train
            seen.add(text)
            documents.append(text)
    return tuple(documents)


def embedded_documents(split: Literal["train", "heldout"]) -> list[str]:
    """The embedded corpus as text, deterministic: 3200 train and 200 held-out documents."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    documents = _all_documents()
    heldout = split == "heldout"
    return [d for i, d in enumerate(documents) if ((i % HELDOUT_EVERY) == HELDOUT_EVERY - 1) == heldout]
