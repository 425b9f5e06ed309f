"""node.cli.common's argparse types and output check: `--seed` takes exactly a round seed, and an output
file that exists or cannot be written is refused in one line before any work, leaving nothing behind, and
a result is written whole, never over a file that appeared while the work ran."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from node.cli.common import DEFAULT_SEED, check_output_file, round_seed, write_new_file
from node.cli.main import main


def test_round_seed_takes_64_hex_digits_and_lower_cases_them() -> None:
    assert round_seed(DEFAULT_SEED) == DEFAULT_SEED
    assert round_seed("AB" * 32) == "ab" * 32
    for bad in ("xyz", "", "0" * 63, "0" * 65, "g" * 64, " " + "0" * 63, "0x" + "0" * 62):
        with pytest.raises(argparse.ArgumentTypeError, match="a round seed is exactly 64 hex digits"):
            round_seed(bad)


@pytest.mark.parametrize("command", [["eval", "--spec", "spec.toml"],
                                     ["export", "--spec", "spec.toml", "--blob", "b", "--out", "o"]])
def test_a_bad_seed_is_a_usage_error(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--seed", "xyz"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "argument --seed: a round seed is exactly 64 hex digits, got 'xyz'" in err


def test_check_output_file_refuses_what_it_must_not_write(tmp_path: Path) -> None:
    taken, dangling = tmp_path / "taken", tmp_path / "dangling"
    taken.write_text("keep")
    dangling.symlink_to(tmp_path / "nowhere")
    cases = [(taken, f"--out {taken}: already exists; choose another path (it is never overwritten)"),
             (dangling, f"--out {dangling}: already exists; choose another path (it is never overwritten)"),
             (tmp_path, f"--out {tmp_path}: is a directory; give a file path"),
             (taken / "x", f"--out {taken / 'x'}: {taken} is not a directory")]
    for path, message in cases:
        with pytest.raises(ValueError) as caught:
            check_output_file(path, "--out")
        assert str(caught.value) == message
    assert taken.read_text() == "keep" and sorted(tmp_path.iterdir()) == [dangling, taken]


def test_check_output_file_leaves_nothing_behind(tmp_path: Path) -> None:
    check_output_file(tmp_path / "new" / "deeper" / "blob", "--out")  # the result's write makes the directories
    (tmp_path / "buffer").write_text("old")
    check_output_file(tmp_path / "buffer", "--feedback", replace=True)
    assert (tmp_path / "buffer").read_text() == "old" and sorted(tmp_path.iterdir()) == [tmp_path / "buffer"]


def test_a_new_file_is_written_whole_and_never_over_one_that_appeared_meanwhile(tmp_path: Path) -> None:
    out = tmp_path / "new" / "blob"
    check_output_file(out, "--out")
    write_new_file(out, b"result", "--out")
    assert out.read_bytes() == b"result"
    with pytest.raises(ValueError) as caught:
        write_new_file(out, b"another", "--out")
    assert str(caught.value) == f"--out {out}: a file appeared there while this ran; it was not overwritten"
    assert out.read_bytes() == b"result" and sorted((tmp_path / "new").iterdir()) == [out]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be made")
def test_check_output_file_tries_the_write_it_will_need() -> None:
    with pytest.raises(ValueError, match=r"^--feedback /proc/fb\.st: cannot write a file there: "):
        check_output_file(Path("/proc/fb.st"), "--feedback", replace=True)
