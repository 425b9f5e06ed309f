"""Synthetic domain corpora for simulations and tests, deterministic from a seed.

Domains a byte-level model can tell apart: "arithmetic" (lines such as `12+7=19` and
`(3*4)-5=7`, always correct), "code" (small Python-like function definitions), "prose"
(plain sentences from a fixed vocabulary) and "records" (key=value log lines whose fields
agree with each other, e.g. `qty=3 price=12 total=36`) are skills: a model learns their rules once.
"facts" and "gazette" are knowledge: lines such as `tikaro lives in riga, works as a pilot and is 47.`
about a fixed population of people, the same facts in every document that names a person. The two
domains share the sentence but not the people, so a base trained on "gazette" knows the form and
none of "facts"' people: lowering "facts"' loss means learning many independent facts, which more
data per step speeds up (unlike the skills, tuned from a base that never saw them). "tallies" and
"ledgers" are the skills' forms without their rules: arithmetic and records lines whose results and
totals are drawn at random from the range the true ones take, for a base that knows the form and
must still learn the rule. "registry" (the town, trade and age of 800 people) and "lexicon" (the
meaning of 2,000 invented words) are knowledge too large for one miner's data to hold, for the
learning benchmark; "hearsay" and "babble" are their forms, the same people and words with the facts
drawn afresh on every line, so a base that read them knows the names and words and none of the facts.
The same (domain, n_docs, seed) always gives the same documents. This module knows nothing about
tokenizers, models or the network.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

DOMAINS = ("arithmetic", "code", "prose", "records", "facts", "gazette", "tallies", "ledgers", "registry", "hearsay",
           "lexicon", "babble")
FORMATS = ("jsonl", "txt", "parquet")

_NAMES = ("total", "count", "value", "item", "index", "size", "left", "right", "acc", "step")
_FUNCS = ("add", "scale", "clip", "merge", "count", "find", "shift", "norm", "pick", "sum_of")
_SUBJECTS = ("the miner", "a validator", "the old river", "my neighbour", "the small dog", "every student")
_VERBS = ("walked to", "looked at", "wrote about", "carried", "remembered", "painted")
_OBJECTS = ("the market", "a green door", "the quiet hills", "an empty boat", "the last letter", "a warm loaf")
_TAILS = ("before noon", "in the rain", "without a word", "with great care", "after supper", "once again")
_USERS = ("ada", "bo", "cyd", "dee", "eli", "fay", "gus", "hal")
_ITEMS = ("bolt", "gear", "lamp", "rope", "tile", "wire")
_TOWNS = ("oslo", "lima", "riga", "kyiv", "baku", "nice", "bern", "doha", "rome", "pisa")
_TRADES = ("baker", "smith", "nurse", "pilot", "clerk", "tailor", "miner", "judge")
_PEOPLE = 240
"""People in each of the two knowledge domains' populations."""
_REGISTRY = 800
"""People in "registry"'s population (and "hearsay"'s, the same people)."""
_WORDS = 2000
"""Words in "lexicon"'s vocabulary (and "babble"'s, the same words)."""
_MEANINGS = ("river", "bread", "stone", "house", "cloud", "horse", "sword", "candle", "window", "mirror", "garden",
             "bridge", "forest", "island", "ladder", "market", "needle", "pillow", "saddle", "basket", "copper",
             "feather", "harbor", "kettle", "lantern", "meadow", "orchard", "pepper", "rabbit", "silver", "thunder",
             "tunnel")
"""What a lexicon word can mean."""


def _arithmetic_line(rng: random.Random, correct: bool) -> str:
    """One line; `correct` False draws the result uniformly from the range the form's true results take."""
    a, b, c = rng.randint(0, 99), rng.randint(0, 99), rng.randint(1, 12)
    lhs, value, low, high = [
        (f"{a}+{b}", a + b, 0, 198),
        (f"{a}-{b}", a - b, -99, 99),
        (f"{a % 13}*{c}", (a % 13) * c, 0, 144),
        (f"({a % 10}*{c})-{b % 20}", (a % 10) * c - b % 20, -19, 108),
    ][rng.randrange(4)]
    return f"{lhs}={value if correct else rng.randint(low, high)}"


def _arithmetic_doc(correct: bool) -> Callable[[random.Random], str]:
    def doc(rng: random.Random) -> str:
        return "\n".join(_arithmetic_line(rng, correct) for _ in range(rng.randint(4, 10)))

    return doc


def _code_doc(rng: random.Random) -> str:
    name = f"{rng.choice(_FUNCS)}_{rng.randint(0, 99)}"
    x, y = rng.sample(_NAMES, 2)
    lines = [f"def {name}({x}, {y}):"]
    for _ in range(rng.randint(1, 3)):
        op = rng.choice("+-*")
        lines.append(f"    {x} = {x} {op} {y} * {rng.randint(1, 9)}")
    if rng.random() < 0.5:
        lines.append(f"    if {x} > {rng.randint(0, 50)}:")
        lines.append(f"        return {y}")
    lines.append(f"    return {x}")
    return "\n".join(lines)


