"""A node's allocator policy (training.allocator), measured in fresh processes: freed expert-sized tensors leave the
process, whichever thread freed them, where glibc's default kept them; what small allocations freed inside a
heap leaves it at `trim`; every node process sets the policy first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from training import allocator

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")]

PROBE = """
import sys, threading, torch
from training import allocator
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
if sys.argv[1] != 'default':
    allocator.set_policy()
def tensors():
    held = [torch.randn(2048, 1024) for _ in range(50)]  # 400 MB in 8 MB tensors, as a real-size state holds them
    del held
def small():
    held = [torch.randn(256, 1024) for _ in range(400)]  # 400 MB in 1 MB tensors, then all but every 40th freed
    del held[:-1]
    keep.append(held)
    held = [torch.randn(256, 1024) for _ in range(400)]
    keep.extend(held[::40])
keep = []
before = rss()
for _ in range(3):
    thread = threading.Thread(target=small if sys.argv[1] == 'small' else tensors)
    thread.start()
    thread.join()
kept = rss() - before
allocator.trim()
print(kept, kept - (rss() - before))
"""


def _kept(mode: str) -> tuple[int, int]:
    """Bytes the process still held after its threads freed what they allocated, and how many of them `trim`
    handed back."""
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    kept, trimmed = run.stdout.split()
    return int(kept), int(trimmed)


def test_freed_expert_sized_tensors_leave_the_process() -> None:
    assert _kept("policy")[0] < 40 << 20
    assert _kept("default")[0] > 200 << 20  # what the policy is for: glibc's default keeps them


def test_trim_hands_back_what_small_allocations_freed_inside_a_heap() -> None:
    kept, trimmed = _kept("small")
    assert kept > 200 << 20, "the freed 1 MB tensors stay with their heaps, below a live one"
    assert trimmed > 200 << 20


ENTRY = """
import sys
import training.allocator
calls = []
training.allocator.set_policy = lambda: calls.append(sys.argv[1]) or True
from importlib import import_module
try:
    import_module(sys.argv[1]).main(['--help'])
except SystemExit:
    pass
print(calls)
"""


@pytest.mark.parametrize("entry", ["node.cli.main", "node.sim.peer"])
def test_every_node_process_sets_the_policy(entry: str) -> None:
    """`tessera` (every command and daemon) and a simulated peer set it as they start."""
    run = subprocess.run([sys.executable, "-c", ENTRY, entry], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.strip().splitlines()[-1] == repr([entry])


def test_growth_trim_trims_only_once_the_process_has_grown_by_the_trim_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resident = [1 << 30]
    trims: list[int] = []

    def trim() -> bool:
        trims.append(resident[0])
        resident[0] -= 32 << 20  # what the trim handed back
        return True

    monkeypatch.setattr(allocator, "_resident_bytes", lambda: resident[0])
    monkeypatch.setattr(allocator, "trim", trim)
    grown = allocator.GrowthTrim()
    resident[0] += allocator.TRIM_THRESHOLD - 1
    grown()
    assert trims == []
    resident[0] += 1
    grown()
    assert trims == [(1 << 30) + allocator.TRIM_THRESHOLD]
    grown()  # measured from where the trim left the process, 32 MiB lower
    assert len(trims) == 1
    resident[0] += allocator.TRIM_THRESHOLD
    grown()
    assert len(trims) == 2
