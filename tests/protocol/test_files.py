"""The one atomic write (`protocol.files`): a file or a directory appears whole or not at all, a file is never
written over another where it must not be, also on a filesystem without hard links, and nothing is left behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from protocol.files import staged_directory, write_file


def _no_hard_links(monkeypatch: pytest.MonkeyPatch, code: int = errno.EPERM) -> None:
    def link(src: object, dst: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", link)


def test_a_file_replaces_another_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    write_file(path, b"old contents")
    write_file(path, b"new")
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["b.json"]


@pytest.mark.parametrize("code", [None, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK], ids=["hard links", "EPERM",
                                                                                           "EOPNOTSUPP", "EMLINK"])
def test_without_replace_a_file_is_never_written_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      code: int | None) -> None:
    if code is not None:
        _no_hard_links(monkeypatch, code)
    path = tmp_path / "out.json"
    write_file(path, b"first", replace=False, mode=0o600)
    assert path.read_bytes() == b"first" and os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        write_file(path, b"second", replace=False)
    assert path.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_without_hard_links_a_dangling_symlink_is_not_written_through(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hard_links(monkeypatch)
    path = tmp_path / "out.json"
    path.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        write_file(path, b"data", replace=False)
    assert path.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_write_that_fails_leaves_the_old_file_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        hard_links: bool) -> None:
    if not hard_links:
        _no_hard_links(monkeypatch)
    path = tmp_path / "out.json"
    write_file(path, b"old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_file(path, b"new")
    with pytest.raises(OSError, match="No space left"):
        write_file(tmp_path / "fresh.json", b"new", replace=False)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_directory_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "out"
    with staged_directory(out) as staging:
        (staging / "a.txt").write_text("a")
        assert not out.exists()
    assert [p.name for p in out.iterdir()] == ["a.txt"]

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError), staged_directory(failed) as staging:
        (staging / "a.txt").write_text("a")
        raise RuntimeError("the work failed")
    assert not failed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["deep"]

    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_directory(empty) as staging:
        (staging / "b.txt").write_text("b")
    assert [p.name for p in empty.iterdir()] == ["b.txt"]
    with pytest.raises(OSError), staged_directory(empty) as staging:  # a directory with something in it stays
        (staging / "c.txt").write_text("c")
    assert [p.name for p in empty.iterdir()] == ["b.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["deep", "empty"]
