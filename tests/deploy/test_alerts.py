"""The alert rules in deploy/prometheus/ fire on what a node really exports: a counter series born at 1 on
its first increment, an agreement of exactly two thirds, a miner whose every submission was rejected.
promtool (Debian's `prometheus` package) runs deploy/prometheus/alerts_test.yml where it is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # transformers depends on PyYAML

from node.runtime.metrics import NodeMetrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy/prometheus"
PROMTOOL = shutil.which("promtool") or next(  # make test-tools puts it beside the venv's python
    (str(p) for p in [Path(sys.executable).with_name("promtool")] if p.is_file()), None)


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    return {rule["alert"]: " ".join(rule["expr"].split()) for group in rules["groups"] for rule in group["rules"]}


def samples(metrics: NodeMetrics) -> dict[str, float]:
    """`name{labels}` -> value, from the real exposition text."""
    lines = metrics.render().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_counter_alerts_fire_on_a_series_born_at_one() -> None:
    metrics = NodeMetrics()
    metrics.phase_run(round=0, phase="train", duration_s=50.0, late_s=0.0, ok=False, overran=True)
    exported = samples(metrics)
    born_at_one = []
    for name in ("tessera_phase_failures_total", "tessera_phase_overruns_total"):
        assert exported[f'{name}{{phase="train"}}'] == 1.0, name  # no 0 before it: increase() sees no rise
        born_at_one.append(name)
    for alert, expr in alert_exprs().items():
        for name, window in re.findall(r"increase\((\w+)\[(\w+)\]\)", expr):
            if name in born_at_one:
                assert f"{name} > 0 unless {name} offset {window}" in expr, f"{alert} misses a first {name}"


def test_validators_disagree_only_below_two_thirds() -> None:
    match = re.fullmatch(r"tessera_validator_agreement < (?:(\d+)/(\d+)|([\d.]+))"
                         r"(?: and tessera_validator_agreement > 0)?",  # 0: a node that has seen no votes
                         alert_exprs()["TesseraValidatorsDisagree"])
    assert match, "TesseraValidatorsDisagree should compare the agreement share with a constant"
    threshold = int(match[1]) / int(match[2]) if match[1] else float(match[3])
    assert not 2.0 / 3.0 < threshold, "2 of 3 equal validators hold two thirds: the summary says it should not fire"
    assert 0.5 < threshold


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (make test-tools; apt: prometheus)")
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (make test-tools; apt: prometheus)")
def test_promtool_accepts_the_config_and_rules(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    config = (PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8")
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/", f"{tmp_path}/"), encoding="utf-8")
    result = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
