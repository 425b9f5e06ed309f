"""Learning benchmark: the network's adopted state round by round against one node and the data-parallel ceiling.

For each setting (a target domain, on a base that did or did not read the domain's form), seed and
network (M miners at H inner steps, A of them adversarial) it writes a network as `tessera spec new`
would, with the spec's defaults, H and then `--set`, on the pretrained tiny base (`training.pretrain`)
and the setting's training, held-out and general-domain held-out files. Then it runs `--rounds` rounds
through the product's code alone: the validators' seeds give the round seed (`protocol.seeds`); every
honest miner trains from the adopted state and builds its blob with the honest builder
(`miner.submission.build_submission`), an adversary with the simulation's noise strategy
(`node.sim.adversaries`); each validator scores the miners assigned to it (`protocol.assignment`) with
`validator.scoring.Scorer`; `validator.merge.merge_round` ranks, rewards and merges, and
`validator.merge.gate` weighs the current, merged and best-single states on the gate rows
(`validator.scoring.gate_measure`, with the forgetting budget on the general-domain file the spec pins).
This file has no round logic of its own: it changes only the inputs.
Read on held-out documents the validators never score (the report set), per run: `base_loss`,
`adopted_losses` (the state adopted at the end of each round), `best_single_losses` (the lowest single
accepted submission of the round), `gates` (the gate's verdict each round: the candidate adopted, every
candidate's gate and general-domain losses, those refused, and how many updates were merged and are in
the adopted state), `noise` (the mean over the run's states of half the gap between their losses on
the two halves of the report set: the sampling noise of one held-out subset) and `forgetting` (the rise of
the last adopted state's loss on a general-domain report set over the base's). `baselines`, per setting,
seed, H and M, from the same base and batches at the same tokens: single-node expert tuning (ESFT: the
miners' own training code over every miner's batches in turn, one AdamW run) and the data-parallel
ceiling (one AdamW run whose every step takes the M miners' batches of that step together), each read
after every round's tokens, and ESFT's forgetting. `summary` reads the issue's questions off them per run
(`summarise`): the rounds the adopted loss rose, whether it fell, the rounds it read above the best single
submission, its share of the ceiling's drop, 8 miners against 4 and forgetting against ESFT's.
Usage: python bench/learning.py [--domain S,...] [--networks M@H[/A],...] [--rounds R] [--seeds S,...]
       [--workers W] [--set SECTION.FIELD=VALUE]... [--small] [--cache DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from node.cli.common import add_spec_settings, comma_list  # noqa: E402
from protocol.spec import judge_settings  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from miner.model import MinerModel
    from protocol.spec import NetworkSpec
    from training.pretrain import PretrainConfig
    from training.state import GlobalExperts
    from validator.scoring import Scorer

SETTINGS = {"arithmetic": ("arithmetic", False), "records": ("records", False), "facts": ("facts", True),
            "arithmetic-form": ("arithmetic", True), "records-form": ("records", True)}
"""Each setting's target domain and whether its base read the domain's form (`training.pretrain.base_config`)."""
VALIDATORS = 2
"""Validators in every spec: the spec's default replication (2) then has each miner scored by two."""
SEQ_LEN = 64
SELECTION_SEQUENCES = 64
GENESIS = datetime(2026, 1, 1, tzinfo=UTC)
"""A fixed genesis, so that the same arguments write the same spec (its network id names blobs)."""


@dataclass(frozen=True)
class Net:
    """One network of a run: M miners, A of them adversarial, at H inner steps."""

    miners: int
    inner_steps: int
    adversaries: int = 0


@dataclass(frozen=True)
class Size:
    """How large the base, the data and (unless given) the runs are."""

    train_docs: int
    heldout_docs: int
    report_docs: int
    """The held-out documents kept for the report set; the validators' file holds the rest."""
    general_docs: int
    """General-domain documents per general domain in the validators' file, and again in the report set."""
    settings: tuple[str, ...]
    networks: tuple[Net, ...]
    seeds: tuple[int, ...]
    rounds: int
    quick_base: bool
    """A base trained for 30 steps on little data instead of the full pretraining."""


