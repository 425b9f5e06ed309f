"""`tessera simulate --set SECTION.FIELD=VALUE` and `--keep-optimizer`: a simulation of the protocol's
other settings (the short rounds of docs/learning.md) without editing files by hand.

A setting is read as TOML, judged by the spec's own section model before anything is written, and
lands in the prepared network's spec (nothing is started); `--keep-optimizer` lands in every miner's
config and no validator's; `--adversaries` is read as comma-separated kinds."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from node.cli.main import main
from node.runtime.config import load_config
from node.sim.process import SimSettings
from node.sim.run import Simulation
from protocol.spec import load_spec, parse_setting

pytestmark = pytest.mark.timeout(180)


def test_a_setting_is_read_as_toml_and_a_bare_word_as_a_string() -> None:
    assert parse_setting("aggregation.outer_lr=2.5") == ("aggregation.outer_lr", 2.5)
    assert parse_setting("aggregation.top_g = 8") == ("aggregation.top_g", 8)
    assert parse_setting("aggregation.clip_to_median=false") == ("aggregation.clip_to_median", False)
    assert parse_setting("submission.format=pgrad") == ("submission.format", "pgrad")
    assert parse_setting('submission.quant="int8"') == ("submission.quant", "int8")
    for text in ("aggregation.outer_lr", "=2.5", "aggregation.outer_lr="):
        with pytest.raises(ValueError, match="write it as section.field=value"):
            parse_setting(text)


@pytest.mark.parametrize(("setting", "reason"), [
    (("timing.round_s", 10.0), "cannot set 'timing.round_s'"),  # the simulation's own section
    (("aggregation", 1.0), "cannot set 'aggregation'"),
    (("aggregation.outer_lr.x", 1.0), "cannot set 'aggregation.outer_lr.x'"),
    (("aggregation.outer_lrr", 1.0), r"aggregation.outer_lrr: no such field in \[aggregation\]"),
    (("aggregation.outer_lr", -1.0), "aggregation.outer_lr: Input should be greater than 0"),
    (("training.inner_steps", "5"), "training.inner_steps: Input should be a valid integer"),
    (("submission.topk", 42), "topk must be a multiple of 4"),
])
def test_a_bad_setting_is_refused_naming_it(setting: tuple[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        SimSettings(spec_settings=(setting,))


def test_settings_land_in_the_spec_and_kept_state_in_every_miner_config(tmp_path: Path) -> None:
    settings = SimSettings(validators=1, miners=2, adversaries=("noise",), inner_steps=5, keep_optimizer=True,
                           spec_settings=(("aggregation.outer_lr", 2.5), ("aggregation.top_g", 8),
                                          ("training.inner_steps", 7)))
    sim = Simulation(tmp_path / "sim", settings)
    sim.prepare()
    assert sim.network is not None and not any(n.proc for n in sim.nodes.values())
    spec = load_spec(sim.network.spec_path)
    assert (spec.aggregation.outer_lr, spec.aggregation.top_g, spec.aggregation.momentum) == (2.5, 8, 0.0)
    assert spec.training.inner_steps == 7  # a setting comes after --inner-steps, so it wins
    miners = [n for n in sim.nodes.values() if n.role == "miner"]
    assert [n.kind for n in miners] == ["honest", "noise"]
    for n in miners:
        config = load_config(n.directory / "config.toml")
        assert config.miner.keep_optimizer is True
        assert config.miner.behaviour == n.kind
    for n in sim.nodes.values():
        if n.role == "validator":
            assert "miner" not in tomllib.loads((n.directory / "config.toml").read_text())


def test_simulate_set_and_keep_optimizer_reach_the_settings(tmp_path: Path, simulate_settings: list[SimSettings],
                                                            capsys) -> None:
    argv = ["simulate", "--dir", str(tmp_path / "sim"), "--set", "aggregation.outer_lr=2.5",
            "--set", "submission.format=pgrad", "--keep-optimizer"]
    assert main(argv) == 1
    [settings] = simulate_settings
    assert settings.spec_settings == (("aggregation.outer_lr", 2.5), ("submission.format", "pgrad"))
    assert settings.keep_optimizer is True
    assert main(["simulate", "--dir", str(tmp_path / "sim")]) == 1
    assert (simulate_settings[-1].spec_settings, simulate_settings[-1].keep_optimizer) == ((), False)
    assert "stopped before writing anything" in capsys.readouterr().err


def test_simulate_refuses_a_malformed_setting_before_writing_anything(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--dir", str(tmp_path / "sim"), "--set", "outer_lr"])
    assert exit_info.value.code == 2
    assert "spec setting 'outer_lr': write it as section.field=value" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()


def test_simulate_refuses_a_value_the_spec_would_refuse_before_writing_anything(tmp_path: Path, capsys) -> None:
    assert main(["simulate", "--dir", str(tmp_path / "sim"), "--set", "aggregation.outer_lr=-1"]) == 2
    assert "spec setting aggregation.outer_lr: Input should be greater than 0" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()


def test_simulate_adversaries_are_the_comma_separated_kinds(tmp_path: Path, simulate_settings: list[SimSettings],
                                                            capsys) -> None:
    assert main(["simulate", "--dir", str(tmp_path / "sim"), "--miners", "4", "--adversaries", "noise, copier,"]) == 1
    assert main(["simulate", "--dir", str(tmp_path / "sim")]) == 1
    assert [s.adversaries for s in simulate_settings] == [("noise", "copier"), ()]
    assert "stopped before writing anything" in capsys.readouterr().err
