"""Data loading, packing, sharding, batching, held-out subsets and the synthetic corpora."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from training.corpus import generate, write_corpus, write_documents
from training.data import (
    batches,
    check_disjoint,
    file_sha256,
    heldout_subset,
    load_sequences,
    pack,
    read_documents,
    shard,
)
from training.tokenizer import ByteTokenizer, load_tokenizer

DOCS = ["alpha beta", "gamma\ndelta", "épsilon ζ"]


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_each_format_reads_back_the_documents_written(tmp_path: Path, fmt: str) -> None:
    path = write_documents(tmp_path / f"docs.{fmt}", DOCS, fmt)
    assert read_documents(path) == DOCS


def test_txt_splits_documents_on_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo\n\n\nthree\n\n", encoding="utf-8")
    assert read_documents(path) == ["one\ntwo", "three"]


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        read_documents(path)
    path.write_text(json.dumps({"body": "no text"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*'text'"):
        read_documents(path)


def test_parquet_without_text_column_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        read_documents(tmp_path / "p.parquet")


def test_unknown_suffix_and_missing_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported data file type"):
        read_documents(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="no such data file"):
        read_documents(tmp_path / "x.jsonl")


@pytest.mark.parametrize("fmt", ["jsonl", "txt"])
def test_a_file_that_is_not_utf8_is_named_with_line_and_offset(tmp_path: Path, fmt: str) -> None:
    path = write_documents(tmp_path / f"docs.{fmt}", ["first", "second"], fmt)
    good = path.read_bytes()
    path.write_bytes(good + "caf\N{LATIN SMALL LETTER E WITH ACUTE}".encode("latin-1"))
    line = good.count(b"\n") + 1
    with pytest.raises(ValueError) as caught:
        read_documents(path)
    assert str(caught.value) == f"{path}:{line}: not UTF-8 text (byte 0xe9 at offset {len(good) + 3})"


def test_newlines_are_read_as_text_mode_reads_them(tmp_path: Path) -> None:
    txt, jsonl = tmp_path / "a.txt", tmp_path / "a.jsonl"
    txt.write_bytes(b"one\r\ntwo\r\n\r\nthree\rfour\r\rfive")
    jsonl.write_bytes(b'{"text": "x"}\r\n\r\n{"text": "y"}\r{"text": "z"}')
    assert read_documents(txt) == ["one\ntwo", "three\nfour", "five"]
    assert read_documents(jsonl) == ["x", "y", "z"]


def test_files_with_no_documents_are_named(tmp_path: Path) -> None:
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.txt"
    empty.write_bytes(b"")
    blank.write_text("\n\n  \n", encoding="utf-8")
    with pytest.raises(ValueError) as caught:
        load_sequences([empty], ByteTokenizer(), 8)
    assert str(caught.value) == f"{empty}: the data file holds no documents"
    with pytest.raises(ValueError) as caught:
        load_sequences([empty, blank], ByteTokenizer(), 8)
    assert str(caught.value) == f"{empty}, {blank}: the data files hold no documents"


def test_pack_appends_eos_and_pads_only_the_last_row() -> None:
    tok = ByteTokenizer()
    packed = pack(["ab", "cde"], tok, seq_len=4)
    assert packed.dtype == torch.long
    assert packed.tolist() == [[97, 98, 258, 99], [100, 101, 258, 256]]
    assert pack(["abc"], tok, seq_len=4).tolist() == [[97, 98, 99, 258]]


def test_load_sequences_concatenates_files_in_order(tmp_path: Path) -> None:
    a = write_documents(tmp_path / "a.jsonl", ["xy"])
    b = write_documents(tmp_path / "b.txt", ["z"], "txt")
    tok = ByteTokenizer()
    assert load_sequences([a, b], tok, 3).tolist() == [[120, 121, 258], [122, 258, 256]]
    assert load_sequences([b, a], tok, 3).tolist() == [[122, 258, 120], [121, 258, 256]]


def test_load_tokenizer_byte_and_missing_directory(tmp_path: Path) -> None:
    tok = load_tokenizer("byte", tmp_path)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (260, 256, 258)
    assert tok.encode("é") == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer("no-such-tokenizer", tmp_path)


def test_load_tokenizer_reads_a_local_hf_tokenizer_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]").save_pretrained(
        tmp_path / "tok"
    )
    tok = load_tokenizer("tok", tmp_path)
    assert tok.encode("hello world foo") == [2, 3, 0]
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 1, 4)
    assert pack(["hello", "world hello"], tok, 3).tolist() == [[2, 1, 3], [2, 1, 1]]


def _rows(n: int, seq_len: int = 4) -> torch.Tensor:
    return torch.arange(n * seq_len).view(n, seq_len)


def test_shard_is_deterministic_per_miner_and_differs_between_miners() -> None:
    data = _rows(100)
    a1, a2 = shard(data, "miner-a", 3), shard(data, "miner-a", 3)
    b = shard(data, "miner-b", 3)
    assert torch.equal(a1, a2)
    assert a1.shape == (50, 4)
    assert not torch.equal(a1, b)
    a_next = shard(data, "miner-a", 4)
    assert set(map(tuple, a_next.tolist())) == set(map(tuple, a1.tolist()))
    assert not torch.equal(a_next, a1)


def test_batches_are_endless_deterministic_and_cover_every_row_per_pass() -> None:
    data = _rows(10)
    first = [b.clone() for _, b in zip(range(5), batches(data, 4, seed=7), strict=False)]
    again = [b.clone() for _, b in zip(range(5), batches(data, 4, seed=7), strict=False)]
    other = [b.clone() for _, b in zip(range(5), batches(data, 4, seed=8), strict=False)]
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(first, other, strict=True))
    seen = torch.cat(first)[:10, 0].div(4, rounding_mode="floor")
    assert sorted(seen.tolist()) == list(range(10))


def test_heldout_subset_follows_the_round_seed() -> None:
    data = _rows(50)
    seed_a, seed_b = "ab" * 32, "cd" * 32
    subset = heldout_subset(data, seed_a, 8)
    assert torch.equal(subset, heldout_subset(data, seed_a, 8))
    assert subset.shape == (8, 4)
    assert not torch.equal(subset, heldout_subset(data, seed_b, 8))
    with pytest.raises(ValueError, match="has 50 sequences but the spec asks for 51"):
        heldout_subset(data, seed_a, 51)


def test_file_sha256_and_disjointness(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    assert file_sha256(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    check_disjoint(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="shares 1 document"):
        check_disjoint(["a", "b"], ["b", "c"])


def test_corpus_is_deterministic_and_seed_dependent(tmp_path: Path) -> None:
    assert generate("arithmetic", 20, 1) == generate("arithmetic", 20, 1)
    assert generate("arithmetic", 20, 1) != generate("arithmetic", 20, 2)
    p1 = write_corpus(tmp_path / "a.jsonl", "code", 30, 5)
    p2 = write_corpus(tmp_path / "b.jsonl", "code", 30, 5)
    assert p1.read_bytes() == p2.read_bytes()
    with pytest.raises(ValueError, match="unknown corpus domain"):
        generate("poetry", 1, 0)


def test_arithmetic_lines_are_correct() -> None:
    for doc in generate("arithmetic", 50, 3):
        for line in doc.splitlines():
            lhs, rhs = line.split("=")
            assert eval(lhs) == int(rhs), line  # noqa: S307 - generated arithmetic only


def test_the_skills_forms_have_their_lines_with_results_drawn_from_the_true_range() -> None:
    tallies = [line for doc in generate("tallies", 100, 3) for line in doc.splitlines()]
    correct = 0
    for line in tallies:
        lhs, rhs = line.split("=")
        assert re.fullmatch(r"\d+[+-]\d+|\d+\*\d+|\(\d\*\d+\)-\d+", lhs), line  # arithmetic's four forms
        correct += eval(lhs) == int(rhs)  # noqa: S307 - generated arithmetic only
        assert -99 <= int(rhs) <= 198, line
    ledgers = [line for doc in generate("ledgers", 100, 3) for line in doc.splitlines()]
    pattern = r"id=\d{3} user=[a-z]+ item=[a-z]+ qty=(\d) price=(\d+) total=(\d+)"
    matches = [re.fullmatch(pattern, line) for line in ledgers]
    assert all(matches), ledgers[:3]
    agreeing = sum(int(m[1]) * int(m[2]) == int(m[3]) for m in matches if m)
    assert all(2 <= int(m[3]) <= 360 for m in matches if m)
    assert correct < 0.05 * len(tallies) and agreeing < 0.05 * len(ledgers)  # the rules are not there to learn
    assert generate("tallies", 5, 3) == generate("tallies", 5, 3) != generate("arithmetic", 5, 3)


def _people(domain: str) -> dict[str, str]:
    """Name -> the rest of its sentence, over many documents; fails if one person's facts ever differ."""
    facts: dict[str, str] = {}
    for seed in (0, 1):
        for doc in generate(domain, 200, seed):
            for line in doc.splitlines():
                name, rest = line.split(" lives in ")
                assert facts.setdefault(name, rest) == rest, f"{name} has two sets of facts"
    return facts