FULL = Size(train_docs=3000, heldout_docs=600, report_docs=200, general_docs=100, settings=tuple(SETTINGS),
            networks=(Net(1, 20), Net(4, 20), Net(8, 20), Net(4, 20, 2), Net(4, 50)), seeds=(0, 1, 2), rounds=3,
            quick_base=False)
SMALL = Size(train_docs=200, heldout_docs=200, report_docs=40, general_docs=20, settings=("arithmetic",),
             networks=(Net(2, 2), Net(2, 2, 1)), seeds=(0,), rounds=2, quick_base=True)
"""A few seconds on a CPU, for the test suite: a base trained for 30 steps, small data, 2 rounds of H = 2."""


def base_of(setting: str, size: Size) -> PretrainConfig:
    """The pretrained base a setting is tuned from."""
    from dataclasses import replace

    from training.pretrain import base_config

    domain, knows_form = SETTINGS[setting]
    cfg = base_config(domain, knows_form)
    return replace(cfg, steps=30, batch_size=4, docs_per_domain=40) if size.quick_base else cfg


def identity(role: str, index: int, seed: int = 0) -> Any:
    """The key of `role` `index` under `seed` (validators use seed 0, so every seed runs the same spec)."""
    from protocol.identity import Identity

    return Identity.from_seed(hashlib.sha256(f"tessera-learning:{seed}:{role}:{index}".encode()).digest())


def write_network(directory: Path, setting: str, inner_steps: int, size: Size, cache: Path,
                  settings: list[tuple[str, Any]]) -> Path:
    """Write a network of `setting` into `directory` (spec.toml, base/, data/) as `tessera spec new` would; the
    spec path. The report sets go to data/report.jsonl and data/general-report.jsonl, which the spec does not name."""
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

    base = pretrained_base(cache, base_of(setting, size))
    (directory / "base").symlink_to(base, target_is_directory=True)
    domain = SETTINGS[setting][0]
    train = generate(domain, size.train_docs, 11)
    held = generate(domain, size.heldout_docs, 12)
    check_disjoint(train, held)  # as `spec new`: validators refuse held-out data the miners train on
    data = directory / "data"
    write_documents(data / "train.jsonl", train)
    write_documents(data / "heldout.jsonl", held[size.report_docs:])
    write_documents(data / "report.jsonl", held[: size.report_docs])
    for name, seed in (("general.jsonl", 13), ("general-report.jsonl", 14)):  # the base read seed 0's documents
        write_documents(data / name, [doc for d in GENERAL_DOMAINS for doc in generate(d, size.general_docs, seed)])
    model = load_checkpoint(base, dtype=torch.float32, attn_implementation="eager")
    adapter = adapter_for(model.config.model_type)
    sequences = pack(train, ByteTokenizer(), SEQ_LEN)[:SELECTION_SEQUENCES]
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
    apply_settings(spec, [("training.inner_steps", inner_steps), *settings])
    path = directory / "spec.toml"
    path.write_text(to_toml(spec), encoding="utf-8")
    return path


