"""Learning benchmark: how far a network of M miners lowers held-out loss round by round, against one node.

For each domain, seed, number of miners M and H (`--inner-steps`) it writes a network as `tessera spec
new` would, with the spec's defaults, H and then `--set`, on the pretrained tiny base
(`training.pretrain`; a target domain the base never saw, facts from a base that read their form) and
the domain's training and held-out files. Then it runs `--rounds` rounds in one process, all through
the product's code: the validators' seeds give the round seed (`protocol.seeds`), and every miner trains
from the adopted state and builds its blob with the honest builder (`miner.submission.build_submission`).
Each validator scores the miners assigned to it (`protocol.assignment`) with `validator.scoring.Scorer`,
by Proof-of-Loss on the held-out subset the round seed picks. `validator.merge.merge_round` ranks the
reports, rewards and merges them into the next state (`training.state.GlobalExperts.child`). This
file has no round logic of its own: it changes only the inputs.
Reported per run, on held-out documents the validators never score (the report set): the base's loss,
the adopted state's after every round (`adopted_losses`: the average of the merged states where the
spec keeps one), the best single submission's in that round (`best_single_losses`, None when none was
accepted) and how many were merged. `baselines` holds single-node expert tuning (ESFT) at equal tokens:
the miners' own training code on the same batches in the same order, as one AdamW run from the base,
read after each round's worth of tokens.
Usage: python bench/learning.py [--domain D,...] [--miners M,...] [--rounds R] [--inner-steps H,...]
       [--seeds S,...] [--keep-optimizer] [--set SECTION.FIELD=VALUE]... [--small] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from miner.model import MinerModel, MinerSettings  # noqa: E402
from miner.optimizer import InnerOptimizer  # noqa: E402
from miner.submission import Diverged, ErrorFeedback, build_submission  # noqa: E402
from node.cli.common import add_spec_settings, comma_list  # noqa: E402
from node.sim.layout import DEFAULT_TIMING, default_cache_dir, to_toml  # noqa: E402
from protocol.assignment import assign  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.seeds import commitment, round_seed  # noqa: E402
from protocol.spec import NetworkSpec, apply_settings, judge_settings, load_spec  # noqa: E402
from training.adapters import adapter_for  # noqa: E402
from training.blob import blob_hash  # noqa: E402
from training.checkpoint import checkpoint_hash, config_hash, read_config  # noqa: E402
from training.corpus import generate, write_documents  # noqa: E402
from training.data import check_disjoint, file_sha256, load_sequences, pack  # noqa: E402
from training.evaluate import loss_with_experts  # noqa: E402
from training.experts import extract  # noqa: E402
from training.model import load_base, load_checkpoint  # noqa: E402
from training.pretrain import TARGET_DOMAINS, PretrainConfig, base_config, pretrained_base  # noqa: E402
from training.selection import select_experts  # noqa: E402
from training.state import GlobalExperts  # noqa: E402
from training.tokenizer import ByteTokenizer  # noqa: E402
from validator.merge import MergeResult, merge_round  # noqa: E402
from validator.scoring import Scorer  # noqa: E402

VALIDATORS = 2
"""Validators in every spec: the spec's default replication (2) then has each miner scored by two."""
SEQ_LEN = 64
SELECTION_SEQUENCES = 64
GENESIS = datetime(2026, 1, 1, tzinfo=UTC)
"""A fixed genesis, so that the same arguments write the same spec (its network id names blobs)."""
MINER = MinerSettings()
"""How every miner trains: on the CPU, the full model (the node's `[miner]` defaults)."""


@dataclass(frozen=True)
class Size:
    """How large the base, the data and (unless given) the runs are."""

    train_docs: int
    heldout_docs: int
    report_docs: int
    """The held-out documents kept for the report set; the validators' file holds the rest."""
    miners: tuple[int, ...]
    rounds: int
    inner_steps: tuple[int, ...]
    base: Callable[[str], PretrainConfig]
    """The pretrained base a domain is tuned from."""


def quick_base(domain: str) -> PretrainConfig:
    """The domain's base (`training.pretrain.base_config`) trained for 30 steps on little data."""
    return replace(base_config(domain), steps=30, batch_size=4, docs_per_domain=40)


FULL = Size(train_docs=3000, heldout_docs=600, report_docs=200, miners=(4,), rounds=5, inner_steps=(20,),
            base=base_config)
SMALL = Size(train_docs=200, heldout_docs=60, report_docs=20, miners=(2,), rounds=2, inner_steps=(2,),
             base=quick_base)
"""A few seconds on a CPU, for the test suite: a base trained for 30 steps, small data, 2 miners, 2 rounds of 2 steps."""


def identity(role: str, index: int, seed: int = 0) -> Identity:
    """The key of `role` `index` under `seed` (validators use seed 0, so every seed runs the same spec)."""
    return Identity.from_seed(hashlib.sha256(f"tessera-learning:{seed}:{role}:{index}".encode()).digest())


