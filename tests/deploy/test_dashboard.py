"""The alert rules select only on labels a node exports itself (or that every Prometheus adds: job,
instance), so they work on an operator's own Prometheus as on the bundled one, whose scrape config adds a
`role` label (the bundled dashboard may use it); and neither they nor the dashboard add up per-round counts
that every node exports across nodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from node.net.network import NetworkStats
from node.runtime.metrics import NodeMetrics

ROOT = Path(__file__).resolve().parents[2]


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text(encoding="utf-8"))
    return {f"alert {r['alert']}": r["expr"] for group in rules["groups"] for r in group["rules"]}


def exprs() -> dict[str, str]:
    found = alert_exprs()
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tessera.json").read_text(encoding="utf-8"))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    return found


def exported_labels() -> set[str]:
    metrics = NodeMetrics()
    metrics.bind_network(NetworkStats, lambda: 0)
    metrics.phase_run(0, "train", 1.0, 0.0, ok=True)
    metrics.submissions_scored(1.0, [("accept", "")])
    metrics.seeds_withheld(["a" * 64], [])
    metrics.round_results(None, None, {"loss": 1.0, "rank": 1, "reward": 1.0}, None, [("accept", "")])
    return {label for family in metrics.registry.collect() for s in family.samples for label in s.labels}


def test_alerts_select_only_on_labels_a_node_exports() -> None:
    allowed = exported_labels() | {"job", "instance", "le"}
    for where, expr in alert_exprs().items():
        for selector in re.findall(r"\{([^}]*)\}", expr.replace("{{", "").replace("}}", "")):
            names = set(re.findall(r"(\w+)\s*[!=]~?", selector))
            assert names <= allowed, f"{where}: {expr} selects on {sorted(names - allowed)}"


def test_the_last_rounds_verdicts_are_not_summed_over_nodes() -> None:
    """Every node exports the last round's verdict counts: a sum over nodes counts each miner once a node."""
    for where, expr in exprs().items():
        assert not re.search(r"sum\b[^(]*\([^)]*\)\s*\(\s*tessera_round_verdicts", expr), f"{where}: {expr}"
