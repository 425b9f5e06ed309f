"""How `make test` hands the test files to its six pytest-xdist workers (`-n 6 --dist loadfile`).

The suite is bound by CPU on two cores, so every file that mostly waits on a round schedule runs beside files
that keep the cores busy. Collection (`pytest_collection_modifyitems`) puts first (FIRST) the real networks,
which wait for minutes, and the longest in-process files; then the other in-process files; then the files that
start processes of their own (LAST), longest first (LAST_LONGEST), so they do not crowd the networks' first rounds.
The scheduler (`pytest_xdist_make_scheduler`) hands a worker its next file at one test left (a worker runs a test
only once it holds the next, and xdist's two left let one worker take several long files at once), and after a
long file it hands it the queue's last file, a short one.
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
    "integration/test_network.py", "bench/test_real_size.py", "integration/test_unlike_validators.py",
    "training/test_allocator.py", "training/test_trainer_memory.py", "training/test_device_memory.py",
    "bench/test_network_benchmarks.py", "integration/test_multihost.py", "bench/test_successor.py",
)
LAST = ("integration/", "bench/", "deploy/", "node/cli/")
LAST_LONGEST = (
    "integration/test_full_disk.py", "integration/test_hostile.py", "bench/test_miner.py", "integration/test_p2p.py",
    "node/cli/test_real_checkpoint_cli.py", "integration/test_clock.py", "integration/test_restart.py",
    "bench/test_gpu.py", "integration/test_operator_readme.py", "node/cli/test_inspect_cli.py",
    "bench/test_load.py",
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
    """`--dist loadfile`, handing a worker its next file at one test left, and a short one after a long file."""

    long_files = frozenset(f"tests/{path}" for path in (*FIRST, *LAST_LONGEST))

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        pending = [file for file, tests in self.assigned_work[node].items() for done in tests.values() if not done]
        if len(pending) > 1:
            return
        if pending and pending[0] in self.long_files:  # the queue's last to the head, where xdist takes from
            self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
        self._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: pytest may run with xdist disabled
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadFileScheduling | None:
    return LongFilesApart(config, log) if config.getvalue("dist") == "loadfile" else None