def write_network(directory: Path, domain: str, inner_steps: int, size: Size, cache: Path,
                  settings: list[tuple[str, Any]]) -> Path:
    """Write a network of `domain` into `directory` (spec.toml, base/, data/) as `tessera spec new` would;
    the spec path. The report set goes to data/report.jsonl, which the spec does not name."""
    base = pretrained_base(cache, size.base(domain))
    (directory / "base").symlink_to(base, target_is_directory=True)
    train = generate(domain, size.train_docs, 11)
    held = generate(domain, size.heldout_docs, 12)
    check_disjoint(train, held)  # as `spec new`: validators refuse held-out data the miners train on
    data = directory / "data"
    write_documents(data / "train.jsonl", train)
    write_documents(data / "heldout.jsonl", held[size.report_docs:])
    write_documents(data / "report.jsonl", held[: size.report_docs])
    model = load_checkpoint(base, dtype=torch.float32, attn_implementation="eager")
    adapter = adapter_for(model.config.model_type)
    sequences = pack(train, ByteTokenizer(), SEQ_LEN)[:SELECTION_SEQUENCES]
    group = select_experts(model, adapter, sequences, "gate-mass", top_d=2)["group"]
    spec: dict[str, Any] = {
        "name": f"learning-{domain}",
        "genesis": GENESIS,
        "timing": dict(DEFAULT_TIMING),
        "model": {"family": adapter.family, "checkpoint": "base", "base_hash": checkpoint_hash(base),
                  "config_sha256": config_hash(read_config(base))},
        "group": {str(layer): experts for layer, experts in sorted(group.items())},
        "data": {"train": ["data/train.jsonl"], "heldout_sha256": file_sha256(data / "heldout.jsonl"),
                 "tokenizer": "byte", "seq_len": SEQ_LEN},
        "validators": [{"key": identity("validator", v).node_id, "weight": 1.0} for v in range(VALIDATORS)],
    }
    apply_settings(spec, [("training.inner_steps", inner_steps), *settings])
    path = directory / "spec.toml"
    path.write_text(to_toml(spec), encoding="utf-8")
    return path