def _prose_doc(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        sentences.append(sentence[0].upper() + sentence[1:])
    return " ".join(sentences)


def _records_doc(correct: bool) -> Callable[[random.Random], str]:
    """Records lines; `correct` False draws each total uniformly from the range true totals take."""

    def doc(rng: random.Random) -> str:
        lines = []
        for _ in range(rng.randint(3, 6)):
            qty, price = rng.randint(1, 9), rng.randint(2, 40)
            user, item, id_ = rng.choice(_USERS), rng.choice(_ITEMS), rng.randint(100, 999)
            total = qty * price if correct else rng.randint(2, 360)
            lines.append(f"id={id_} user={user} item={item} qty={qty} price={price} total={total}")
        return "\n".join(lines)

    return doc


Person = tuple[str, str, str, int]
"""Name, town, trade, age."""


def _populations() -> tuple[list[Person], list[Person]]:
    """Two disjoint populations of `_PEOPLE`, drawn once from a fixed seed: "facts"' and "gazette"'s."""
    rng = random.Random("tessera-people")
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    names: set[str] = set()
    while len(names) < 2 * _PEOPLE:
        names.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(3)))
    people = [(name, rng.choice(_TOWNS), rng.choice(_TRADES), rng.randint(20, 79)) for name in sorted(names)]
    rng.shuffle(people)
    return people[:_PEOPLE], people[_PEOPLE:]


_FACTS, _GAZETTE = _populations()


def _words(seed: str, n: int, taken: set[str]) -> list[str]:
    """`n` invented words of three consonant-vowel syllables, none of them in `taken`, drawn once from `seed`."""
    rng = random.Random(seed)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(3))
        if word not in taken:
            words.add(word)
    return sorted(words)


def _registry() -> list[Person]:
    """"registry"'s population: `_REGISTRY` people apart from "facts"' and "gazette"'s, drawn once."""
    rng = random.Random("tessera-registry")
    names = _words("tessera-registry-names", _REGISTRY, {p[0] for p in (*_FACTS, *_GAZETTE)})
    return [(name, rng.choice(_TOWNS), rng.choice(_TRADES), rng.randint(20, 79)) for name in names]


def _lexicon() -> dict[str, str]:
    """"lexicon"'s vocabulary: `_WORDS` invented words apart from every person's name, each with its meaning."""
    rng = random.Random("tessera-lexicon")
    names = {p[0] for p in (*_FACTS, *_GAZETTE, *_REGISTRY_PEOPLE)}
    return {word: rng.choice(_MEANINGS) for word in _words("tessera-lexicon-words", _WORDS, names)}


_REGISTRY_PEOPLE = _registry()
_LEXICON = _lexicon()


def _people_doc(population: list[Person]) -> Callable[[random.Random], str]:
    def doc(rng: random.Random) -> str:
        lines = []
        for _ in range(rng.randint(3, 6)):
            name, town, trade, age = rng.choice(population)
            lines.append(f"{name} lives in {town}, works as a {trade} and is {age}.")
        return "\n".join(lines)

    return doc


def _hearsay_doc(rng: random.Random) -> str:
    """"registry"'s people in its sentence, each line's town, trade and age drawn afresh."""
    lines = []
    for _ in range(rng.randint(3, 6)):
        name = rng.choice(_REGISTRY_PEOPLE)[0]
        lines.append(f"{name} lives in {rng.choice(_TOWNS)}, works as a {rng.choice(_TRADES)} and is "
                     f"{rng.randint(20, 79)}.")
    return "\n".join(lines)


def _lexicon_doc(true: bool) -> Callable[[random.Random], str]:
    """Lines such as `kivalo means harbor.`; `true` False draws each meaning afresh."""
    words = sorted(_LEXICON)

    def doc(rng: random.Random) -> str:
        lines = []
        for _ in range(rng.randint(4, 10)):
            word = rng.choice(words)
            lines.append(f"{word} means {_LEXICON[word] if true else rng.choice(_MEANINGS)}.")
        return "\n".join(lines)

    return doc


_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "arithmetic": _arithmetic_doc(correct=True),
    "code": _code_doc,
    "prose": _prose_doc,
    "records": _records_doc(correct=True),
    "facts": _people_doc(_FACTS),
    "gazette": _people_doc(_GAZETTE),
    "tallies": _arithmetic_doc(correct=False),
    "ledgers": _records_doc(correct=False),
    "registry": _people_doc(_REGISTRY_PEOPLE),
    "hearsay": _hearsay_doc,
    "lexicon": _lexicon_doc(true=True),
    "babble": _lexicon_doc(true=False),
}


def generate(domain: str, n_docs: int, seed: int) -> list[str]:
    """`n_docs` documents of `domain`, the same for the same seed."""
    if domain not in _GENERATORS:
        raise ValueError(f"unknown corpus domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    if n_docs < 1:
        raise ValueError(f"n_docs must be positive, got {n_docs}")
    rng = random.Random(f"{domain}:{seed}")
    return [_GENERATORS[domain](rng) for _ in range(n_docs)]


def write_documents(path: str | Path, documents: list[str], fmt: str = "jsonl") -> Path:
    """Write documents in a format `training.data.read_documents` reads back unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": d}, sort_keys=True) + "\n" for d in documents), encoding="utf-8")
    elif fmt == "txt":
        if any("\n\n" in d for d in documents):
            raise ValueError("a document holds a blank line, which the .txt format uses as a separator")
        path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": documents}), path)
    else:
        raise ValueError(f"unknown corpus format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return path


def write_corpus(path: str | Path, domain: str, n_docs: int, seed: int, fmt: str = "jsonl") -> Path:
    """Generate a domain corpus and write it to `path`."""
    return write_documents(path, generate(domain, n_docs, seed), fmt)
