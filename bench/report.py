"""Benchmark output: each benchmark prints its JSON report and, given a path, writes it there too.

The file is written whole or not at all (`protocol.files.write_file`), so a run that fails while
writing leaves an earlier report at that path as it was. `python bench/report.py learning FILE` renders
the learning benchmark's report (bench/learning.py) as the tables and findings of docs/learning.md's
"What it measured", every number read from the file (`learning_markdown`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a program: `python bench/report.py ...`

from protocol.files import write_file  # noqa: E402

LEARNING_BEGIN = "<!-- bench/report.py learning bench/results/learning.json -->"
LEARNING_END = "<!-- end of bench/report.py's output -->"
"""The lines around docs/learning.md's rendered part."""


def out_file(text: str) -> Path:
    """argparse type of `--out`: a file path; a directory is refused before the benchmark runs, not after."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the JSON file to write, such as {path / 'report.json'}")
    return path


def emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, (text + "\n").encode("utf-8"))


def learning_markdown(report: dict[str, Any]) -> str:
    """The learning report's tables and findings as markdown, between `LEARNING_BEGIN` and `LEARNING_END`."""
    view = _Learning(report)
    return "\n".join([LEARNING_BEGIN, *view.header(), *view.losses(), *view.pooled(), *view.by_round(),
                      *view.per_seed(), *view.single_and_gate(), *view.findings(), LEARNING_END])