class Network:
    """What one spec's runs load once: the miners' model and data, the validators' scorer and the report set."""

    def __init__(self, spec_path: Path) -> None:
        self.spec: NetworkSpec = load_spec(spec_path)
        self.miners = MinerModel.load(self.spec, spec_path)
        model, adapter = load_base(self.spec, spec_path, attn_implementation="eager")
        data = spec_path.parent / "data"
        tokenizer = ByteTokenizer()
        heldout = load_sequences([data / "heldout.jsonl"], tokenizer, self.spec.data.seq_len)
        self.report = load_sequences([data / "report.jsonl"], tokenizer, self.spec.data.seq_len)
        self.scorer = Scorer(model, adapter, self.spec, heldout, tokenizer.pad_id)
        self.genesis = GlobalExperts.genesis(self.spec, extract(model, adapter, self.spec.group))

    def loss(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """Loss on the report set of the base holding `tensors` (the scorer's model keeps its experts)."""
        s = self.scorer
        return round(loss_with_experts(s.model, s.adapter, tensors, self.report, s.batch_size, str(s.device),
                                       s.pad_id).loss, 4)

    def run(self, miners: int, rounds: int, seed: int, keep_optimizer: bool) -> dict[str, Any]:
        """`rounds` rounds of `miners` honest miners from genesis; the losses after each."""
        ids = [identity("miner", i, seed).node_id for i in range(miners)]
        pgrad = self.spec.submission.format == "pgrad"
        feedback = {m: ErrorFeedback() if pgrad else None for m in ids}
        optimizers = {m: InnerOptimizer() if keep_optimizer else None for m in ids}
        state = self.genesis
        adopted, best, merged = [], [], []
        for r in range(rounds):
            blobs: dict[str, bytes] = {}
            for m in ids:
                try:
                    blobs[m], _ = build_submission(self.miners, m, r, state.hash, state.tensors, MINER,
                                                   feedback=feedback[m], optimizer=optimizers[m])
                except Diverged as exc:
                    print(f"round {r}: miner {m[:8]}: {exc}", file=sys.stderr)
            result, accepted = self.merge(r, seed, state, blobs)
            if result.changed or state.average is not None:  # as the validator duty: an average moves every round
                state = state.child(r, result.new_global, result.new_momentum)
            adopted.append(self.loss(state.offered))
            best.append(min((self.loss(t) for t in accepted.values()), default=None))
            merged.append(len(result.contributors))
        return {"base_loss": self.loss(self.genesis.offered), "adopted_losses": adopted,
                "best_single_losses": best, "merged": merged}

    def merge(self, round: int, seed: int, state: GlobalExperts,
              blobs: Mapping[str, bytes]) -> tuple[MergeResult, dict[str, dict[str, torch.Tensor]]]:
        """The validators' part of `round`: the round seed from their seeds, each scoring the miners assigned to
        it, then `merge_round` on their reports; its result and the accepted submissions' experts."""
        validators = [identity("validator", v).node_id for v in range(VALIDATORS)]
        seeds = {v: hashlib.sha256(f"tessera-learning:{seed}:{round}:{v}".encode()).hexdigest() for v in validators}
        seed_r = round_seed({v: commitment(s) for v, s in seeds.items()}, seeds)
        revealed = {m: blob_hash(data) for m, data in blobs.items()}
        assignment = assign(seed_r, revealed, validators, self.spec.rewards.replication)
        reports, accepted = {}, {}
        for v in validators:
            mine = {m: (revealed[m], blobs[m]) for m, chosen in assignment.items() if v in chosen}
            scored = self.scorer.score_round(round, seed_r, state.tensors, state.hash, mine)
            reports[v] = scored.report(round, state.hash)
            accepted.update(scored.accepted)
        result = merge_round(reports, assignment, revealed, accepted, dict(state.tensors), dict(state.momentum),
                             self.spec, state.hash)
        return result, accepted

    def esft(self, miners: int, rounds: int, seed: int) -> list[float]:
        """One node tuning the group on every miner's batches of every round in turn, one AdamW run throughout;
        its loss after each round's `miners` x H steps."""
        ids = [identity("miner", i, seed).node_id for i in range(miners)]
        tensors: Mapping[str, torch.Tensor] = self.genesis.tensors
        optimizer: dict[str, Any] | None = None
        losses = []
        for r in range(rounds):
            for m in ids:
                result = self.miners.train(m, r, tensors, MINER, lambda: True, optimizer_state=optimizer)
                tensors, optimizer = result.tensors, result.optimizer_state
            losses.append(self.loss(tensors))
        return losses


def integers(least: int) -> Callable[[str], tuple[int, ...]]:
    """argparse's type for a comma-separated list of integers of at least `least` (`--miners 1,4,8`)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(item) for item in comma_list(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"expected integers of at least {least}, got {text!r}")
        return values

    return parse


def domains(text: str) -> tuple[str, ...]:
    """argparse's type for `--domain arithmetic,facts`: target domains of `training.pretrain`."""
    chosen = comma_list(text)
    unknown = [d for d in chosen if d not in TARGET_DOMAINS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"expected domains from {', '.join(TARGET_DOMAINS)}, got {text!r}")
    return chosen


def progress(run: dict[str, Any], baseline: dict[str, Any], started: float) -> None:
    """One line on stderr per run: who, the adopted state's losses and ESFT's."""
    print(f"{run['domain']} seed {run['seed']} M={run['miners']} H={run['inner_steps']}: adopted "
          f"{run['adopted_losses']}, ESFT {baseline['esft_losses']} ({time.perf_counter() - started:.0f} s)",
          file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--domain", type=domains, default=("arithmetic",),
                        help=f"target domains, comma-separated: {', '.join(TARGET_DOMAINS)} (default arithmetic)")
    parser.add_argument("--miners", type=integers(1), help="miners per network, comma-separated (default 4)")
    parser.add_argument("--rounds", type=int, help="rounds per run (default 5)")
    parser.add_argument("--inner-steps", type=integers(1), help="H, written into the spec, comma-separated (default 20)")
    parser.add_argument("--seeds", type=integers(0), default=(0,),
                        help="seeds of the miners' ids (their shards and batches) and of the round seeds (default 0)")
    parser.add_argument("--keep-optimizer", action="store_true",
                        help="miners keep their AdamW state between rounds, as `[miner] keep_optimizer` does")
    add_spec_settings(parser, "the spec's defaults and --inner-steps")
    parser.add_argument("--small", action="store_true",
                        help="a base trained for 30 steps, little data, and unless given 2 miners, 2 rounds of H = 2")
    parser.add_argument("--cache", type=Path, default=default_cache_dir(), help="pretrained-base cache directory")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args()
    size = SMALL if args.small else FULL
    miners, inner_steps = args.miners or size.miners, args.inner_steps or size.inner_steps
    rounds = size.rounds if args.rounds is None else args.rounds
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        overrides = {f"{section}.{field}": value
                     for section, values in judge_settings(args.spec_settings).items() for field, value in values.items()}
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    if "training.inner_steps" in overrides:
        parser.error("--set training.inner_steps: give H as --inner-steps")
    torch.set_num_threads(1)  # a tiny model on a shared CPU runs faster without intra-op threads
    started = time.perf_counter()
    runs, baselines = [], []
    for domain in args.domain:
        for h in inner_steps:
            with tempfile.TemporaryDirectory(prefix="tessera-learning-") as tmp:
                network = Network(write_network(Path(tmp), domain, h, size, args.cache, args.spec_settings))
                for seed in args.seeds:
                    for m in miners:
                        key = {"domain": domain, "seed": seed, "miners": m, "inner_steps": h}
                        runs.append({**key, **network.run(m, rounds, seed, args.keep_optimizer)})
                        baselines.append({**key, "esft_losses": network.esft(m, rounds, seed)})
                        progress(runs[-1], baselines[-1], started)
    emit({"seconds": round(time.perf_counter() - started, 1), "spec_overrides": overrides,
          "keep_optimizer": args.keep_optimizer, "rounds": rounds, "small": args.small,
          "runs": runs, "baselines": baselines}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
