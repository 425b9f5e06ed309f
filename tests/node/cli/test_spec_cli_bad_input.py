"""`tessera spec new` and `tessera spec init --sim` refuse bad input with one error line naming the flag,
file or field, and leave nothing behind: no spec file, no temporary file, no directory.

The cheap checks (numbers, validator weights, settings, data files) come before the checkpoint is
hashed or loaded: they are refused even when the checkpoint does not exist."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import node.cli.spec
from node.cli.main import main
from node.sim.layout import make_sim_network
from tests.training.hub_checkpoint import write_data, write_hub_checkpoint

KEY = "ab" * 32


def refused(capsys: pytest.CaptureFixture[str], argv: list[object], match: str) -> None:
    capsys.readouterr()  # what the test printed before (a checkpoint's writing bar) is not the command's
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err, err


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, Path]:
    train, heldout = write_data(tmp_path / "data")
    (tmp_path / "data" / "empty.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "data" / "blank.txt").write_text("\n\n  \n", encoding="utf-8")
    (tmp_path / "data" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return train, heldout


@pytest.mark.parametrize(("extra", "match"), [
    (["--heldout-sequences", "0"], "--heldout-sequences must be at least 1, got 0"),
    (["--top-d", "0"], "--top-d must be at least 1, got 0"),
    (["--mass", "2"], "--mass must be in (0, 1], got 2.0"),
    (["--mass", "nan"], "--mass must be in (0, 1], got nan"),
    (["--seq-len", "100000"], "--seq-len must be between 8 and 65536"),
    (["--max-sequences", "0"], "--max-sequences must be at least 1, got 0"),
    (["--name", "x" * 65], "a network name has 1 to 64 characters"),
    (["--validator", f"{KEY}:inf"], "the weight must be a positive finite number"),
    (["--validator", f"{KEY}:nan"], "the weight must be a positive finite number"),
    (["--validator", f"{KEY}:0"], "the weight must be a positive finite number"),
    (["--set", "aggregation.outer_lr=inf"], "spec setting aggregation.outer_lr: Input should be a finite number"),
    (["--set", "training.lr=nan"], "spec setting training.lr: Input should be a finite number"),
    (["--set", "aggregation.momentum=1"], "spec setting aggregation.momentum: Input should be less than 1"),
    (["--set", "training.beta1=1"], "spec setting training.beta1: Input should be less than 1"),
    (["--set", "timing.merge_s=0"], "spec setting timing.merge_s: Input should be greater than or equal to 0.001"),
    (["--set", "model.dtype=int8"], "spec setting model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    (["--set", "data.seq_len=100000"], "spec setting data.seq_len: Input should be less than or equal to 65536"),
    (["--set", "data.heldout_sequences=0"], "spec setting data.heldout_sequences: Input should be greater than"),
    (["--set", "data.tokenizer=byte"], "cannot set 'data.tokenizer' in a spec: the command derives it from the files"),
    (["--set", "name=x"], "cannot set 'name' in a spec: give section.field"),
    (["--heldout", "{data}/empty.jsonl"], "--heldout {data}/empty.jsonl: holds no documents"),
    (["--heldout", "{data}"], "--heldout {data}: is a directory"),
    (["--train", "{data}/train.jsonl", "{data}/blank.txt"], "--train {data}/blank.txt: holds no documents"),
    (["--train", "{data}"], "--train {data}: is a directory"),
    (["--heldout", "{data}/train.jsonl"], "--heldout {data}/train.jsonl: held-out data shares"),
    (["--train", "{data}/latin1.txt"], "{data}/latin1.txt:1: not UTF-8 text (byte 0xe9 at offset 3)"),
    (["--validator", f"{KEY}:2"], f"--validator {KEY}: given twice; name each validator once, with its weight"),
    (["--genesis", "2026-01-01"], "--genesis '2026-01-01': give a UTC offset, e.g. 2026-01-01T00:00:00Z"),
])
def test_spec_new_refuses_before_reading_the_checkpoint_and_writes_nothing(
        tmp_path: Path, data: tuple[Path, Path], capsys: pytest.CaptureFixture[str], extra: list[str],
        match: str) -> None:
    train, heldout = data
    folder = str(tmp_path / "data")
    out = tmp_path / "net" / "spec.toml"
    argv: list[object] = ["spec", "new", "--checkpoint", tmp_path / "no-such-checkpoint", "--train", train,
                          "--heldout", heldout, "--validator", KEY, "--timing", "sim",
                          *[e.replace("{data}", folder) for e in extra], "--out", out]
    refused(capsys, argv, match.replace("{data}", folder))
    assert not (tmp_path / "net").exists()


def test_spec_new_judges_the_whole_spec_before_writing_it(
        tmp_path: Path, data: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = data
    capsys.readouterr()
    # A value no option can give, so only the judgement of the complete spec can refuse it.
    monkeypatch.setitem(node.cli.spec.TIMING_PRESETS, "sim", {**node.cli.spec.TIMING_PRESETS["sim"],
                                                               "train_s": math.inf})
    out = tmp_path / "net" / "spec.toml"
    refused(capsys, ["spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                     "--validator", KEY, "--timing", "sim", "--seq-len", "32", "--max-sequences", "16",
                     "--out", out], match="timing.train_s: Input should be a finite number")
    assert not (tmp_path / "net").exists()


@pytest.mark.parametrize(("out", "match"), [
    ("{tmp}/taken.toml", "--out {tmp}/taken.toml: already exists; choose another path (it is never overwritten)"),
    ("{tmp}", "--out {tmp}: is a directory; give a file path"),
    ("/proc/tessera-no-such-dir/spec.toml", "--out /proc/tessera-no-such-dir/spec.toml: cannot write a file there"),
])
def test_spec_new_refuses_an_unusable_out_before_any_work(
        tmp_path: Path, data: tuple[Path, Path], capsys: pytest.CaptureFixture[str], out: str, match: str) -> None:
    train, heldout = data
    (tmp_path / "taken.toml").write_text("# someone's spec\n", encoding="utf-8")
    refused(capsys, ["spec", "new", "--checkpoint", tmp_path / "no-such-checkpoint", "--train", train,
                     "--heldout", heldout, "--validator", KEY, "--out", out.replace("{tmp}", str(tmp_path))],
            match.replace("{tmp}", str(tmp_path)))
    assert (tmp_path / "taken.toml").read_text(encoding="utf-8") == "# someone's spec\n"


def test_spec_new_never_replaces_a_spec_that_appeared_while_it_ran(
        tmp_path: Path, data: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import training.checkpoint

    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = data
    out = tmp_path / "net" / "spec.toml"
    real_hash = training.checkpoint.checkpoint_hash

    def hash_while_another_operator_writes_the_spec(path: Path) -> str:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("# another operator's spec\n", encoding="utf-8")
        return real_hash(path)

    monkeypatch.setattr(training.checkpoint, "checkpoint_hash", hash_while_another_operator_writes_the_spec)
    refused(capsys, ["spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                     "--validator", KEY, "--timing", "sim", "--seq-len", "32", "--max-sequences", "16", "--out", out],
            match=f"--out {out}: a file appeared there while this ran; it was not overwritten")
    assert out.read_text(encoding="utf-8") == "# another operator's spec\n"
    assert [p.name for p in out.parent.iterdir()] == ["spec.toml"]  # no temporary file left


@pytest.mark.parametrize(("flags", "match"), [
    (["--family", "nope"], "unknown model family 'nope'; supported: qwen3_moe"),
    (["--validators", "0"], "a simulation network takes 1 to 64 validators, got 0"),
    (["--validators", "100000"], "a simulation network takes 1 to 64 validators, got 100000"),
])
def test_spec_init_refuses_a_bad_flag_before_making_the_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], match: str) -> None:
    refused(capsys, ["spec", "init", "--sim", tmp_path / "sim", *flags], match=match)
    assert not (tmp_path / "sim").exists()


def test_a_sim_network_that_fails_part_way_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"spec.toml: timing.train_s: Input should be a finite number"):
        make_sim_network(tmp_path / "absent", validators=1, timing={"train_s": math.inf})
    assert not (tmp_path / "absent").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"spec.toml: timing.commit_s: Input should be a finite number"):
        make_sim_network(tmp_path / "empty", validators=1, timing={"commit_s": math.nan})
    assert list((tmp_path / "empty").iterdir()) == []


def test_spec_new_refuses_a_top_d_over_the_checkpoints_experts_before_loading_it(
        tmp_path: Path, data: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = data
    capsys.readouterr()

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr("training.model.load_checkpoint", never)
    out = tmp_path / "net" / "spec.toml"
    refused(capsys, ["spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                     "--validator", KEY, "--top-d", "9", "--seq-len", "32", "--out", out],
            "tessera: error: --top-d 9: the checkpoint has only 8 experts per layer")
    assert not (tmp_path / "net").exists()


def test_spec_check_names_the_spec_whose_group_the_model_cannot_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A group edited by hand to name a layer the model has no experts in is refused naming the file."""
    make_sim_network(tmp_path / "net", validators=1)
    spec = tmp_path / "net" / "spec.toml"
    text = spec.read_text(encoding="utf-8")
    assert "\n[group]\n" in text
    spec.write_text(text.replace("\n[group]\n", "\n[group]\n99 = [0]\n"), encoding="utf-8")
    refused(capsys, ["spec", "check", spec], match=f"{spec}: group layer 99 is not an MoE layer of the model")
