"""Key files on a filesystem without hard links (some FUSE, SMB and FAT mounts): link(2) fails, and the
key is created in place with O_EXCL, still never over another key and never left half-written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from protocol.identity import Identity, KeyFileError, load_identity, save_identity


def _no_hard_links(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def link(src: str | Path, dst: str | Path) -> None:
        raise OSError(code, os.strerror(code), str(src), None, str(dst))

    monkeypatch.setattr(os, "link", link)


@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK])
def test_a_key_is_written_where_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    _no_hard_links(monkeypatch, code)
    path = tmp_path / "node.key"
    identity = Identity.from_seed(bytes(32))
    save_identity(identity, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_identity(path).node_id == identity.node_id
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        save_identity(Identity.generate(), path)
    assert load_identity(path).node_id == identity.node_id


def test_without_links_a_key_written_meanwhile_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hard_links(monkeypatch, errno.EPERM)
    path = tmp_path / "node.key"
    other = Identity.from_seed(bytes(32))
    fsync = os.fsync

    def racing_fsync(fd: int) -> None:  # another process saves its key between our check and our write
        fsync(fd)
        if not path.exists():
            path.write_bytes(other.private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            path.chmod(0o600)

    monkeypatch.setattr(os, "fsync", racing_fsync)
    with pytest.raises(KeyFileError, match="appeared there while this ran; refusing to overwrite"):
        save_identity(Identity.generate(), path)
    assert load_identity(path).node_id == other.node_id
    assert sorted(tmp_path.iterdir()) == [path]


def test_without_links_a_failed_write_leaves_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hard_links(monkeypatch, errno.ENOTSUP)
    path = tmp_path / "node.key"
    fsync = os.fsync
    calls: list[int] = []

    def disk_full_at_the_key(fd: int) -> None:  # the temporary file syncs; the key itself does not
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", disk_full_at_the_key)
    with pytest.raises(KeyFileError, match=f"cannot write the key file: {os.strerror(errno.ENOSPC)}"):
        save_identity(Identity.generate(), path)
    assert list(tmp_path.iterdir()) == []


def test_other_link_errors_are_still_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_hard_links(monkeypatch, errno.EIO)
    path = tmp_path / "node.key"
    with pytest.raises(KeyFileError, match=f"cannot write the key file: {os.strerror(errno.EIO)}"):
        save_identity(Identity.generate(), path)
    assert list(tmp_path.iterdir()) == []