class Network:
    """What one spec's runs load once: the miners' model and data, the validators' scorer and general-domain
    sequences, and the report sets."""

    def __init__(self, spec_path: Path) -> None:
        from miner.model import MinerModel, MinerSettings
        from protocol.spec import load_spec
        from training.data import load_sequences
        from training.experts import extract
        from training.model import load_base
        from training.state import GlobalExperts
        from training.tokenizer import ByteTokenizer
        from validator.scoring import Scorer

        self.spec: NetworkSpec = load_spec(spec_path)
        self.blobs = spec_path.parent / "blobs"  # the revealed blobs, where a validator's store keeps them
        self.blobs.mkdir(exist_ok=True)
        self.miners: MinerModel = MinerModel.load(self.spec, spec_path)
        self.settings = MinerSettings()  # the node's `[miner]` defaults: the CPU, the full model
        model, adapter = load_base(self.spec, spec_path, attn_implementation="eager")
        data, tokenizer = spec_path.parent / "data", ByteTokenizer()

        def sequences(name: str) -> torch.Tensor:
            return load_sequences([data / name], tokenizer, self.spec.data.seq_len)

        self.scorer: Scorer = Scorer(model, adapter, self.spec, sequences("heldout.jsonl"), tokenizer.pad_id)
        self.general, self.report, self.general_report = (sequences(name) for name in (
            "general.jsonl", "report.jsonl", "general-report.jsonl"))
        self.genesis: GlobalExperts = GlobalExperts.genesis(self.spec, extract(model, adapter, self.spec.group))

    def loss(self, tensors: Mapping[str, torch.Tensor], sequences: torch.Tensor | None = None) -> float:
        """Loss on the report set (or `sequences`) of the base holding `tensors` (the scorer's model keeps its experts)."""
        from training.evaluate import loss_with_experts

        s = self.scorer
        rows = self.report if sequences is None else sequences
        return round(loss_with_experts(s.model, s.adapter, tensors, rows, s.batch_size, str(s.device), s.pad_id).loss, 4)

    def noise(self, tensors: Mapping[str, torch.Tensor]) -> float:
        """Half the gap between the losses of `tensors` on the two halves of the report set."""
        half = self.report.shape[0] // 2
        return abs(self.loss(tensors, self.report[:half]) - self.loss(tensors, self.report[half:])) / 2

    def run(self, net: Net, rounds: int, seed: int) -> dict[str, Any]:
        """`rounds` rounds of `net` from genesis: the losses after each, the gate's picks, the noise, the forgetting."""
        from miner.submission import Diverged, ErrorFeedback, build_submission

        ids = [identity("miner", i, seed).node_id for i in range(net.miners)]
        adversaries = set(ids[net.miners - net.adversaries:])
        feedback = {m: ErrorFeedback() if self.spec.submission.format == "pgrad" else None for m in ids}
        state = self.genesis
        adopted, best, picks, noise = [], [], [], [self.noise(state.tensors)]
        for r in range(rounds):
            blobs: dict[str, bytes] = {}
            for m in ids:
                try:
                    blobs[m] = self.adversary(m, r, state) if m in adversaries else build_submission(
                        self.miners, m, r, state.hash, state.tensors, self.settings, feedback=feedback[m])[0]
                except Diverged as exc:
                    print(f"round {r}: miner {m[:8]}: {exc}", file=sys.stderr)
            state, pick, accepted = self.round(r, seed, state, blobs)
            adopted.append(self.loss(state.tensors))
            best.append(min((self.loss(t) for t in accepted.values()), default=None))
            picks.append(pick)
            noise.append(self.noise(state.tensors))
        base_general = self.loss(self.genesis.tensors, self.general_report)
        return {"base_loss": self.loss(self.genesis.tensors), "adopted_losses": adopted, "best_single_losses": best,
                "gates": picks, "noise": round(sum(noise) / len(noise), 4),
                "forgetting": round(self.loss(state.tensors, self.general_report) - base_general, 4)}

    def adversary(self, miner: str, round: int, state: GlobalExperts) -> bytes:
        """The simulation's noise adversary's blob (`node.sim.adversaries.Noise`)."""
        from node.duties.miner import Job
        from node.runtime.metrics import NodeMetrics
        from node.sim.adversaries import Noise

        job = Job(self.miners, miner, round, state.hash, state, self.settings, lambda: True, NodeMetrics())
        return Noise().build(job)

    def round(self, round: int, seed: int, state: GlobalExperts,
              blobs: Mapping[str, bytes]) -> tuple[GlobalExperts, dict[str, Any], dict[str, Mapping[str, torch.Tensor]]]:
        """The validators' part of `round`: the round seed from their seeds, each scoring the miners assigned to
        it, `merge_round` on their reports and the gate; the state adopted, the gate's verdict (as a round
        report shows it, with the number of updates merged and adopted) and the accepted submissions' experts."""
        from protocol.assignment import assign
        from protocol.seeds import commitment, round_seed
        from training.blob import blob_hash
        from validator.merge import gate, merge_round
        from validator.scoring import gate_measure

        validators = [identity("validator", v).node_id for v in range(VALIDATORS)]
        seeds = {v: hashlib.sha256(f"tessera-learning:{seed}:{round}:{v}".encode()).hexdigest() for v in validators}
        seed_r = round_seed({v: commitment(s) for v, s in seeds.items()}, seeds)
        revealed = {m: blob_hash(data) for m, data in blobs.items()}
        for m, data in blobs.items():
            (self.blobs / revealed[m]).write_bytes(data)
        assignment = assign(seed_r, revealed, validators, self.spec.rewards.replication)
        reports, accepted = {}, {}
        for v in validators:
            mine = {m: (revealed[m], self.blobs / revealed[m]) for m, chosen in assignment.items() if v in chosen}
            scored = self.scorer.score_round(round, seed_r, state.tensors, state.hash, mine)
            reports[v] = scored.report(round, state.hash)
            accepted.update(scored.accepted)
        tensors, momentum = dict(state.tensors), dict(state.momentum)
        result = merge_round(reports, assignment, revealed, accepted, tensors, momentum, self.spec, state.hash)
        adoption = gate(result, accepted, tensors, momentum, self.spec, gate_measure(self.scorer, seed_r, self.general))
        if adoption.changed:
            state = state.child(round, adoption.new_global, adoption.new_momentum)
        verdict = {**adoption.report(), "merged": len(result.contributors), "in_adopted": len(adoption.contributors)}
        return state, verdict, accepted

    def baselines(self, miners: int, rounds: int, seed: int) -> dict[str, Any]:
        """ESFT and the data-parallel ceiling on the batches `miners` honest miners draw, read after each round."""
        import torch

        from miner.model import miner_seed
        from training.data import batches, shard
        from training.experts import insert
        from training.trainer import TrainConfig, train_experts

        ids = [identity("miner", i, seed).node_id for i in range(miners)]
        esft: Mapping[str, torch.Tensor] = self.genesis.tensors
        optimizer: dict[str, Any] | None = None
        esft_losses = []
        for r in range(rounds):
            for m in ids:
                result = self.miners.train(m, r, esft, self.settings, lambda: True, optimizer_state=optimizer,
                                           hand_on=True)
                esft, optimizer = result.tensors, result.optimizer_state
            esft_losses.append(self.loss(esft))
        dp, dp_losses, inner, model = self.genesis.tensors, [], self.spec.training, self.miners.model
        assert isinstance(model, torch.nn.Module), "the miners' model is loaded whole (`full` forward)"
        cfg = TrainConfig(steps=inner.inner_steps, lr=inner.lr, beta1=inner.beta1, weight_decay=inner.weight_decay,
                          batch_size=inner.batch_size * miners, grad_clip=inner.grad_clip, pad_id=self.miners.pad_id)
        optimizer = None
        for r in range(rounds if miners > 1 else 0):  # one miner's ceiling is ESFT itself
            streams = [batches(shard(self.miners.sequences, m, r), inner.batch_size, miner_seed(m, r)) for m in ids]
            together = (torch.cat(step) for step in zip(*streams, strict=True))  # endless streams: H steps
            insert(model, self.miners.adapter, dict(dp))
            trained = train_experts(model, self.miners.adapter, self.spec.group, together, cfg, optimizer, hand_on=True)
            dp, optimizer = trained.tensors, trained.optimizer_state
            dp_losses.append(self.loss(dp))
        base_general = self.loss(self.genesis.tensors, self.general_report)
        dp_losses = dp_losses or esft_losses
        return {"esft_losses": esft_losses, "esft_loss": esft_losses[-1], "dp_ceiling_losses": dp_losses,
                "dp_ceiling_loss": dp_losses[-1],
                "esft_forgetting": round(self.loss(esft, self.general_report) - base_general, 4)}


