"""tests/scheduling.py's scheduler, driven as pytest-xdist's controller drives it, with workers that record the
files they are handed."""

from __future__ import annotations

from types import SimpleNamespace

from tests.scheduling import LongFilesApart

LONG, LONGER = "tests/integration/test_unlike_validators.py", "tests/bench/test_network_benchmarks.py"  # long


class Worker:
    def __init__(self) -> None:
        self.gateway = SimpleNamespace(id=f"gw{id(self)}")
        self.shutting_down = False
        self.handed: list[list[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.handed.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def scheduled(collection: list[str], workers: int = 1) -> tuple[LongFilesApart, list[Worker], list[str]]:
    config = SimpleNamespace(getvalue={"tx": [f"{workers}*popen"]}.__getitem__,
                             option=SimpleNamespace(loadscopereorder=False))
    scheduler = LongFilesApart(config)  # type: ignore[arg-type]
    nodes = [Worker() for _ in range(workers)]
    for node in nodes:
        scheduler.add_node(node)  # type: ignore[arg-type]
        scheduler.add_node_collection(node, collection)  # type: ignore[arg-type]
    scheduler.schedule()
    return scheduler, nodes, collection


def files(worker: Worker, collection: list[str]) -> list[str]:
    return [collection[indices[0]].split("::")[0] for indices in worker.handed]


def test_a_worker_is_handed_its_next_file_when_it_holds_one_test() -> None:
    scheduler, [worker], collection = scheduled(["tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3", "tests/b.py::t"])
    assert files(worker, collection) == ["tests/a.py"]
    scheduler.mark_test_complete(worker, 0)  # type: ignore[arg-type]
    assert files(worker, collection) == ["tests/a.py"]  # two left: it runs the first, knowing the next
    scheduler.mark_test_complete(worker, 1)  # type: ignore[arg-type]
    assert files(worker, collection) == ["tests/a.py", "tests/b.py"]


def test_a_worker_whose_last_test_is_of_a_long_file_takes_the_last_file_in_the_queue() -> None:
    scheduler, [worker], collection = scheduled([f"{LONG}::t", f"{LONGER}::t", "tests/a.py::t", "tests/b.py::t"])
    assert files(worker, collection) == [LONG, "tests/b.py"]  # not the simulation, behind the soak
    scheduler.mark_test_complete(worker, 0)  # type: ignore[arg-type]
    assert files(worker, collection) == [LONG, "tests/b.py", LONGER]
    scheduler.mark_test_complete(worker, 3)  # type: ignore[arg-type]
    assert files(worker, collection) == [LONG, "tests/b.py", LONGER, "tests/a.py"]
    scheduler.mark_test_complete(worker, 1)  # type: ignore[arg-type]
    assert worker.shutting_down  # nothing left to hand it: it ends after a.py's test
