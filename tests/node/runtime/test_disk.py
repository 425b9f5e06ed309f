"""What a node's data directory needs for the rounds ahead (node.runtime.disk): the estimate by role and
config, the start-up refusal of a validator that cannot hold one round, the low-space warning, and a full
disk said in one line a round, without a traceback, while other failures keep theirs."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node.runtime.clock import ManualClock
from node.runtime.config import ConfigError, NodeConfig, parse_config
from node.runtime.disk import DATABASE_HEADROOM, MIB, DiskWatch, RoundNeed, round_need
from node.runtime.metrics import NodeMetrics
from node.runtime.preflight import check_disk
from node.runtime.scheduler import Scheduler
from node.store.blobs import BlobStore
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import make_spec_dict

SHAPES = {"layers.0.experts.1.down_proj": (64, 32), "layers.0.experts.1.gate_up_proj": (64, 64)}
ELEMENTS = 64 * 32 + 64 * 64
HEADER = 1 << 20  # the spec's limits.max_header_bytes: a blob's cap counts the largest header peers accept
FP32_BLOB = 8 + HEADER + 4 * ELEMENTS  # a state, a momentum, a float32 network's submission, at their caps
REPORT_CAPACITY = 296  # miners one score report of 64 KiB names


def config(tmp_path: Path, role: str = "validator", extra: str = "") -> NodeConfig:
    heldout = '[validator]\nheldout = "h.jsonl"\n' if role == "validator" and "[validator]" not in extra else ""
    text = f'[node]\nrole = "{role}"\nspec = "spec.toml"\n{heldout}{extra}'
    return parse_config(text, tmp_path / "node.toml")


def spec(**sections: dict[str, Any]) -> NetworkSpec:
    return parse_spec({**make_spec_dict(), **sections})


def test_a_miner_needs_the_adopted_state_and_its_submission_and_in_pgrad_its_feedback(tmp_path: Path) -> None:
    need = round_need(config(tmp_path, "miner"), spec(), SHAPES)
    assert need.blobs == {"the adopted global state": FP32_BLOB, "its submission": FP32_BLOB}
    assert need.round_bytes == 2 * FP32_BLOB and need.kept_rounds == 4  # blob_retention_rounds 3 + this round
    pgrad = round_need(config(tmp_path, "miner"), spec(submission={"format": "pgrad"}), SHAPES)
    assert pgrad.blobs["its error-feedback buffer"] == FP32_BLOB
    assert pgrad.blobs["its submission"] - 8 - HEADER < ELEMENTS  # 40 of 256 entries in half the chunks, and indices


def test_a_validator_needs_its_states_and_the_miners_blobs_it_fetches_within_its_prefetch_budget(
        tmp_path: Path) -> None:
    states = {"its proposed state and momentum": 2 * FP32_BLOB, "the adopted state and momentum": 2 * FP32_BLOB}
    default = round_need(config(tmp_path), spec(), SHAPES)  # prefetch_bytes 8 GiB: as many as a report names
    assert default.blobs == {**states, "miners' blobs": REPORT_CAPACITY * FP32_BLOB}
    ten = round_need(config(tmp_path, extra=f'[validator]\nheldout = "h"\nprefetch_bytes = {10 * FP32_BLOB}\n'),
                     spec(), SHAPES)
    assert ten.blobs["miners' blobs"] == 10 * FP32_BLOB
    none = round_need(config(tmp_path, extra='[validator]\nheldout = "h"\nprefetch_bytes = 0\n'), spec(), SHAPES)
    assert none.blobs["miners' blobs"] == 3 * FP32_BLOB  # still the top_g its merge reads
    kept = round_need(config(tmp_path, extra="[storage]\nblob_retention_rounds = 1\n"), spec(), SHAPES)
    assert kept.kept_rounds == 2


def test_what_the_rounds_ahead_need_is_the_stores_growth_to_the_rounds_it_keeps_and_at_least_a_round() -> None:
    need = RoundNeed("miner", {"a": 10 * MIB, "b": 5 * MIB}, kept_rounds=4, budget_bytes=None)
    assert need.needed(stored=0) == 60 * MIB + DATABASE_HEADROOM  # a new node: four rounds to come
    assert need.needed(stored=30 * MIB) == 30 * MIB + DATABASE_HEADROOM
    assert need.needed(stored=50 * MIB) == 15 * MIB + DATABASE_HEADROOM  # past that: one round, what pruning frees
    budgeted = RoundNeed("miner", {"a": 10 * MIB, "b": 5 * MIB}, kept_rounds=4, budget_bytes=20 * MIB)
    assert budgeted.needed(stored=0) == 20 * MIB + DATABASE_HEADROOM  # fetches stop at the budget
    assert budgeted.needed(stored=20 * MIB) == 15 * MIB + DATABASE_HEADROOM


def test_a_validator_whose_budget_or_disk_cannot_hold_a_round_is_refused_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need = RoundNeed("validator", {"its proposed state and momentum": 40 * MIB, "miners' blobs": 60 * MIB},
                     kept_rounds=4, budget_bytes=None)
    small = config(tmp_path, extra=f"[storage]\nblob_budget_bytes = {99 * MIB}\n")
    with pytest.raises(ConfigError, match=r"^storage\.blob_budget_bytes: 103809024 bytes cannot hold a round") as exc:
        check_disk(small, need)
    assert ("stores up to 104857600 bytes (its proposed state and momentum 40.0 MiB, miners' blobs 60.0 MiB); "
            "raise it to at least 104857600, or lower validator.prefetch_bytes") in str(exc.value)
    check_disk(config(tmp_path, extra=f"[storage]\nblob_budget_bytes = {100 * MIB}\n"), need)  # one round fits

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(total=100 * MIB))
    with pytest.raises(ConfigError, match=r"^node\.data_dir: .* is on a disk of 100\.0 MiB in all") as exc:
        check_disk(config(tmp_path), need)  # a round and the database's headroom do not fit
    assert "put node.data_dir on a larger disk" in str(exc.value)
    check_disk(config(tmp_path, "miner"), need)  # a miner is told once running, not refused


def watch(tmp_path: Path, need: RoundNeed, round_now: Callable[[], int]) -> tuple[DiskWatch, NodeMetrics]:
    metrics = NodeMetrics()
    cfg = config(tmp_path, need.role)
    return DiskWatch(cfg, BlobStore(cfg.blob_dir), need, metrics, round_now), metrics


def test_too_little_room_is_said_once_a_round_and_shown_in_status_and_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    need = RoundNeed("miner", {"the adopted global state": 3 * MIB}, kept_rounds=2, budget_bytes=None)
    current = [0]
    disk, metrics = watch(tmp_path, need, lambda: current[0])
    real = shutil.disk_usage
    free = [1 << 40]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free[0]))
    look = disk.look()
    disk.warn_if_low(look)
    assert not look.low and look.needed_bytes == 6 * MIB + DATABASE_HEADROOM and caplog.text == ""
    assert disk.status(look) == {"path": str(tmp_path / "data"), "free_bytes": 1 << 40,
                                 "needed_bytes": 6 * MIB + DATABASE_HEADROOM, "low": False, "refused": None}

    free[0] = 2 * MIB
    for _ in range(3):  # at start, at TRAIN, when asked: one line a round
        disk.warn_if_low(disk.look())
    current[0] = 1
    disk.warn_if_low(disk.look())
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(":")[0] for r in lines] == ["round 0", "round 1"]
    assert lines[0].getMessage().startswith(
        f"round 0: the disk of {tmp_path / 'data'} has 2.0 MiB free, and the rounds ahead need about 10.0 MiB "
        "(a round stores up to 3.0 MiB: the adopted global state 3.0 MiB; 2 rounds kept, and 4.0 MiB for the "
        "database): free space there or move node.data_dir to a larger disk")
    assert disk.status(disk.look())["low"] is True
    samples = dict(line.split() for line in metrics.render().decode().splitlines() if line.startswith("tessera_disk"))
    assert {name: float(value) for name, value in samples.items()} == {
        "tessera_disk_free_bytes": 2 * MIB, "tessera_disk_needed_bytes": 6 * MIB + DATABASE_HEADROOM}


def full_database_error() -> sqlite3.Error:
    """What SQLite raises on a full disk (SQLITE_FULL), from a database capped at two pages."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA max_page_count = 2")
    try:
        for _ in range(100):
            conn.execute("INSERT INTO t VALUES (?)", (b"x" * 1000,))
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError("the capped database took every row")


