"""`tessera plan`: the JSON it prints for a config.json or a spec, and one-line refusals of bad flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.cli.main import main
from tests.conftest import make_spec_dict, to_toml
from training.tiny import tiny_config


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "olmoe", **tiny_config("olmoe")}), encoding="utf-8")
    return path


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def test_plan_of_a_config_prints_the_peak_its_parts_the_margin_and_what_it_does_not_see(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = plan_json(capsys, "--config", str(config_file), "--role", "miner", "--experts-per-layer", "2",
                       "--seq-len", "16")
    assert {"peak_gib", "parts", "device", "margin_gib", "sees_not"} <= set(result)
    assert result["device"] == "cuda" and result["sees_not"] and result["margin_gib"] >= 1
    assert sum(result["parts"].values()) == result["peak_bytes"] > 0
    assert result["parts"]["trainable_copies"] > 0


@pytest.mark.slow  # two traces; make check traces 8-bit moments once (tests/training/test_plan.py)
def test_plan_traces_the_8bit_optimizer(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--config", str(config_file), "--role", "miner", "--experts-per-layer", "4", "--seq-len", "8")
    fp32 = plan_json(capsys, *args)
    eight = plan_json(capsys, *args, "--optimizer", "adamw8bit")
    assert fp32["optimizer"] == "adamw" and eight["optimizer"] == "adamw8bit"
    assert eight["peak_bytes"] < fp32["peak_bytes"]


def test_plan_traces_a_validators_int8_weights(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--config", str(config_file), "--role", "validator", "--experts-per-layer", "2", "--seq-len", "8")
    held, int8 = plan_json(capsys, *args), plan_json(capsys, *args, "--weights", "int8")
    assert int8["weights"] == "int8" and int8["parts"]["weights"] < held["parts"]["weights"]


def test_plan_of_a_spec_takes_its_group_and_sequence_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny.json").write_text(json.dumps(tiny_config("qwen3_moe")), encoding="utf-8")
    spec = tmp_path / "spec.toml"
    spec.write_text(to_toml(make_spec_dict()), encoding="utf-8")
    result = plan_json(capsys, "--spec", str(spec), "--role", "validator", "--device", "cpu")
    assert result["seq_len"] == 32 and result["device"] == "cpu" and result["parts"]["weights"] > 0


def test_the_table_names_each_part_and_the_plan(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(config_file), "--role", "validator", "--experts-per-layer", "1",
                 "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "peak (forward)" in out and "= plan" in out


@pytest.mark.parametrize(("flags", "named"), [
    (["--micro-batch", "0"], "--micro-batch"),
    (["--seq-len", "1"], "--seq-len"),
    (["--experts-per-layer", "99"], "--config"),
    (["--device", "gpu0"], "--device"),
    (["--fit", "-1"], "--fit"),
    (["--batch-size", "1", "--micro-batch", "2"], "--micro-batch"),
])
def test_a_bad_flag_is_refused_in_one_line_naming_it(
    config_file: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    args = {"--experts-per-layer": "2", "--seq-len": "16"}
    args.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    argv = ["plan", "--config", str(config_file), "--role", "miner", *(x for kv in args.items() for x in kv)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error:") and named in err[0]


def test_a_config_without_a_group_and_an_unknown_role_are_refused(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--config", str(config_file), "--role", "miner", "--seq-len", "16"]) == 2
    assert "--experts-per-layer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(config_file), "--role", "trainer"])
    assert exit_.value.code == 2


@pytest.mark.slow  # several traces
def test_fit_picks_settings_that_fit_keeps_the_ones_given_and_prints_their_config(
    config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--config", str(config_file), "--role", "miner", "--experts-per-layer", "4", "--seq-len", "64",
            "--batch-size", "4", "--optimizer", "adamw")
    roomy = plan_json(capsys, *args, "--fit", "8")
    assert roomy["fit"]["slowdown"] == 1.0 and roomy["micro_batch"] == 4 and roomy["optimizer"] == "adamw"
    assert roomy["step"] == 2 and len(roomy["step_peaks_gib"]) == 2
    budget = (roomy["peak_bytes"] * 0.8 * 1.1 + 1024**3) / 1024**3  # room for four fifths of that peak
    tight = plan_json(capsys, *args, "--fit", f"{budget:.6f}")
    assert tight["total_gib"] <= budget and tight["optimizer"] == "adamw"  # given, so kept
    assert tight["fit"]["slowdown"] >= 1.0 and tight["fit"]["config"][0] == '[miner] forward = "compressed"'
    assert tight["micro_batch"] < 4 or tight["checkpointing"] or tight["step_in_backward"]


def test_fit_with_nothing_that_fits_says_so_in_one_line(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", str(config_file), "--role", "miner", "--experts-per-layer", "2", "--seq-len", "16",
                 "--fit", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: nothing fits 0.5 GiB; the nearest, compressed, ")


@pytest.mark.slow  # two traces
def test_a_validator_over_gpus_is_planned_per_gpu(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--config", str(config_file), "--role", "validator", "--experts-per-layer", "2", "--seq-len", "16")
    one, two = plan_json(capsys, *args), plan_json(capsys, *args, "--gpus", "2")
    assert "gpu_total_gib" not in one and len(two["gpu_total_gib"]) == 2 and two["gpus"] == 2
    assert two["parts"]["weights"] < one["parts"]["weights"]
    assert main(["plan", "--config", str(config_file), "--role", "miner", "--experts-per-layer", "2",
                 "--seq-len", "16", "--gpus", "2"]) == 2
    assert "--gpus 2: only a validator" in capsys.readouterr().err
