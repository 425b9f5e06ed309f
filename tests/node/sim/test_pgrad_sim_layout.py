"""`tessera simulate --format pgrad` writes a network whose spec submits compressed pseudo-gradients:
the option reaches the simulation's settings, and the prepared network's spec (nothing is started)
carries a `[submission]` section that `pgrad_config` accepts and that fits the base's expert tensors.
The default stays full experts."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from node.cli.main import main
from node.sim.process import SimSettings
from node.sim.run import Simulation
from protocol.spec import SubmissionSpec, load_spec
from training.experts import extract
from training.model import load_base
from training.pgrad import PgradConfig, compressed_bytes, pgrad_config

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_a_prepared_pgrad_simulation_has_a_spec_pgrad_config_accepts(tmp_path: Path) -> None:
    sim = Simulation(tmp_path / "sim", SimSettings(validators=1, miners=1, submission_format="pgrad"))
    sim.prepare()
    assert sim.network is not None and not any(n.proc for n in sim.nodes.values())
    spec_path = sim.network.spec_path
    assert tomllib.loads(spec_path.read_text())["submission"]["format"] == "pgrad"
    spec = load_spec(spec_path)
    cfg = pgrad_config(spec)
    defaults = SubmissionSpec(format="pgrad")  # the protocol's default chunk, top-k, quantisation, partitions
    assert cfg == PgradConfig(chunk=defaults.chunk, topk=defaults.topk, quant=defaults.quant,
                              partitions=defaults.partitions)
    model, adapter = load_base(spec, spec_path)
    experts = extract(model, adapter, spec.group)
    # compressed_bytes raises unless every expert tensor of the group splits into the spec's chunks.
    full_bf16 = sum(2 * t.numel() for t in experts.values())
    assert 16 * compressed_bytes({name: tuple(t.shape) for name, t in experts.items()}, cfg) <= full_bf16


@pytest.mark.parametrize(("argv", "expected"), [([], "experts"), (["--format", "pgrad"], "pgrad")])
def test_simulate_format_reaches_the_settings(tmp_path: Path, simulate_settings: list[SimSettings], capsys,
                                              argv: list[str], expected: str) -> None:
    assert main(["simulate", "--dir", str(tmp_path / "sim"), *argv]) == 1
    assert [s.submission_format for s in simulate_settings] == [expected]
    assert "stopped before writing anything" in capsys.readouterr().err


def test_simulate_refuses_an_unknown_format(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--dir", str(tmp_path / "sim"), "--format", "fp8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()