def run_task(setting: str, seed: int, size: Size, networks: tuple[Net, ...], rounds: int, cache: Path,
             settings: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every network and baseline of one setting and seed (one process's share of the benchmark)."""
    import torch

    torch.set_num_threads(1)  # a tiny model on a shared CPU runs faster without intra-op threads
    runs, baselines = [], []
    for h in sorted({net.inner_steps for net in networks}):
        with tempfile.TemporaryDirectory(prefix="tessera-learning-") as tmp:
            network = Network(write_network(Path(tmp), setting, h, size, cache, settings))
            for net in (n for n in networks if n.inner_steps == h):
                started = time.perf_counter()
                key = {"domain": setting, "seed": seed, "inner_steps": h, "miners": net.miners}
                runs.append({**key, "adversaries": net.adversaries, **network.run(net, rounds, seed)})
                print(f"{setting} seed {seed} M={net.miners} A={net.adversaries} H={h}: adopted "
                      f"{runs[-1]['adopted_losses']} ({[g['adopted'] for g in runs[-1]['gates']]}, "
                      f"{time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
            for m in sorted({n.miners for n in networks if n.inner_steps == h}):
                baselines.append({"domain": setting, "seed": seed, "inner_steps": h, "miners": m,
                                  **network.baselines(m, rounds, seed)})
    return runs, baselines


def summarise(runs: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run, the issue's questions read off its losses, with 2 x its noise as the band: `rose_in` (rounds whose
    adopted loss rose over the previous round's, or round 0's over the base's, by more than the band), `fell`
    (the last adopted loss below the base's), `worse_than_best_in` (rounds whose adopted state read above the
    best single submission by more than the band), `dp_share` (the share of the data-parallel ceiling's drop at
    equal tokens), `vs_4_miners` (an 8-miner run's last loss minus the 4-miner run's at the same H and seed) and
    `forgetting_vs_esft` (the run's forgetting minus ESFT's at the same tokens)."""
    base_of_run = {(b["domain"], b["seed"], b["inner_steps"], b["miners"]): b for b in baselines}
    last = {(r["domain"], r["seed"], r["inner_steps"], r["miners"], r["adversaries"]): r["adopted_losses"][-1]
            for r in runs}
    out = []
    for r in runs:
        band, adopted = 2 * r["noise"], r["adopted_losses"]
        previous = [r["base_loss"], *adopted[:-1]]
        entry: dict[str, Any] = {key: r[key] for key in ("domain", "seed", "inner_steps", "miners", "adversaries")}
        entry["band"] = round(band, 4)
        entry["rose_in"] = [i for i, (a, b) in enumerate(zip(previous, adopted, strict=True)) if b - a > band]
        entry["fell"] = adopted[-1] < r["base_loss"]
        entry["worse_than_best_in"] = [i for i, (a, b) in enumerate(zip(adopted, r["best_single_losses"], strict=True))
                                       if b is not None and a - b > band]
        baseline = base_of_run.get((r["domain"], r["seed"], r["inner_steps"], r["miners"]))
        if baseline is not None:
            drop = r["base_loss"] - baseline["dp_ceiling_loss"]
            entry["dp_share"] = round((r["base_loss"] - adopted[-1]) / drop, 4) if drop > 0 else None
            entry["forgetting_vs_esft"] = round(r["forgetting"] - baseline["esft_forgetting"], 4)
        four = last.get((r["domain"], r["seed"], r["inner_steps"], 4, r["adversaries"]))
        if r["miners"] == 8 and four is not None:
            entry["vs_4_miners"] = round(adopted[-1] - four, 4)
        out.append(entry)
    return out


def pretrain(setting: str, size: Size, cache: Path) -> None:
    """Train and cache the setting's base (once per cache directory)."""
    from training.pretrain import pretrained_base

    pretrained_base(cache, base_of(setting, size))


def integers(least: int) -> Any:
    """argparse's type for a comma-separated list of integers of at least `least` (`--seeds 0,1,2`)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(item) for item in comma_list(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"expected integers of at least {least}, got {text!r}")
        return values

    return parse


def networks(text: str) -> tuple[Net, ...]:
    """argparse's type for `--networks 4@20,4@20/2`: M miners at H inner steps, A of them adversarial."""
    nets = []
    for item in comma_list(text):
        try:
            counts, _, adversaries = item.partition("/")
            miners, _, h = counts.partition("@")
            net = Net(int(miners), int(h), int(adversaries or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected networks as M@H or M@H/A, got {item!r}") from None
        if net.miners < 1 or net.inner_steps < 1 or not 0 <= net.adversaries < net.miners:
            raise argparse.ArgumentTypeError(f"{item!r}: need M >= 1, H >= 1 and 0 <= A < M")
        nets.append(net)
    if not nets:
        raise argparse.ArgumentTypeError("expected at least one network")
    return tuple(nets)


def domains(text: str) -> tuple[str, ...]:
    """argparse's type for `--domain arithmetic,facts`: settings of `SETTINGS`."""
    chosen = comma_list(text)
    if not chosen or any(d not in SETTINGS for d in chosen):
        raise argparse.ArgumentTypeError(f"expected settings from {', '.join(SETTINGS)}, got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--domain", type=domains, help=f"settings, comma-separated: {', '.join(SETTINGS)} (default all)")
    parser.add_argument("--networks", type=networks,
                        help="networks, comma-separated M@H[/A]: M miners at H inner steps, A adversarial "
                             "(default 1@20,4@20,8@20,4@20/2,4@50)")
    parser.add_argument("--rounds", type=int, help="rounds per run (default 3)")
    parser.add_argument("--seeds", type=integers(0),
                        help="seeds of the miners' ids (their shards and batches) and of the round seeds (default 0,1,2)")
    parser.add_argument("--workers", type=int, default=2, help="processes, one setting and seed each (default 2)")
    add_spec_settings(parser, "the spec's defaults and each network's H")
    parser.add_argument("--small", action="store_true",
                        help="a base trained for 30 steps, little data, and unless given arithmetic, seed 0, "
                             "2@2,2@2/1 and 2 rounds")
    parser.add_argument("--cache", type=Path, help="pretrained-base cache directory (default: the simulation's)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    size = SMALL if args.small else FULL
    rounds = size.rounds if args.rounds is None else args.rounds
    if rounds < 1 or args.workers < 1:
        parser.error("--rounds and --workers must be at least 1")
    try:
        overrides = {f"{section}.{field}": value
                     for section, values in judge_settings(args.spec_settings).items() for field, value in values.items()}
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    if "training.inner_steps" in overrides:
        parser.error("--set training.inner_steps: each network has its own H; give it in --networks M@H")
    settings, seeds, nets = args.domain or size.settings, args.seeds or size.seeds, args.networks or size.networks
    from node.sim.layout import default_cache_dir

    cache = args.cache or default_cache_dir()
    started = time.perf_counter()
    tasks = [(setting, seed) for setting in settings for seed in seeds]
    runs, baselines = [], []
    if len(tasks) == 1 or args.workers == 1:
        for setting, seed in tasks:
            part = run_task(setting, seed, size, nets, rounds, cache, args.spec_settings)
            runs += part[0]
            baselines += part[1]
    else:
        import multiprocessing

        bases = sorted({SETTINGS[s][0] if SETTINGS[s][1] else "general": s for s in settings}.values())
        with ProcessPoolExecutor(min(args.workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(pretrain, bases, [size] * len(bases), [cache] * len(bases)))  # each base once
            jobs = [(s, seed, size, nets, rounds, cache, args.spec_settings) for s, seed in tasks]
            for part in pool.map(run_task, *zip(*jobs, strict=True)):
                runs += part[0]
                baselines += part[1]
    emit({"seconds": round(time.perf_counter() - started, 1), "spec_overrides": overrides, "rounds": rounds,
          "small": args.small, "runs": runs, "baselines": baselines, "summary": summarise(runs, baselines)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
