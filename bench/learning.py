"""Learning benchmark: does a network learn faster with more miners, against the data-parallel ceiling on the same tokens?

For each setting (`bench.learning_data`: two domains of facts limited by data and one heterogeneous mix) and seed it
writes a network as `tessera spec new` would, with the spec's defaults and then `--set`, where every miner holds its
own file. Then each network (M miners, A of them adversarial, at the spec's H) runs `--rounds` rounds through the
product's code alone: the validators' seeds give the round seed (`protocol.seeds`); every honest miner trains from
the adopted state on its own data and builds its blob with the honest builder (`miner.submission.build_submission`),
an adversary with the simulation's noise strategy (`node.sim.adversaries`); each validator scores the miners
assigned to it (`protocol.assignment`) with `validator.scoring.Scorer`; `validator.merge.merge_round` ranks, rewards
and merges, and `validator.merge.gate` decides what is adopted (`validator.scoring.gate_measure`, with the
general-domain file the spec pins). This file has no round logic of its own: it changes only the inputs.
From the same base and the same miners' batches it runs two references at equal tokens: ESFT (the miners' own
training code over every miner's batches in turn, one AdamW run) and the data-parallel ceiling (one AdamW run whose
every step takes the M miners' batches of that step together) at each of `Size.dp_lr_scales` times the miners' lr,
the one kept whose last state reads lowest on the validators' held-out file. Every state is read on a report set of
held-out documents the validators never see, sequence by sequence, and on a general-domain report set for
forgetting; `comparisons` holds every paired difference (`bench.learning_stats`) per round, per seed and pooled.
The JSON: `runs` (`base_loss`, the `adopted_losses` and `best_single_losses` of every round, the gate's verdicts),
`baselines` (`dp_lr`, `dp_ceiling_loss`, `esft_loss` after the last round) and `comparisons` (`bench.learning_report`).
Usage: python bench/learning.py [--domain S,...] [--networks M[/A],...] [--rounds R] [--seeds S,...] [--workers W]
       [--set SECTION.FIELD=VALUE]... [--small] [--cache DIR] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learning_data import FULL, SETTINGS, SMALL, VALIDATORS, Size, base_config, identity  # noqa: E402
from bench.learning_stats import Rows, TaskRows, comparisons, mean, shares  # noqa: E402
from bench.report import emit, out_file  # noqa: E402
from node.cli.common import add_spec_settings, comma_list  # noqa: E402
from protocol.spec import judge_settings  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from miner.model import MinerModel
    from protocol.spec import NetworkSpec
    from training.state import GlobalExperts
    from validator.scoring import Scorer


class Network:
    """What one setting and seed's runs load once: every miner's model and own data, the validators' scorer and
    general-domain sequences, and the report sets."""

    def __init__(self, spec_path: Path, miners: int, seed: int) -> None:
        from miner.model import MinerModel
        from miner.settings import MinerSettings
        from protocol.spec import load_spec
        from training.data import load_sequences
        from training.experts import extract
        from training.model import load_base
        from training.state import GlobalExperts
        from training.tokenizer import ByteTokenizer
        from validator.scoring import Scorer

        self.spec: NetworkSpec = load_spec(spec_path)
        self.seed = seed
        self.blobs = spec_path.parent / "blobs"  # the revealed blobs, where a validator's store keeps them
        self.blobs.mkdir(exist_ok=True)
        data, tokenizer = spec_path.parent / "data", ByteTokenizer()
        self.ids = [identity("miner", i, seed).node_id for i in range(miners)]
        self.miners: dict[str, MinerModel] = {  # each as a node loads it with `[miner] data` naming its own file
            m: MinerModel.load(self.spec, spec_path, [data / f"miner-{i}.jsonl"]) for i, m in enumerate(self.ids)}
        self.settings = MinerSettings()  # the node's `[miner]` defaults: the CPU, the full model
        model, adapter = load_base(self.spec, spec_path, attn_implementation="eager")

        def sequences(name: str) -> torch.Tensor:
            return load_sequences([data / name], tokenizer, self.spec.data.seq_len)

        self.scorer: Scorer = Scorer(model, adapter, self.spec, sequences("heldout.jsonl"), tokenizer.pad_id)
        self.general, self.report, self.general_report = (sequences(name) for name in (
            "general.jsonl", "report.jsonl", "general-report.jsonl"))
        self.genesis: GlobalExperts = GlobalExperts.genesis(self.spec, extract(model, adapter, self.spec.group))

    def rows(self, tensors: Mapping[str, torch.Tensor], sequences: torch.Tensor | None = None) -> Rows:
        """The report set's (or `sequences`') loss of the base holding `tensors`, sequence by sequence."""
        from training.evaluate import loss_with_experts

        s = self.scorer
        result = loss_with_experts(s.model, s.adapter, tensors, self.report if sequences is None else sequences,
                                   s.batch_size, str(s.device), s.pad_id)
        return shares(result.row_sums, result.tokens)

    def run(self, miners: int, adversaries: int, rounds: int, rows: TaskRows) -> dict[str, Any]:
        """`rounds` rounds of a network of the first `miners` miners, the last `adversaries` of them adversarial, from
        genesis: its record, and (honest networks) every state's rows in `rows`."""
        from miner.submission import Diverged, ErrorFeedback, build_submission

        ids = self.ids[:miners]
        bad = set(ids[miners - adversaries:])
        feedback = {m: ErrorFeedback() if self.spec.submission.format == "pgrad" else None for m in ids}
        state, adopted, best, gates = self.genesis, [], [], []
        for r in range(rounds):
            blobs: dict[str, bytes] = {}
            for m in ids:
                try:
                    blobs[m] = self.adversary(m, r, state) if m in bad else build_submission(
                        self.miners[m], m, r, state.hash, state.tensors, self.settings, feedback=feedback[m])[0]
                except Diverged as exc:
                    print(f"round {r}: miner {m[:8]}: {exc}", file=sys.stderr)
            state, gate, accepted = self.round(r, state, blobs)
            gates.append(gate)
            mine = self.rows(state.tensors)
            singles = sorted((self.rows(t) for t in accepted.values()), key=sum)
            adopted.append(round(sum(mine) / len(mine), 5))
            best.append(round(sum(singles[0]) / len(singles[0]), 5) if singles else None)
            if not adversaries:
                rows.put("adopted", miners, r, mine)
                rows.put("adopted general", miners, r, self.rows(state.tensors, self.general_report))
                if singles:
                    rows.put("best single", miners, r, singles[0])
        base = self.rows(self.genesis.tensors)
        return {"base_loss": round(sum(base) / len(base), 5), "adopted_losses": adopted, "best_single_losses": best,
                "gates": gates}

    def adversary(self, miner: str, round: int, state: GlobalExperts) -> bytes:
        """The simulation's noise adversary's blob (`node.sim.adversaries.Noise`)."""
        from node.duties.miner import Job
        from node.runtime.metrics import NodeMetrics
        from node.sim.adversaries import Noise

        job = Job(self.miners[miner], miner, round, state.hash, state, self.settings, lambda: True, NodeMetrics())
        return Noise().build(job)

    def round(self, round: int, state: GlobalExperts, blobs: Mapping[str, bytes]
              ) -> tuple[GlobalExperts, dict[str, Any], dict[str, Mapping[str, torch.Tensor]]]:
        """The validators' part of `round`: the round seed from their seeds, each scoring the miners assigned to
        it, `merge_round` on their reports and the gate; the state adopted, the gate's verdict (as a round
        report shows it, with the number of updates merged and adopted) and the accepted submissions' experts."""
        from protocol.assignment import assign
        from protocol.seeds import commitment, round_seed
        from training.blob import blob_hash
        from validator.merge import gate, merge_round
        from validator.scoring import gate_measure

        validators = [identity("validator", v).node_id for v in range(VALIDATORS)]
        seeds = {v: hashlib.sha256(f"tessera-learning:{self.seed}:{round}:{v}".encode()).hexdigest()
                 for v in validators}
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

    def esft(self, miners: int, rounds: int, rows: TaskRows) -> dict[str, Any]:
        """ESFT on the first `miners` miners' batches, read after every round and, for forgetting at a matched
        in-domain loss, after every miner's H steps: of all those states, the one whose report loss is nearest the
        network's adopted state's in each round (where `rows` holds that network's) is read on the general-domain
        report set."""
        ids = self.ids[:miners]
        state: Mapping[str, torch.Tensor] = self.genesis.tensors
        optimizer: dict[str, Any] | None = None
        read: list[tuple[float, Mapping[str, torch.Tensor]]] = []
        for r in range(rounds):
            for m in ids:
                result = self.miners[m].train(m, r, state, self.settings, lambda: True, optimizer_state=optimizer,
                                              hand_on=True)
                state, optimizer = result.tensors, result.optimizer_state
                report = self.rows(state)
                read.append((mean(report), state))
            rows.put("esft", miners, r, report)
            rows.put("esft general", miners, r, self.rows(state, self.general_report))
        for r in range(rounds):
            if ("adopted", miners, r) in rows.states:
                target = mean(rows.get("adopted", miners, r))
                nearest = min(read, key=lambda checkpoint: abs(checkpoint[0] - target))[1]
                rows.put("esft matched general", miners, r, self.rows(nearest, self.general_report))
        return {"esft_loss": round(mean(rows.get("esft", miners, rounds - 1)), 5)}

    def ceiling(self, miners: int, rounds: int, lr: float) -> tuple[list[Rows], float]:
        """The data-parallel ceiling at `lr` over the first `miners` miners' batches: its report rows after every
        round, and its last state's loss on the validators' held-out file (which picks the lr)."""
        import torch

        from miner.model import miner_seed
        from training.data import batches, shard
        from training.experts import insert
        from training.trainer import TrainConfig, train_experts

        ids, inner = self.ids[:miners], self.spec.training
        model, adapter = self.miners[ids[0]].model, self.miners[ids[0]].adapter
        assert isinstance(model, torch.nn.Module), "the miners' model is loaded whole (`full` forward)"
        cfg = TrainConfig.from_spec(inner, lr=lr, batch_size=inner.batch_size * miners, pad_id=self.miners[ids[0]].pad_id)
        state, optimizer, out = self.genesis.tensors, None, []
        for r in range(rounds):
            streams = [batches(shard(self.miners[m].sequences, m, r), inner.batch_size, miner_seed(m, r)) for m in ids]
            together = (torch.cat(step) for step in zip(*streams, strict=True))  # endless streams: H steps
            insert(model, adapter, dict(state))
            trained = train_experts(model, adapter, self.spec.group, together, cfg, optimizer, hand_on=True)
            state, optimizer = trained.tensors, trained.optimizer_state
            out.append(self.rows(state))
        held = self.rows(state, self.scorer.heldout)
        return out, sum(held) / len(held)

    def baselines(self, miners: int, rounds: int, scales: tuple[float, ...], rows: TaskRows) -> dict[str, Any]:
        """ESFT and the data-parallel ceiling of the first `miners` miners: the lr kept, each lr's held-out loss, and
        their losses after the last round; their rows in `rows`."""
        tried = {scale * self.spec.training.lr: self.ceiling(miners, rounds, scale * self.spec.training.lr)
                 for scale in scales}
        lr = min(tried, key=lambda k: tried[k][1])
        for r, state in enumerate(tried[lr][0]):
            rows.put("ceiling", miners, r, state)
        last = tried[lr][0][-1]
        return {"dp_lr": lr, "dp_lr_losses": {str(k): round(v[1], 5) for k, v in tried.items()},
                "dp_ceiling_loss": round(sum(last) / len(last), 5), **self.esft(miners, rounds, rows)}