async def test_a_phase_failing_on_a_full_disk_is_said_once_a_round_without_a_traceback_and_others_keep_theirs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    schedule = Schedule(1000.0, train_s=30, commit_s=5, reveal_s=10, evaluate_s=10, merge_s=5, clock_skew_s=1)
    clock = ManualClock(1000.0)
    need = RoundNeed("miner", {"the adopted global state": MIB}, kept_rounds=2, budget_bytes=None)
    disk, _ = watch(tmp_path, need, lambda: schedule.round_at(clock.now()))
    full = full_database_error()

    async def handler(r: int, phase: Phase) -> None:
        if r == 0:
            try:
                raise full
            except sqlite3.Error as exc:
                raise RuntimeError("recording the round failed") from exc  # the full disk is its cause
        raise ValueError(f"a bug in round {r} {phase}")

    async def on_run(run: Any) -> None:
        raise OSError(28, "No space left on device")  # the run cannot be recorded either

    scheduler = Scheduler(schedule, clock, handler, on_run, quiet=disk.quiet)
    task = asyncio.create_task(scheduler.run())
    for t in (1000.0, 1030.0, 1035.0, 1045.0, 1055.0, 1060.0):  # round 0's five phases, round 1's TRAIN
        clock.set(t)
        for _ in range(1000):
            await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert [run.ok for run in scheduler.runs] == [False] * 6
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    said = [r for r in errors if "round 0" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None, [r.getMessage() for r in errors]
    assert said[0].getMessage().startswith(
        f"round 0: the disk is full: writing {tmp_path / 'data' / 'node.db'} failed (database or disk is full); "
        f"{tmp_path / 'data'} has ")
    assert "the rounds ahead need about 6.0 MiB: free space there" in said[0].getMessage()
    assert "catches up once there is room" in said[0].getMessage()
    assert disk.refused == {"round": 1, "error": "[Errno 28] No space left on device"}  # round 1's run record
    bug = [r for r in errors if "round 1 train: phase handler failed" in r.getMessage()]
    assert len(bug) == 1 and bug[0].exc_info is not None  # any other failure keeps its traceback