def test_knowledge_domains_repeat_each_persons_facts_and_share_no_people() -> None:
    facts, gazette = _people("facts"), _people("gazette")
    assert len(facts) > 200 and len(gazette) > 200  # documents draw from populations of 240
    assert not facts.keys() & gazette.keys()
    line = generate("facts", 1, 0)[0].splitlines()[0]
    assert re.fullmatch(r"[a-z]{6} lives in [a-z]+, works as a [a-z]+ and is \d\d\.", line), line


def _pairs(domain: str, separator: str) -> list[tuple[str, str]]:
    """(subject, the rest of its line) over many documents."""
    return [tuple(line.split(separator)) for seed in (0, 1) for doc in generate(domain, 300, seed)  # type: ignore[misc]
            for line in doc.splitlines()]


def test_registry_and_lexicon_repeat_their_facts_and_their_forms_draw_them_afresh() -> None:
    registry, lexicon = _people("registry"), dict(_pairs("lexicon", " means "))  # _people: each person's facts agree
    assert len(registry) > 500 and len(lexicon) > 1000  # populations of 800 people and 2,000 words
    assert not registry.keys() & (_people("facts").keys() | _people("gazette").keys() | lexicon.keys())
    assert all(meaning == lexicon[word] for word, meaning in _pairs("lexicon", " means "))
    hearsay, babble = _pairs("hearsay", " lives in "), _pairs("babble", " means ")
    shared = sum(name in registry for name, _ in hearsay), sum(word in lexicon for word, _ in babble)
    assert shared[0] > 0.5 * len(hearsay) and shared[1] > 0.5 * len(babble)  # the same people and words
    for form, truth in ((hearsay, registry), (babble, lexicon)):  # the same subjects, their facts drawn at random
        known = [(subject, rest) for subject, rest in form if subject in truth]
        assert sum(rest == truth[subject] for subject, rest in known) < 0.2 * len(known)
    line = generate("lexicon", 1, 0)[0].splitlines()[0]
    assert re.fullmatch(r"[a-z]{6} means [a-z]+\.", line), line


def test_domains_are_distinguishable_by_byte_statistics() -> None:
    def profile(domain: str, seed: int) -> torch.Tensor:
        counts = torch.zeros(256)
        for doc in generate(domain, 200, seed):
            counts += torch.bincount(torch.tensor(list(doc.encode())), minlength=256).float()
        return counts / counts.sum()

    profiles = {d: profile(d, 0) for d in ("arithmetic", "code", "prose")}
    for domain in profiles:
        fresh = profile(domain, 1)
        nearest = min(profiles, key=lambda d: float((profiles[d] - fresh).abs().sum()))
        assert nearest == domain
    digits = sum(profiles["arithmetic"][ord(c)] for c in "0123456789")
    assert digits > 0.5 > sum(profiles["prose"][ord(c)] for c in "0123456789")
