"""bench/soak.py's readings (bench/network.py's `sample`) and growth arithmetic: a real process read through
/proc, and slopes on hand-made series that start with a warm-up. The benchmark end to end is in
test_network_benchmarks.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bench import network
from node.sim.process import SimNode
from node.store.blobs import BlobStore
from tests.bench.scripts import load_bench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    """bench/soak.py as a module (bench/ is a directory of scripts, not a package)."""
    return load_bench("soak")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the soak benchmark reads /proc")
def test_a_reading_sees_the_process_memory_files_and_its_data_directory(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "data" / "blobs")
    for i in range(3):
        store.put_bytes(bytes([i]) * 2**20)
    (tmp_path / "data" / "node.db").write_bytes(b"y" * 2**19)
    # holds 100 MiB and 20 extra open files
    script = ("import sys, time; b = bytearray(100 * 2**20); b[::4096] = b'1' * len(b[::4096]); "
              "f = [open(sys.executable, 'rb') for _ in range(20)]; print('ready', flush=True); time.sleep(60)")
    node = SimNode("miner-0", "miner", "honest", "0" * 64, tmp_path, [], None)
    node.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert node.proc.stdout is not None and node.proc.stdout.readline() == b"ready\n"
        reading = network.sample(node)
    finally:
        node.kill()
    assert reading is not None
    assert reading["rss_mib"] >= 100 and reading["peak_rss_mib"] >= reading["rss_mib"]
    assert reading["fds"] >= 23  # stdin, stdout, stderr and the 20 files
    assert reading["threads"] >= 1
    assert reading["data_mib"] == pytest.approx(3.5)
    assert reading["blobs"] == 3
    assert "metrics_rss_mib" not in reading  # no HTTP port: nothing to scrape
    assert network.sample(node) is None  # no longer running


def test_growth_is_read_after_the_warm_up(soak: ModuleType) -> None:
    def readings(rss: list[float]) -> list[dict[str, float]]:
        return [{"round": r, "rss_mib": v, "peak_rss_mib": v, "fds": 40, "threads": 12, "data_mib": 5.0 + (r < 3),
                 "blobs": 6} for r, v in enumerate(rss)]

    flat = [100.0, 400.0, 410.0, 409.0, 411.0, 410.0, 409.0, 411.0]  # the allocator settles in round 1
    leaking = [100.0, 400.0, 410.0, 420.0, 430.0, 440.0, 450.0, 460.0]  # 10 MiB a round, for ever
    summary = soak.summarise({"flat": readings(flat), "leaking": readings(leaking)}, warmup=3)
    assert abs(summary["flat"]["rss_mib"]["per_round"]) < 0.5
    assert summary["leaking"]["rss_mib"]["per_round"] == pytest.approx(10.0)
    assert summary["leaking"]["rss_mib"]["at_warmup"] == 420.0 and summary["leaking"]["rss_mib"]["at_end"] == 460.0
    assert summary["flat"]["rss_mib"]["max"] == 411.0 and summary["flat"]["peak_rss_mib"] == 411.0
    assert summary["flat"]["data_mib"]["per_round"] == 0.0  # the first rounds' extra megabyte is before the warm-up
    assert soak.growth([3], [1.0]) == 0.0
