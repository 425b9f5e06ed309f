"""One running node per data directory and key, across real processes: a second `tessera validator`
on a held directory exits with a one-line error before it opens anything, and a SIGKILLed holder's
locks are free at once."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node.store.lock import AlreadyRunning, NodeLock
from protocol.identity import save_identity
from tests.conftest import make_identity, make_spec_dict, to_toml, write_model_config

ROOT = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from pathlib import Path
from node.store.lock import NodeLock
NodeLock.acquire(Path(sys.argv[1]), Path(sys.argv[2]))
print("locked", flush=True)
time.sleep(120)
"""


def write_validator(tmp_path: Path) -> Path:
    (tmp_path / "spec.toml").write_text(to_toml(make_spec_dict()), encoding="utf-8")
    write_model_config(tmp_path)
    save_identity(make_identity(0), tmp_path / "node.key")
    config = tmp_path / "node.toml"
    config.write_text('[node]\nrole = "validator"\nspec = "spec.toml"\n[http]\nport = 0\n'
                      '[validator]\nheldout = "h.jsonl"\n', encoding="utf-8")
    return config


@pytest.mark.slow
def test_a_node_started_twice_refuses_until_the_first_is_killed(tmp_path: Path) -> None:
    config = write_validator(tmp_path)
    data, key = tmp_path / "data", tmp_path / "node.key"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(data), str(key)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        held = rf"{re.escape(str(data))}: another node is running .* \(pid {holder.pid}\)"
        with pytest.raises(AlreadyRunning, match=held):
            NodeLock.acquire(data, key)
        with pytest.raises(AlreadyRunning, match=f"{re.escape(str(key))}: another running node uses this key"):
            NodeLock.acquire(tmp_path / "copy", key)  # its own directory, the same key
        second = subprocess.run([sys.executable, "-m", "node.cli", "validator", "--config", str(config)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"another node is running on this data directory (pid {holder.pid})" in second.stderr
        assert second.stderr.count("\n") == 1  # one line, no traceback
        assert not (data / "node.db").exists() and not (data / "blobs").exists()  # it opened nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock = NodeLock.acquire(data, key)  # the kernel dropped the killed holder's locks
    assert (data / "node.lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    lock.release()  # a second release does nothing


def test_a_filesystem_that_cannot_lock_gets_a_warning_not_a_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    key = tmp_path / "node.key"
    save_identity(make_identity(0), key)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="node.store.lock"):
        NodeLock.acquire(tmp_path / "data", key).release()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [str(tmp_path / "data" / "node.lock"), str(key)]
