"""How `make test` hands the test files to its four pytest-xdist workers (`-n 4 --dist loadfile`).

A worker runs one file at a time, taking files in collection order, and the suite ends when the worker with the most
left finishes. Collection (`pytest_collection_modifyitems`) puts first the network simulation, minutes of waiting on a
round schedule, and beside it the real-size benchmark's small run (2-3 minutes of commands run one at a time, a core's
work as an in-process test's is: started with the other process files it was the last to end, from 183 s to 355 s of
a 401 s make test). While the network's sixteen processes start and play round 0 the other workers run in-process
tests; the files that start processes of their own (real nodes, benchmarks, commands: LAST) come after them, so they do
not crowd the network's first round. Within each group the files that take longest come first (LONGEST: by their
wall time in a 4-worker make test here), so the workers end together.

The scheduler (`pytest_xdist_make_scheduler`) keeps long files apart. A worker runs a test only once it holds the
next, so it must be handed its next file while it runs its current file's last test. xdist hands it one earlier, at
two tests left, and a worker that took a long file of one to three tests took the next ones at once: the soak,
simulation and round benchmarks (77, 50 and 46 s) ran back to back on one worker, from 206 s to 379 s, while the
other three ended at 330-346 s. Here a worker is handed a file at one test left, and a worker whose last test is of
a long file takes the last file in the queue, a short one, rather than the next long one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

TESTS = Path(__file__).parent
FIRST = ("integration/test_network.py", "bench/test_real_size.py")
LAST = ("integration/", "bench/", "deploy/", "node/cli/")
LONGEST = (
    "bench/test_soak.py", "integration/test_hostile.py", "integration/test_p2p.py", "bench/test_simulation.py",
    "bench/test_round.py", "training/test_allocator.py", "integration/test_clock.py",
    "node/runtime/test_status_page_render.py", "training/test_trainer_memory.py", "training/test_device_memory.py",
    "bench/test_load.py", "bench/test_miner.py", "bench/test_gpu.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if missing := [path for path in (*FIRST, *LONGEST) if not (TESTS / path).is_file()]:
        raise pytest.UsageError(f"tests/scheduling.py names files that are not there: {', '.join(missing)}")

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        if path in FIRST:
            return 0, FIRST.index(path)
        return 2 if path.startswith(LAST) else 1, LONGEST.index(path) if path in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: each file's tests stay together and in order


class LongFilesApart(LoadFileScheduling):
    """`--dist loadfile`, handing a worker its next file at one test left, and a short one after a long file."""

    LONG = frozenset(f"tests/{path}" for path in (*FIRST, *LONGEST))

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        pending = [file for file, tests in self.assigned_work[node].items() for done in tests.values() if not done]
        if len(pending) > 1:
            return
        if pending and pending[0] in self.LONG:
            self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
        self._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    return LongFilesApart(config, log) if config.getvalue("dist") == "loadfile" else None
