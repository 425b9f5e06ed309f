"""The pretrained tiny base: deterministic, cached by its settings, and it actually learned the general corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import training.corpus as corpus_module
import training.pretrain as pretrain_module
import training.tiny as tiny_module
from training.data import pack
from training.evaluate import heldout_loss
from training.model import state_hash
from training.pretrain import (
    GENERAL_DOMAINS,
    TARGET_DOMAINS,
    PretrainConfig,
    base_config,
    forms_base,
    general_corpus,
    load_pretrained,
    pretrain,
    pretrained_base,
)
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer

QUICK = PretrainConfig(steps=30, batch_size=4, docs_per_domain=40)


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """QUICK's base in a cache of its own, trained once for the module, at the suite's thread count."""
    return pretrained_base(tmp_path_factory.mktemp("pretrained"), QUICK)


def test_pretraining_is_deterministic_and_lowers_general_loss(cached: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a caller with another thread count than the module's cached base had
    try:
        trained = pretrain(QUICK)
        assert torch.get_num_threads() == threads + 1  # the steps ran at one thread; the caller's count is back
    finally:
        torch.set_num_threads(threads)
    assert state_hash(trained) == state_hash(load_pretrained(cached.parent, QUICK))  # trained twice: same bytes
    untrained = build_tiny_model(QUICK.family, tiny_config(QUICK.family), seed=QUICK.seed)
    sequences = pack(general_corpus(QUICK), ByteTokenizer(), QUICK.seq_len)[:16]
    assert heldout_loss(trained, sequences).loss < heldout_loss(untrained, sequences).loss - 1.0


def test_the_cache_is_keyed_by_the_settings_and_reused(cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, path = cached.parent, cached
    assert (path / "config.json").is_file()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary directory left behind

    def refuse(cfg: PretrainConfig) -> None:
        raise AssertionError("a cached base was trained again")

    monkeypatch.setattr(pretrain_module, "pretrain", refuse)
    assert pretrained_base(cache, QUICK) == path
    assert PretrainConfig(steps=31, batch_size=4, docs_per_domain=40).key() != QUICK.key()
    assert PretrainConfig(family="mixtral").key() != PretrainConfig().key()


def test_a_base_trained_on_another_tiny_config_or_corpus_is_not_reused(
    cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(cached.parent, tmp_path, dirs_exist_ok=True)  # the module's cache stays as the others read it
    path, key = pretrained_base(tmp_path, QUICK), QUICK.key()
    with monkeypatch.context() as patch:  # training.tiny's tiny config changed: smaller experts
        patch.setitem(tiny_module._TINY, QUICK.family, {**tiny_config(QUICK.family), "moe_intermediate_size": 16})
        assert QUICK.key() != key
        smaller = pretrained_base(tmp_path, QUICK)
        assert smaller != path and json.loads((smaller / "config.json").read_text())["moe_intermediate_size"] == 16
    with monkeypatch.context() as patch:  # training.corpus's prose changed
        patch.setitem(corpus_module._GENERATORS, "prose", lambda rng: f"a different sentence {rng.randint(0, 9)}.")
        assert QUICK.key() != key
    with monkeypatch.context() as patch:  # training.tiny's init rule changed
        patch.setattr(pretrain_module, "INIT_RULE", "tessera-init/1")
        assert QUICK.key() != key
    assert QUICK.key() == key and pretrained_base(tmp_path, QUICK) == path


def test_each_target_domain_has_a_base_that_never_saw_it() -> None:
    for domain in TARGET_DOMAINS:
        for knows_form in (None, False, True):
            assert domain not in base_config(domain, knows_form).domains
    assert base_config("facts").domains == (*GENERAL_DOMAINS, "gazette")  # the sentence form, other people
    assert base_config("arithmetic") == base_config("records") == PretrainConfig()
    assert base_config("arithmetic", knows_form=True).domains == (*GENERAL_DOMAINS, "tallies")
    assert base_config("records", knows_form=True).domains == (*GENERAL_DOMAINS, "ledgers")
    assert base_config("facts", knows_form=False) == PretrainConfig()
    assert base_config("registry").domains == (*GENERAL_DOMAINS, "hearsay")  # registry's people, random facts
    assert base_config("lexicon").domains == (*GENERAL_DOMAINS, "babble")  # lexicon's words, random meanings
    assert forms_base(("registry", "arithmetic")).domains == (*GENERAL_DOMAINS, "hearsay", "tallies")
    with pytest.raises(ValueError, match="unknown target domain 'code'"):
        forms_base(("registry", "code"))
    with pytest.raises(ValueError, match="unknown target domain 'prose'"):
        base_config("prose")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"steps": 0}, "positive"), ({"lr": 0.0}, "lr"), ({"domains": ("poetry",)}, "subset"), ({"domains": ()}, "subset")],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PretrainConfig(**kwargs)  # type: ignore[arg-type]
