"""tests/scheduling.py's scheduler, driven as pytest-xdist's controller drives it, with workers that record the
files they are handed."""

from __future__ import annotations

from types import SimpleNamespace

from tests.scheduling import LongFilesApart

SOAK, SIMULATION = "tests/bench/test_soak.py", "tests/bench/test_simulation.py"  # long, and mostly waiting


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
    scheduler, [worker], collection = scheduled([f"{SOAK}::t", f"{SIMULATION}::t", "tests/a.py::t", "tests/b.py::t"])
    assert files(worker, collection) == [SOAK, "tests/b.py"]  # not the simulation, behind the soak
    scheduler.mark_test_complete(worker, 0)  # type: ignore[arg-type]
    assert files(worker, collection) == [SOAK, "tests/b.py", SIMULATION]
    scheduler.mark_test_complete(worker, 3)  # type: ignore[arg-type]
    assert files(worker, collection) == [SOAK, "tests/b.py", SIMULATION, "tests/a.py"]
    scheduler.mark_test_complete(worker, 1)  # type: ignore[arg-type]
    assert worker.shutting_down  # nothing left to hand it: it ends after a.py's test


def test_a_file_that_mostly_waits_is_not_handed_out_while_another_runs() -> None:
    collection = ["tests/a.py::t1", "tests/a.py::t2", "tests/a.py::t3", f"{SOAK}::t1", f"{SOAK}::t2",
                  f"{SOAK}::t3", f"{SIMULATION}::t", "tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t"]
    scheduler, (one, two), collection = scheduled(collection, workers=2)
    assert files(one, collection) == ["tests/a.py"] and files(two, collection) == [SOAK]
    for test in (0, 1):
        scheduler.mark_test_complete(one, test)  # type: ignore[arg-type]
    assert files(one, collection) == ["tests/a.py", "tests/b.py"]  # the soak runs: not the simulation
    for test in (3, 4):
        scheduler.mark_test_complete(two, test)  # type: ignore[arg-type]
    assert files(two, collection) == [SOAK, "tests/c.py"]  # after a long file, the queue's last
    scheduler.mark_test_complete(two, 5)  # type: ignore[arg-type]
    assert files(two, collection) == [SOAK, "tests/c.py", SIMULATION]  # the soak has ended
