"""The learning benchmark's tasks: what each setting learns, each miner's own documents, and the network's files.

A setting is a list of sub-domains of `training.corpus`. "registry" (the town, trade and age of 800 people) and
"lexicon" (the meaning of 2,000 invented words) are facts: a miner learns those its documents hold, so what the
network can learn is limited by how much data its miners hold, not by how many steps they take. "mixed" is
heterogeneous: miner i holds documents of sub-domain i mod 4 only (registry, lexicon, arithmetic, records), while
the validators' held-out data and the report set hold each alike. Every miner holds its own file of `miner_docs`
documents, drawn for its index and the seed and shared with no other miner or held-out set, as a real miner holds
its own data (the node's `[miner] data`); a network of M miners has miners 0..M-1, so 8 miners hold 4 miners' data
and 4 files more. Every setting starts from one base (`training.pretrain.forms_base`) that read the form of all four
sub-domains with the facts and results drawn at random, so its loss starts below a uniform guess and tuning teaches
the facts and rules alone.

`write_network` writes a setting and seed's network into a directory as `tessera spec new` would, with the spec's
defaults and then `--set`: spec.toml, the base, the miners' files and their pool (the spec's training file, on
which the expert group is selected), the validators' held-out file and the general-domain file, and beside them the
report sets the spec does not name (data/report.jsonl, data/general-report.jsonl). This module knows nothing about
rounds, training or statistics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.pretrain import PretrainConfig

SETTINGS: dict[str, tuple[str, ...]] = {"registry": ("registry",), "lexicon": ("lexicon",),
                                        "mixed": ("registry", "lexicon", "arithmetic", "records")}
"""Each setting's sub-domains: miner i holds documents of the (i mod n)-th; held-out data holds each alike."""
DATA_LIMITED = ("registry", "lexicon")
"""The settings whose facts one miner's data cannot all hold."""
VALIDATORS = 2
"""Validators in every spec: the spec's default replication (2) then has each miner scored by two."""
SEQ_LEN = 64
SELECTION_SEQUENCES = 64
GENESIS = datetime(2026, 1, 1, tzinfo=UTC)
"""A fixed genesis, so that the same arguments write the same spec (its network id names blobs)."""
HELDOUT_SEED, GENERAL_SEED, GENERAL_REPORT_SEED = 12, 13, 14
"""Seeds of the held-out documents (the validators' and the report set) and of the general-domain files."""


@dataclass(frozen=True)
class Size:
    """How much data each miner and the held-out sets hold, and (unless given) which runs there are."""

    miner_docs: int
    """Documents in each miner's own file."""
    heldout_docs: int
    """The validators' held-out documents."""
    report_docs: int
    """The report set's documents, held out from everyone."""
    general_docs: int
    """General-domain documents per general domain in the validators' file, and again in the general report set."""
    settings: tuple[str, ...]
    networks: tuple[tuple[int, int], ...]
    """(miners, adversaries) of each network."""
    seeds: tuple[int, ...]
    rounds: int
    dp_lr_scales: tuple[float, ...]
    """The data-parallel ceiling's learning rates, as multiples of the miners' (`training.lr`)."""
    quick_base: bool
    """A base trained for 30 steps on little data instead of the full pretraining."""
    spec_settings: tuple[tuple[str, Any], ...] = ()
    """Spec settings written before `--set`'s."""


FULL = Size(miner_docs=100, heldout_docs=400, report_docs=240, general_docs=100, settings=tuple(SETTINGS),
            networks=((1, 0), (4, 0), (8, 0)), seeds=(0, 1, 2), rounds=4, dp_lr_scales=(1.0, 2.0, 4.0),
            quick_base=False)
SMALL = Size(miner_docs=12, heldout_docs=24, report_docs=8, general_docs=8, settings=("lexicon",),
             networks=((1, 0), (4, 0), (2, 1)), seeds=(0,), rounds=2, dp_lr_scales=(1.0, 2.0), quick_base=True,
             spec_settings=(("training.inner_steps", 2), ("data.heldout_sequences", 16), ("data.gate_sequences", 16)))
"""Seconds on a CPU, for the test suite: a base trained for 30 steps, small files, 2 rounds of H = 2, 16 scored and
16 gate rows."""


def base_config(size: Size) -> PretrainConfig:
    """The pretrained base every setting is tuned from."""
    from training.pretrain import forms_base

    cfg = forms_base(SETTINGS["mixed"])
    return replace(cfg, steps=30, batch_size=4, docs_per_domain=40) if size.quick_base else cfg


