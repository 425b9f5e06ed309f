"""`tessera simulate --set SECTION.FIELD=VALUE` and `--family`: a simulation of any spec field it does not
derive from its files (the short rounds the learning benchmark measured) without editing files by hand.

A setting is read as TOML, judged by the spec's own section model before anything is written, and
lands in the prepared network's spec (nothing is started); an adversary's kind lands in its miner's
config and no validator's; `--adversaries` is read as comma-separated kinds."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from node.cli.main import main
from node.runtime.config import MinerSection, load_config
from node.sim.process import SimSettings
from node.sim.run import Simulation
from protocol.spec import load_spec, parse_setting

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def no_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read what `prepare` writes and start no node: the fork server it warms for the nodes (seconds
    of imports in a process of its own) is left out. The simulations that start nodes warm it."""
    monkeypatch.setattr("node.sim.run.warm_up", lambda: None)


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
    (("timing.round_s", 10.0), r"timing.round_s: no such field in \[timing\]"),
    (("timing.train_s", 0.0), "timing.train_s: Input should be greater than or equal to 0.001"),
    (("model.dtype", "int8"), "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    (("model.base_hash", "ab" * 32), "cannot set 'model.base_hash' in a spec: the command derives it from the files "
                                     "it is given; settable in \\[model\\]: dtype"),
    (("data.train", ["x.jsonl"]), "cannot set 'data.train' in a spec: the command derives it"),
    (("data.seq_len", 4), "data.seq_len: Input should be greater than or equal to 8"),
    (("data.heldout_sequences", 0), "data.heldout_sequences: Input should be greater than or equal to 1"),
    (("validators.weight", 2.0), "cannot set 'validators.weight'"),
    (("aggregation", 1.0), "cannot set 'aggregation'"),
    (("aggregation.outer_lr.x", 1.0), "cannot set 'aggregation.outer_lr.x'"),
    (("aggregation.outer_lrr", 1.0), r"aggregation.outer_lrr: no such field in \[aggregation\]"),
    (("aggregation.outer_lr", -1.0), "aggregation.outer_lr: Input should be greater than 0"),
    (("aggregation.outer_lr", math.inf), "aggregation.outer_lr: Input should be a finite number"),
    (("training.inner_steps", "5"), "training.inner_steps: Input should be a valid integer"),
    (("submission.topk", 42), "topk must be a multiple of 4"),
])
def test_a_bad_setting_is_refused_naming_it(setting: tuple[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        SimSettings(spec_settings=(setting,))


def test_settings_land_in_the_spec_and_adversaries_in_their_miner_configs(tmp_path: Path) -> None:
    settings = SimSettings(validators=1, miners=2, adversaries=("noise",), inner_steps=5,
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
    for n in miners:  # an adversary is `tessera miner` playing its kind; its config is an honest miner's
        assert load_config(n.directory / "config.toml").miner == MinerSection()
        assert (n.program, n.args[0]) == (("node.sim.adversaries", "noise") if n.kind == "noise"
                                          else ("node.cli.main", "miner"))
    for n in sim.nodes.values():
        if n.role == "validator":
            assert "miner" not in tomllib.loads((n.directory / "config.toml").read_text())


def test_timing_model_and_data_settings_land_in_the_spec_and_its_network_id(tmp_path: Path) -> None:
    settings = SimSettings(validators=1, miners=1, round_seconds=60.0,
                           spec_settings=(("timing.clock_skew_s", 0.5), ("timing.merge_s", 3.0),
                                          ("model.dtype", "bfloat16"), ("data.seq_len", 48),
                                          ("data.heldout_sequences", 16)))
    sim = Simulation(tmp_path / "sim", settings)
    sim.prepare()
    assert sim.network is not None and sim.schedule is not None
    spec = load_spec(sim.network.spec_path)
    assert (spec.timing.clock_skew_s, spec.timing.merge_s, spec.timing.train_s) == (0.5, 3.0, 54.0)
    assert sim.schedule.round_seconds == spec.timing.round_seconds  # the nodes' clock is the written spec's
    assert (spec.model.dtype, spec.data.seq_len, spec.data.heldout_sequences) == ("bfloat16", 48, 16)
    assert sim.network.network_id == spec.network_id


def test_simulate_set_reaches_the_settings(tmp_path: Path, simulate_settings: list[SimSettings], capsys) -> None:
    argv = ["simulate", "--dir", str(tmp_path / "sim"), "--set", "aggregation.outer_lr=2.5",
            "--set", "submission.format=pgrad"]
    assert main(argv) == 1
    [settings] = simulate_settings
    assert settings.spec_settings == (("aggregation.outer_lr", 2.5), ("submission.format", "pgrad"))
    assert main(["simulate", "--dir", str(tmp_path / "sim")]) == 1
    assert simulate_settings[-1].spec_settings == ()
    assert "stopped before writing anything" in capsys.readouterr().err


def test_simulate_family_reaches_the_settings_and_an_unknown_one_is_refused(
        tmp_path: Path, simulate_settings: list[SimSettings], capsys) -> None:
    assert main(["simulate", "--dir", str(tmp_path / "sim"), "--family", "mixtral"]) == 1
    assert [s.family for s in simulate_settings] == ["mixtral"]
    assert main(["simulate", "--dir", str(tmp_path / "sim"), "--family", "llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("tessera: error: --family must be one of qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v2, "
                       "deepseek_v3, got 'llama'")
    assert not (tmp_path / "sim").exists()


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


@pytest.mark.parametrize(("flags", "match"), [
    (["--base-port", "70000"], "--base-port must be 0 (free ports) or from 1 to 65522"),
    (["--base-port", "65530"], "--base-port must be 0 (free ports) or from 1 to 65522"),
    (["--base-port", "-5"], "--base-port must be 0 (free ports) or from 1 to 65522"),
    (["--validators", "1", "--miners", "0", "--base-port", "65533"], "from 1 to 65532"),
    (["--validators", "65"], "a simulation takes 1 to 64 validators, got 65"),
    (["--round-seconds", "nan"], "--round-seconds must be a positive finite number of seconds, got nan"),
    (["--round-seconds", "inf"], "--round-seconds must be a positive finite number of seconds, got inf"),
    (["--round-seconds", "0"], "--round-seconds must be a positive finite number of seconds, got 0.0"),
    (["--train-share", "nan"], "--train-share must be between 0 and 1, got nan"),
    (["--start-delay", "-1"], "--start-delay must be from 0 to 86400 seconds (a day), got -1.0"),
    (["--start-delay", "nan"], "--start-delay must be from 0 to 86400 seconds"),
    (["--start-delay", "1e12"], "--start-delay must be from 0 to 86400 seconds"),
    (["--set", "aggregation.outer_lr=inf"], "spec setting aggregation.outer_lr: Input should be a finite number"),
    (["--set", "aggregation.momentum=nan"], "spec setting aggregation.momentum: Input should be a finite number"),
    (["--set", "timing.clock_skew_s=-1"], "spec setting timing.clock_skew_s: Input should be greater than or equal to 0"),
    (["--set", "model.dtype=fp8"], "spec setting model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    (["--set", "data.seq_len=4"], "spec setting data.seq_len: Input should be greater than or equal to 8"),
    (["--set", "model.family=mixtral"], "cannot set 'model.family' in a spec: the command derives it"),
    (["--family", "llama"], "--family must be one of qwen3_moe"),
])
def test_simulate_refuses_a_bad_flag_naming_it_before_making_or_replacing_the_directory(
        tmp_path: Path, simulate_settings: list[SimSettings], capsys, flags: list[str], match: str) -> None:
    assert main(["simulate", "--dir", str(tmp_path / "sim"), *flags]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sim").exists() and simulate_settings == []
    earlier = tmp_path / "earlier"
    (earlier / "network").mkdir(parents=True)
    (earlier / "network" / "spec.toml").write_text("kept", encoding="utf-8")
    assert main(["simulate", "--dir", str(earlier), "--force", *flags]) == 2
    assert (earlier / "network" / "spec.toml").read_text(encoding="utf-8") == "kept"


def test_simulate_accepts_the_edges_of_each_range(tmp_path: Path, simulate_settings: list[SimSettings]) -> None:
    edges = [["--base-port", "65522"], ["--base-port", "1"], ["--start-delay", "0"], ["--start-delay", "86400"],
             ["--round-seconds", "60"]]
    for flags in edges:
        assert main(["simulate", "--dir", str(tmp_path / "sim"), *flags]) == 1  # the recorder stops it
    assert [(s.base_port, s.start_delay_s, s.round_seconds) for s in simulate_settings] == [
        (65522, None, 80.0), (1, None, 80.0), (0, 0.0, 80.0), (0, 86400.0, 80.0), (0, None, 60.0)]


def test_a_simulation_that_fails_while_writing_leaves_no_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: object) -> None:  # after the network is written, before the nodes' configs
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("node.sim.run.Simulation._add_bootstrap", disk_full)
    sim = Simulation(tmp_path / "sim", SimSettings(validators=1, miners=1))
    with pytest.raises(OSError, match="No space left on device"):
        sim.prepare()
    assert not (tmp_path / "sim").exists() and sim.network is None and sim.nodes == {}


def test_settings_made_without_the_command_line_are_judged_the_same() -> None:
    # bench/simulation.py and tests build SimSettings directly; the checks live there, not in the CLI.
    for fields, match in (({"round_seconds": math.nan}, "--round-seconds must be a positive finite number"),
                          ({"start_delay_s": -1.0}, "--start-delay must be from 0 to 86400 seconds"),
                          ({"base_port": 65530}, "--base-port must be 0 (free ports) or from 1 to 65522")):
        with pytest.raises(ValueError, match=re.escape(match)):
            SimSettings(**fields)