def run_task(setting: str, seed: int, size: Size, networks: tuple[tuple[int, int], ...], rounds: int, cache: Path,
             settings: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], TaskRows]:
    """Every network and baseline of one setting and seed (one process's share of the benchmark)."""
    import torch

    from bench.learning_data import write_network

    torch.set_num_threads(1)  # a tiny model on a shared CPU runs faster without intra-op threads
    runs, baselines, rows = [], [], TaskRows()
    most = max(m for m, _ in networks)
    with tempfile.TemporaryDirectory(prefix="tessera-learning-") as tmp:
        network = Network(write_network(Path(tmp), setting, seed, most, size, cache, settings), most, seed)
        key = {"domain": setting, "seed": seed}
        for miners, adversaries in networks:
            started = time.perf_counter()
            runs.append({**key, "miners": miners, "inner_steps": network.spec.training.inner_steps,
                         "adversaries": adversaries, **network.run(miners, adversaries, rounds, rows)})
            print(f"{setting} seed {seed} M={miners} A={adversaries}: adopted {runs[-1]['adopted_losses']} "
                  f"({[g['adopted'] for g in runs[-1]['gates']]}, {time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
        for miners in sorted({m for m, a in networks if not a}):
            started = time.perf_counter()
            baselines.append({**key, "miners": miners, **network.baselines(miners, rounds, size.dp_lr_scales, rows)})
            print(f"{setting} seed {seed} M={miners}: ceiling {baselines[-1]['dp_ceiling_loss']} at lr "
                  f"{baselines[-1]['dp_lr']}, ESFT {baselines[-1]['esft_loss']} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    return runs, baselines, rows


def pretrain(size: Size, cache: Path) -> None:
    """Train and cache the base (once per cache directory)."""
    from training.pretrain import pretrained_base

    pretrained_base(cache, base_config(size))


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


def networks(text: str) -> tuple[tuple[int, int], ...]:
    """argparse's type for `--networks 1,4,8,4/2`: M miners, A of them adversarial."""
    nets = []
    for item in comma_list(text):
        try:
            miners, _, adversaries = item.partition("/")
            net = (int(miners), int(adversaries or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected networks as M or M/A, got {item!r}") from None
        if net[0] < 1 or not 0 <= net[1] < net[0]:
            raise argparse.ArgumentTypeError(f"{item!r}: need M >= 1 and 0 <= A < M")
        nets.append(net)
    if not nets:
        raise argparse.ArgumentTypeError("expected at least one network")
    return tuple(nets)


def domains(text: str) -> tuple[str, ...]:
    """argparse's type for `--domain registry,mixed`: settings of `SETTINGS`."""
    chosen = comma_list(text)
    if not chosen or any(d not in SETTINGS for d in chosen):
        raise argparse.ArgumentTypeError(f"expected settings from {', '.join(SETTINGS)}, got {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--domain", type=domains, help=f"settings, comma-separated: {', '.join(SETTINGS)} (default all)")
    parser.add_argument("--networks", type=networks,
                        help="networks, comma-separated M[/A]: M miners, A of them adversarial (default 1,4,8)")
    parser.add_argument("--rounds", type=int, help=f"rounds per run (default {FULL.rounds})")
    parser.add_argument("--seeds", type=integers(0),
                        help="seeds of the miners' data, ids and batches and of the round seeds (default 0,1,2)")
    parser.add_argument("--workers", type=int, default=2, help="processes, one setting and seed each (default 2)")
    add_spec_settings(parser, "the spec's defaults")
    parser.add_argument("--small", action="store_true",
                        help="a base trained for 30 steps, little data, H = 2, 16 scored and gate rows, and unless given "
                             "lexicon, seed 0, networks 1,4,2/1 and 2 rounds")
    parser.add_argument("--cache", type=Path, help="pretrained-base cache directory (default: the simulation's)")
    parser.add_argument("--out", type=out_file, help="write the JSON here (default: stdout only)")
    args = parser.parse_args(argv)
    size = SMALL if args.small else FULL
    rounds = size.rounds if args.rounds is None else args.rounds
    if rounds < 1 or args.workers < 1:
        parser.error("--rounds and --workers must be at least 1")
    spec_settings = [*size.spec_settings, *args.spec_settings]
    try:
        overrides = {f"{section}.{field}": value
                     for section, values in judge_settings(spec_settings).items() for field, value in values.items()}
    except ValueError as exc:
        parser.error(f"--set: {exc}")
    settings, seeds, nets = args.domain or size.settings, args.seeds or size.seeds, args.networks or size.networks
    from node.sim.layout import default_cache_dir

    cache = args.cache or default_cache_dir()
    started = time.perf_counter()
    tasks = [(setting, seed) for setting in settings for seed in seeds]
    jobs = [(s, seed, size, nets, rounds, cache, spec_settings) for s, seed in tasks]
    if len(tasks) == 1 or args.workers == 1:
        parts = [run_task(*job) for job in jobs]
    else:
        import multiprocessing

        with ProcessPoolExecutor(min(args.workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(pretrain, size, cache).result()  # the base once, before the tasks race for it
            parts = list(pool.map(run_task, *zip(*jobs, strict=True)))
    runs = [run for part in parts for run in part[0]]
    baselines = [baseline for part in parts for baseline in part[1]]
    rows = {task: part[2] for task, part in zip(tasks, parts, strict=True)}
    emit({"seconds": round(time.perf_counter() - started, 1), "spec_overrides": overrides, "runs": runs,
          "baselines": baselines, "comparisons": comparisons(rows)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