def identity(role: str, index: int, seed: int = 0) -> Any:
    """The key of `role` `index` under `seed` (validators use seed 0, so every seed runs the same validators)."""
    from protocol.identity import Identity

    return Identity.from_seed(hashlib.sha256(f"tessera-learning:{seed}:{role}:{index}".encode()).digest())


def mixed(setting: str, n_docs: int, seed: int) -> list[str]:
    """`n_docs` documents of `setting`, as many of each sub-domain, interleaved (so any prefix holds each alike)."""
    from training.corpus import generate

    subs = SETTINGS[setting]
    per = [generate(sub, max(1, n_docs // len(subs)), seed) for sub in subs]
    return [doc for row in zip(*per, strict=True) for doc in row]


def miner_documents(setting: str, index: int, seed: int, size: Size) -> list[str]:
    """Miner `index`'s own documents under `seed`: its sub-domain's, drawn for it alone."""
    from training.corpus import generate

    subs = SETTINGS[setting]
    return generate(subs[index % len(subs)], size.miner_docs, 1000 * (seed + 1) + index)


def write_network(directory: Path, setting: str, seed: int, miners: int, size: Size, cache: Path,
                  settings: list[tuple[str, Any]]) -> Path:
    """Write `setting`'s network for `seed` with the files of `miners` miners into `directory` (module doc); the
    spec's path. Miner i's file is data/miner-{i}.jsonl."""
    import torch

    from node.sim.layout import DEFAULT_TIMING, to_toml
    from protocol.spec import apply_settings
    from training.adapters import adapter_for
    from training.checkpoint import checkpoint_hash, config_hash, read_config
    from training.corpus import generate, write_documents
    from training.data import check_disjoint, file_sha256, pack
    from training.model import load_checkpoint
    from training.pretrain import GENERAL_DOMAINS, pretrained_base
    from training.selection import select_experts
    from training.tokenizer import ByteTokenizer

    base = pretrained_base(cache, base_config(size))
    (directory / "base").symlink_to(base, target_is_directory=True)
    data = directory / "data"
    own = [miner_documents(setting, i, seed, size) for i in range(miners)]
    pool = [doc for row in zip(*own, strict=True) for doc in row]
    held = mixed(setting, size.heldout_docs + size.report_docs, HELDOUT_SEED)
    check_disjoint(pool, held)  # as `spec new`: validators refuse held-out data the miners train on
    for i, docs in enumerate(own):
        write_documents(data / f"miner-{i}.jsonl", docs)
    write_documents(data / "train.jsonl", pool)
    report = len(held) * size.report_docs // (size.heldout_docs + size.report_docs)
    write_documents(data / "heldout.jsonl", held[report:])
    write_documents(data / "report.jsonl", held[:report])
    for name, general_seed in (("general.jsonl", GENERAL_SEED), ("general-report.jsonl", GENERAL_REPORT_SEED)):
        write_documents(data / name, [doc for d in GENERAL_DOMAINS for doc in generate(d, size.general_docs, general_seed)])
    model = load_checkpoint(base, dtype=torch.float32, attn_implementation="eager")
    adapter = adapter_for(model.config.model_type)
    sequences = pack(pool, ByteTokenizer(), SEQ_LEN)[:SELECTION_SEQUENCES]
    group = select_experts(model, adapter, sequences, "gate-mass", top_d=2)["group"]
    spec: dict[str, Any] = {
        "name": f"learning-{setting}",
        "genesis": GENESIS,
        "timing": dict(DEFAULT_TIMING),
        "model": {"family": adapter.family, "checkpoint": "base", "base_hash": checkpoint_hash(base),
                  "config_sha256": config_hash(read_config(base))},
        "group": {str(layer): experts for layer, experts in sorted(group.items())},
        "data": {"train": ["data/train.jsonl"], "heldout_sha256": file_sha256(data / "heldout.jsonl"),
                 "general_sha256": file_sha256(data / "general.jsonl"), "tokenizer": "byte", "seq_len": SEQ_LEN},
        "validators": [{"key": identity("validator", v).node_id, "weight": 1.0} for v in range(VALIDATORS)],
    }
    apply_settings(spec, settings)
    path = directory / "spec.toml"
    path.write_text(to_toml(spec), encoding="utf-8")
    return path