class _Learning:
    """One learning report, read for rendering: its settings, seeds, networks and last round."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        self.runs = [r for r in report["runs"] if not r["adversaries"]]
        self.domains = list(dict.fromkeys(r["domain"] for r in self.runs))
        self.seeds = sorted({r["seed"] for r in self.runs})
        self.miners = sorted({r["miners"] for r in self.runs})
        self.last = max(len(r["adopted_losses"]) for r in self.runs) - 1
        self.compared = {(c["domain"], c["seed"], c["what"], c["round"], c["miners"], c["esft_at"]): c
                         for c in report["comparisons"]}

    def get(self, domain: str, what: str, miners: int | None = None, seed: int | str = "pooled",
            esft_at: str | None = None, round: int | None = None) -> dict[str, Any] | None:
        return self.compared.get((domain, seed, what, self.last if round is None else round, miners, esft_at))

    def header(self) -> list[str]:
        h = sorted({r["inner_steps"] for r in self.runs})
        overrides = self.report["spec_overrides"]
        return [f"`bench/results/learning.json`: {', '.join(self.domains)}; seeds {_join(self.seeds)}; networks of "
                f"{_join(self.miners)} miners at H = {_join(h)}, {self.last + 1} rounds each, with their references: "
                f"{self.report['seconds']:,.0f} s. Spec settings: "
                f"{', '.join(f'{k} = {v}' for k, v in overrides.items()) if overrides else 'the defaults'}.", ""]

    def losses(self) -> list[str]:
        """Every state's loss after the last round, the mean over seeds (the range in brackets)."""
        rows = [_row("", self.domains), _row("---", ["---"] * len(self.domains))]
        base = {d: [r["base_loss"] for r in self.runs if r["domain"] == d] for d in self.domains}
        rows.append(_row(f"base (a uniform guess: {math.log(260):.3f})", [_spread(base[d]) for d in self.domains]))
        for m in self.miners:
            rows.append(_row(f"network, {m} miner{'s' * (m > 1)}", [_spread(
                [r["adopted_losses"][-1] for r in self.runs if r["domain"] == d and r["miners"] == m])
                for d in self.domains]))
        for m in self.miners:
            cells = []
            for d in self.domains:
                mine = [b for b in self.report["baselines"] if b["domain"] == d and b["miners"] == m]
                lrs = "/".join(f"{b['dp_lr']:g}" for b in sorted(mine, key=lambda b: b["seed"]))
                cells.append(f"{_spread([b['dp_ceiling_loss'] for b in mine])} (lr {lrs})")
            rows.append(_row(f"ceiling, {m} miner{'s' * (m > 1)}", cells))
        for m in self.miners:
            rows.append(_row(f"ESFT, {m} miner{'s' * (m > 1)}", [_spread(
                [b["esft_loss"] for b in self.report["baselines"] if b["domain"] == d and b["miners"] == m])
                for d in self.domains]))
        return ["Losses on the report set after the last round: the mean over seeds, the range in brackets; the "
                "ceiling's lr by seed.", "", *rows, ""]

    def comparisons(self) -> list[tuple[str, str, int | None, str | None]]:
        """The rows of the pooled table: label, what, miners, esft_at."""
        out: list[tuple[str, str, int | None, str | None]] = [
            ("ceiling 1 -> 4 miners (gain)", "ceiling 1->4", None, None),
            ("network 1 -> 4 miners (gain)", "network 1->4", None, None),
            ("ceiling 4 -> 8 miners (gain)", "ceiling 4->8", None, None),
            ("network 4 -> 8 miners (gain)", "network 4->8", None, None)]
        out += [(f"adopted - ceiling, {m} miner{'s' * (m > 1)}", "adopted - ceiling", m, None) for m in self.miners]
        out += [(f"forgetting - ESFT's, {m} miner{'s' * (m > 1)}, {at}", "forgetting - esft_forgetting", m, at)
                for m in self.miners for at in ("equal tokens", "matched loss")]
        return [row for row in out if any(self.get(d, row[1], row[2], esft_at=row[3]) for d in self.domains)]

    def pooled(self) -> list[str]:
        rows = [_row("after the last round", self.domains), _row("---", ["---"] * len(self.domains))]
        for label, what, miners, at in self.comparisons():
            rows.append(_row(label, [_interval(self.get(d, what, miners, esft_at=at)) for d in self.domains]))
            if what == "network 1->4":
                rows.append(_row("network's 1 -> 4 gain / the ceiling's", [self.share(d, "1->4") for d in self.domains]))
            if what == "network 4->8":
                rows.append(_row("network's 4 -> 8 gain / the ceiling's", [self.share(d, "4->8") for d in self.domains]))
        return ["Paired differences on the report set, in nats, pooled over the seeds: the mean and its 95% "
                "paired-bootstrap interval (a gain: the fewer miners' loss minus the more miners'; the others: the "
                "first state's loss minus the second's).", "", *rows, ""]

    def by_round(self) -> list[str]:
        rounds = list(range(self.last + 1))
        rows = [_row("pooled, by round", [f"round {r}" for r in rounds]), _row("---", ["---"] * len(rounds))]
        wanted = [*self.comparisons()[:4], ("adopted - ceiling, 4 miners", "adopted - ceiling", 4, None)]
        for d in self.domains:
            for label, what, miners, at in wanted:
                rows.append(_row(f"{d}: {label}", [_interval(self.get(d, what, miners, esft_at=at, round=r))
                                                   for r in rounds]))
        return ["Round by round, pooled over the seeds:", "", *rows, ""]

    def share(self, domain: str, step: str) -> str:
        network, ceiling = self.get(domain, f"network {step}"), self.get(domain, f"ceiling {step}")
        if network is None or ceiling is None or ceiling["mean"] <= 0:
            return "-"
        return f"{network['mean'] / ceiling['mean']:.2f}"

    def per_seed(self) -> list[str]:
        labels = [f"seed {s}" for s in self.seeds]
        rows = [_row("after the last round, per seed", [f"{d}, {s}" for d in self.domains for s in labels]),
                _row("---", ["---"] * len(self.domains) * len(self.seeds))]
        for label, what, miners, at in self.comparisons()[:4]:
            rows.append(_row(label, [_interval(self.get(d, what, miners, s, at)) for d in self.domains for s in self.seeds]))
        return ["The gains per seed (mean and 95% interval):", "", *rows, ""]

    def single_and_gate(self) -> list[str]:
        rows = [_row("", [*self.domains]), _row("---", ["---"] * len(self.domains))]
        verdicts: dict[str, list[str]] = {d: [] for d in self.domains}
        kept: Counter[str] = Counter()
        gates = {(r["domain"], r["seed"], r["miners"]): r["gates"] for r in self.runs}
        for c in self.report["comparisons"]:
            if c["what"] == "adopted - best_single" and c["seed"] != "pooled":
                verdicts[c["domain"]].append("above" if c["ci_low"] > 0 else "below" if c["ci_high"] < 0 else "spans")
                kept[c["domain"]] += c["ci_low"] > 0 and gates[c["domain"], c["seed"], c["miners"]][c["round"]][
                    "adopted"] == "current"
        for side, label in (("above", "adopted above the best single, interval above zero"),
                            ("spans", "interval spans zero"), ("below", "adopted below it, interval below zero")):
            rows.append(_row(label, [f"{verdicts[d].count(side)} of {len(verdicts[d])}" for d in self.domains]))
        rows.append(_row("of those above zero, rounds whose gate kept the current state",
                         [str(kept[d]) for d in self.domains]))
        picks = {d: Counter(g["adopted"] for r in self.runs if r["domain"] == d for g in r["gates"]) for d in self.domains}
        for name in ("current", "merged", "best_single"):
            rows.append(_row(f"gate adopted {name}", [f"{picks[d][name]} of {sum(picks[d].values())}"
                                                      for d in self.domains]))
        for m in self.miners:
            merged = {d: [g["merged"] for r in self.runs if r["domain"] == d and r["miners"] == m for g in r["gates"]]
                      for d in self.domains}
            rows.append(_row(f"{m} miner{'s' * (m > 1)}: updates merged a round (rounds with none)", [
                f"{sum(merged[d]) / len(merged[d]):.1f} ({merged[d].count(0)} of {len(merged[d])})" if merged[d] else "-"
                for d in self.domains]))
        flips = {d: self.unproven_merges(d) for d in self.domains}
        rows.append(_row("merged adopted, its gain over the best single short of the margin: adopted - best single "
                         "below / spanning / above zero", [
                             f"{sides.count('below')} / {sides.count('spans')} / {sides.count('above')}"
                             for sides in flips.values()]))
        return ["Rounds (every network, seed and round) by the adopted state's loss minus the round's best single "
                "submission's, the gate's choices, and how many miners' updates were merged:", "", *rows, ""]

    def unproven_merges(self, domain: str) -> list[str]:
        """For each round whose gate adopted the merged state though its gain over the best single submission did
        not clear the margin (the rounds in which the order of preference, not evidence, chose between the two):
        where the report set puts the adopted state against the round's best single submission."""
        from protocol.spec import AggregationSpec

        margin = float(self.report["spec_overrides"].get("aggregation.gate_margin",
                                                         AggregationSpec.model_fields["gate_margin"].default))
        out = []
        for run in (r for r in self.runs if r["domain"] == domain):
            for round, gate in enumerate(run["gates"]):
                challenge = gate["gains"].get("best_single")
                if gate["adopted"] != "merged" or challenge is None or challenge["against"] != "merged":
                    continue
                if challenge["low"] - 2 * challenge["mean"] > margin:  # the merged state's own low end
                    continue
                c = self.get(domain, "adopted - best_single", run["miners"], run["seed"], round=round)
                if c is not None:
                    out.append("above" if c["ci_low"] > 0 else "below" if c["ci_high"] < 0 else "spans")
        return out

    def findings(self) -> list[str]:
        """The issue's questions, answered from the pooled comparisons."""
        from bench.learning_data import DATA_LIMITED

        limited = [d for d in self.domains if d in DATA_LIMITED]
        out = ["Read off the tables:", ""]
        for d in self.domains:
            ceiling, network = self.get(d, "ceiling 1->4"), self.get(d, "network 1->4")
            if ceiling is None or network is None:
                continue
            out.append(f"- {d}{' (data-limited)' if d in limited else ''}: the ceiling's 1 -> 4 gain is "
                       f"{_significance(ceiling)}; the network's is {_significance(network)}, "
                       f"{self.share(d, '1->4')} of the ceiling's"
                       f"{', at least half' if network['mean'] >= ceiling['mean'] / 2 else ', less than half'}.")
            ceiling8, network8 = self.get(d, "ceiling 4->8"), self.get(d, "network 4->8")
            if ceiling8 is not None and network8 is not None:
                out.append(f"- {d}: 4 -> 8 miners: the ceiling's gain is {_significance(ceiling8)}, the network's "
                           f"{_significance(network8)}.")
        return [*out, ""]


def _significance(c: dict[str, Any]) -> str:
    side = "above zero" if c["ci_low"] > 0 else "below zero" if c["ci_high"] < 0 else "spanning zero"
    return f"{c['mean']:.4f} (interval {side})"


def _interval(c: dict[str, Any] | None) -> str:
    return "-" if c is None else f"{c['mean']:.4f} [{c['ci_low']:.4f}, {c['ci_high']:.4f}]"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = math.fsum(values) / len(values)
    return f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ({min(values):.4f}-{max(values):.4f})"


def _row(label: str, cells: list[str]) -> str:
    return f"| {label} | {' | '.join(cells)} |"


def _join(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render a benchmark's JSON report as markdown.")
    parser.add_argument("benchmark", choices=["learning"], help="which benchmark wrote the file")
    parser.add_argument("file", type=Path, help="the JSON report")
    args = parser.parse_args(argv)
    print(learning_markdown(json.loads(args.file.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
