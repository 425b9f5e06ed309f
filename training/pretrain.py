"""A pretrained tiny base: a tiny MoE trained briefly on a general corpus, cached on disk by its settings.

A randomly initialised tiny model is a poor base for measuring learning: expert-only tuning of it
plateaus within a few dozen steps, because attention and the router know nothing yet. `pretrain`
trains every weight of a tiny model for a few hundred AdamW steps on the general corpus (prose and
code from `training.corpus`), so the experts differ and the router routes; the target domains
(`TARGET_DOMAINS`) stay unseen, so expert-only tuning can still lower their held-out loss a lot. The
skills (arithmetic, records) are tuned from that base; the knowledge domains from one whose corpus
also holds their form (`base_config`): "gazette", the same sentences about other people, for facts;
"hearsay", registry's sentences about its own people with their town, trade and age drawn at random,
for registry; "babble", lexicon's words with random meanings, for lexicon. Tuning them is then
learning facts rather than a new form. `base_config(domain, knows_form=True)` gives the skills such a
base too: it also reads their forms with random results ("tallies", "ledgers"), so it is not
confidently wrong on their lines and tuning teaches only the rule; `forms_base` reads the forms of
several target domains at once. Everything is seeded (model init
from `seed`, batches from a local generator), so the same settings give the same weights on this
machine. The training runs at one intra-op thread (see `pretrain`), whatever the caller's thread count,
which it finds as it was when `pretrain` returns.

`pretrained_base(cache_dir, cfg)` returns an HF checkpoint directory (config.json + safetensors,
written with `save_pretrained`) named by a hash of the settings, training it only when it is not
there yet; `training.model.load_checkpoint` loads it. This module knows nothing about the network,
specs or expert groups.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from protocol.files import staged_directory
from training.corpus import DOMAINS, generate
from training.data import batches, not_padding, pack
from training.evaluate import token_loss_sum
from training.model import load_checkpoint
from training.tiny import INIT_RULE, build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer

GENERAL_DOMAINS = ("prose", "code")
TARGET_DOMAINS = ("arithmetic", "records", "facts", "registry", "lexicon")
FORMS = {"arithmetic": "tallies", "records": "ledgers", "facts": "gazette", "registry": "hearsay", "lexicon": "babble"}
"""Each target domain's form without its content (training.corpus): what a base that knows the form reads."""
KNOWLEDGE_DOMAINS = ("facts", "registry", "lexicon")
"""Target domains of facts to learn (the others are skills: a rule learned once)."""
_RECIPE = "tessera-pretrain/1"
"""Bump when the training recipe below changes (the tiny config and the corpus are in the key already)."""


@dataclass(frozen=True)
class PretrainConfig:
    """How the tiny base is made; every field is part of the cache key."""

    family: str = "qwen3_moe"
    """Transformers MoE family of the tiny model (`training.tiny.tiny_config`)."""
    seed: int = 0
    """Seeds the model init, the corpus and the batch order."""
    steps: int = 600
    """AdamW steps over all weights."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 64
    """Tokens per packed sequence."""
    lr: float = 3e-3
    """Peak learning rate; linear warm-up over 5% of the steps, cosine decay to 10% after."""
    docs_per_domain: int = 1500
    """Documents generated per general domain."""
    domains: tuple[str, ...] = GENERAL_DOMAINS
    """The general corpus's domains."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.docs_per_domain < 1:
            raise ValueError("pretrain steps, batch_size and docs_per_domain must be positive")
        if self.lr <= 0:
            raise ValueError(f"pretrain lr must be positive, got {self.lr}")
        unknown = set(self.domains) - set(DOMAINS)
        if not self.domains or unknown:
            raise ValueError(f"pretrain domains must be a non-empty subset of {', '.join(DOMAINS)}")

    def key(self) -> str:
        """16 hex digits of SHA-256 over the recipe tag, these settings, the family's tiny config, the init
        rule and the corpus itself: the cache entry's name, so a change to `training.tiny`'s tiny config or
        init rule or to `training.corpus`'s documents makes a new entry rather than reusing an old base."""
        corpus = hashlib.sha256(json.dumps(general_corpus(self)).encode("utf-8")).hexdigest()
        settings = json.dumps(
            {"recipe": _RECIPE, **asdict(self), "model": tiny_config(self.family), "init": INIT_RULE,
             "corpus": corpus},
            sort_keys=True,
        )
        return hashlib.sha256(settings.encode("utf-8")).hexdigest()[:16]


