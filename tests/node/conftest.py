"""Fixtures shared by the tests of tests/node."""

from __future__ import annotations

from pathlib import Path

import pytest

import node.sim.run
from node.sim.process import SimSettings
from node.sim.run import SimulationError


@pytest.fixture
def simulate_settings(monkeypatch: pytest.MonkeyPatch) -> list[SimSettings]:
    """The settings `tessera simulate` makes its Simulation with, in order. A recorder stands in for
    node.sim.run.Simulation and stops at prepare, so nothing is written or started."""
    made: list[SimSettings] = []

    class Recorder:
        def __init__(self, directory: Path, settings: SimSettings) -> None:
            made.append(settings)
            self.network = None

        def prepare(self) -> None:
            raise SimulationError("stopped before writing anything")

        def close(self) -> None:
            pass

    monkeypatch.setattr(node.sim.run, "Simulation", Recorder)
    return made
