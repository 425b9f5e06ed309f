"""`tessera` hands freed tensors of 4 MB and more back to the system (node.cli.main.return_freed_memory): with
glibc's default, a thread's heap kept what its freed expert tensors had held, and a real-size validator stayed
2.9 GB above its working set after its merge."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, threading, torch
from node.cli.main import return_freed_memory
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
if sys.argv[1] == 'returned':
    return_freed_memory()
def work():
    held = [torch.randn(2048, 1024) for _ in range(50)]  # 400 MB in 8 MB tensors, as a real-size state holds them
    del held
before = rss()
for _ in range(3):
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
print(rss() - before)
"""


def _kept(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(run.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc")
def test_freed_expert_sized_tensors_leave_the_process() -> None:
    assert _kept("returned") < 40 << 20
    assert _kept("default") > 200 << 20  # what the policy is for: glibc's default keeps them