def base_config(target_domain: str, knows_form: bool | None = None) -> PretrainConfig:
    """The base a target domain is tuned from: the general corpus, plus the domain's form (`FORMS`) when
    `knows_form`; by default the knowledge domains' bases know their form and the skills' do not."""
    if target_domain not in TARGET_DOMAINS:
        raise ValueError(f"unknown target domain {target_domain!r}; choose one of {', '.join(TARGET_DOMAINS)}")
    if knows_form is None:
        knows_form = target_domain in KNOWLEDGE_DOMAINS
    return PretrainConfig(domains=(*GENERAL_DOMAINS, FORMS[target_domain])) if knows_form else PretrainConfig()


def forms_base(target_domains: tuple[str, ...]) -> PretrainConfig:
    """A base that read the general corpus and the form (`FORMS`) of each of `target_domains`, none of their content."""
    unknown = [domain for domain in target_domains if domain not in TARGET_DOMAINS]
    if unknown:
        raise ValueError(f"unknown target domain {unknown[0]!r}; choose from {', '.join(TARGET_DOMAINS)}")
    return PretrainConfig(domains=(*GENERAL_DOMAINS, *(FORMS[domain] for domain in target_domains)))


def general_corpus(cfg: PretrainConfig) -> list[str]:
    """The general documents the base is trained on, domain by domain, interleaved by position."""
    per_domain = [generate(domain, cfg.docs_per_domain, cfg.seed) for domain in cfg.domains]
    return [doc for row in zip(*per_domain, strict=True) for doc in row]


def pretrain(cfg: PretrainConfig) -> PreTrainedModel:
    """Train a freshly initialised tiny model on the general corpus; returns it in eval mode.

    The steps run at one intra-op thread, and the caller's thread count is restored afterwards: matrices
    this small gain nothing from more, and on a busy CPU their spinning makes each step several times
    slower (5-10x measured on 2 busy cores); one thread also makes the weights independent of the core
    count. The callers are a simulation's set-up, the benchmarks and the tests, never a running node, so
    no other thread runs torch meanwhile.
    """
    tokenizer = ByteTokenizer()
    sequences = pack(general_corpus(cfg), tokenizer, cfg.seq_len)
    model = build_tiny_model(cfg.family, tiny_config(cfg.family), seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stream = batches(sequences, cfg.batch_size, cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(cfg.steps):
            ids_BL = next(stream)
            tokens = int(not_padding(ids_BL, tokenizer.pad_id)[:, 1:].sum())
            loss = token_loss_sum(model, ids_BL, tokenizer.pad_id) / tokens
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()  # type: ignore[no-untyped-call, no-any-return]  # unannotated in transformers


def pretrained_base(cache_dir: str | Path, cfg: PretrainConfig | None = None) -> Path:
    """The checkpoint directory of the base `cfg` describes under `cache_dir`, trained on first use.

    The directory is written in full under a temporary name and then renamed, so a reader never
    sees a half-written checkpoint, and two processes racing to create it both end with one.
    """
    cfg = cfg or PretrainConfig()
    cache_dir = Path(cache_dir)
    target = cache_dir / f"{cfg.family}-{cfg.key()}"
    if (target / "config.json").is_file():
        return target
    try:
        with staged_directory(target) as staging:
            pretrain(cfg).save_pretrained(staging)
    except OSError:
        if not (target / "config.json").is_file():
            raise  # else another process put the same base there first
    return target


def load_pretrained(cache_dir: str | Path, cfg: PretrainConfig | None = None) -> PreTrainedModel:
    """The pretrained base as an fp32 model with eager attention (bit-exact on the CPU), in eval mode."""
    return load_checkpoint(pretrained_base(cache_dir, cfg), dtype=torch.float32, attn_implementation="eager")
