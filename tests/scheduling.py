"""How `make test` hands the test files to its four pytest-xdist workers (`-n 4 --dist loadfile`).

A worker runs one file at a time, and the suite ends when the last worker finishes. On two cores the suite is bound by
CPU (4-worker runs of 380-440 s here kept the cores busy for 750-780 core-seconds), so what counts is that every file
that mostly waits runs beside files that keep the cores busy.

Collection (`pytest_collection_modifyitems`) puts first (FIRST) the network simulation, minutes of waiting on a round
schedule, and beside it the real-size benchmark's small run (2-3 minutes of commands run one at a time); then the
in-process files that take longest, and the files that mostly wait on a round schedule (WAITING: the soak,
simulation and round benchmarks, the multi-host network), which run among the in-process tests. The other files that start processes of their own (real
nodes, benchmarks, commands: LAST) come after the in-process ones, so they do not crowd the network's first rounds,
the longest first (LAST_LONGEST).

The scheduler (`pytest_xdist_make_scheduler`) hands the files out:
- at one test left. A worker runs a test only once it holds the next, so it needs its next file while it runs its
  current file's last test; xdist hands it one at two tests left, and a worker that took a long file of one to three
  tests took the next ones with it (soak, simulation and round ran back to back on one worker, from 206 s to 379 s,
  while the others ended at 330-346 s);
- after a long file, the last file in the queue, a short one;
- one WAITING file at a time: with two of them at once, the two workers the network and the real-size run leave free
  both waited, and the cores were idle for 43 of 200 core-seconds.
With all three, a 4-worker pytest run here took 379 s, against 403-439 s with the first two alone (three runs, the
same day), its workers ending within 11 s of each other, and the cores idle for 36 core-seconds of 758.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

TESTS = Path(__file__).parent
# The order of the files named here is the docstring's; the others keep pytest's order within their group.
FIRST = (
    "integration/test_network.py", "bench/test_real_size.py",
    "training/test_allocator.py", "node/runtime/test_status_page_render.py", "training/test_trainer_memory.py",
    "training/test_device_memory.py",
    "bench/test_soak.py", "bench/test_simulation.py", "bench/test_round.py", "integration/test_multihost.py",
)
WAITING = ("bench/test_soak.py", "bench/test_simulation.py", "bench/test_round.py",
           "integration/test_multihost.py")  # one at a time
LAST = ("integration/", "bench/", "deploy/", "node/cli/")
LAST_LONGEST = (
    "integration/test_hostile.py", "bench/test_miner.py", "integration/test_p2p.py",
    "node/cli/test_real_checkpoint_cli.py", "integration/test_clock.py", "integration/test_restart.py",
    "bench/test_gpu.py", "node/cli/test_inspect_cli.py", "bench/test_load.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if missing := [path for path in (*FIRST, *LAST_LONGEST) if not (TESTS / path).is_file()]:
        raise pytest.UsageError(f"tests/scheduling.py names files that are not there: {', '.join(missing)}")

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if path in FIRST:
            return 0, FIRST.index(path)
        if not path.startswith(LAST):
            return 1, 0
        return 2, LAST_LONGEST.index(path) if path in LAST_LONGEST else len(LAST_LONGEST)

    items.sort(key=rank)  # stable: each file's tests stay together and in order


class LongFilesApart(LoadFileScheduling):
    """`--dist loadfile`, handing a worker its next file at one test left, a short one after a long file, and one
    WAITING file at a time."""

    long_files = frozenset(f"tests/{path}" for path in (*FIRST, *LAST_LONGEST))
    waiting_files = frozenset(f"tests/{path}" for path in WAITING)

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        pending = [file for file, tests in self.assigned_work[node].items() for done in tests.values() if not done]
        if len(pending) > 1:
            return
        if pending and pending[0] in self.long_files:
            self._first(next(reversed(self.workqueue)))
        elif any(file in self.waiting_files and not all(tests.values())
                 for work in self.assigned_work.values() for file, tests in work.items()):
            self._first(next((file for file in self.workqueue if file not in self.waiting_files), None))
        self._assign_work_unit(node)

    def _first(self, file: str | None) -> None:
        """Moves `file` to the head of the queue, where xdist takes the next file from."""
        if file is not None:
            self.workqueue.move_to_end(file, last=False)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest may run with xdist disabled
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    return LongFilesApart(config, log) if config.getvalue("dist") == "loadfile" else None
