"""Round and phase arithmetic on a manual timeline."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.rounds import PHASES, Phase, Schedule
from protocol.spec import NetworkSpec

G = 1_000_000.0
SCHEDULE = Schedule(G, train_s=30, commit_s=5, reveal_s=10, evaluate_s=10, merge_s=5, clock_skew_s=1)


def test_from_spec_copies_timing(spec: NetworkSpec) -> None:
    schedule = Schedule.from_spec(spec)
    assert schedule.genesis_ts == spec.genesis.timestamp()
    assert schedule.round_seconds == 60
    assert schedule.clock_skew_s == 1.0


def test_round_start_and_round_at() -> None:
    assert SCHEDULE.round_start(0) == G
    assert SCHEDULE.round_start(3) == G + 180
    assert SCHEDULE.round_at(G) == 0
    assert SCHEDULE.round_at(G + 59.999) == 0
    assert SCHEDULE.round_at(G + 60) == 1
    with pytest.raises(ValueError, match="before genesis"):
        SCHEDULE.round_at(G - 0.001)
    with pytest.raises(ValueError, match="round"):
        SCHEDULE.round_start(-1)


@pytest.mark.parametrize(
    ("offset", "phase"),
    [
        (0, Phase.TRAIN),
        (29.9, Phase.TRAIN),
        (30, Phase.COMMIT),
        (35, Phase.REVEAL),
        (45, Phase.EVALUATE),
        (55, Phase.MERGE),
        (59.99, Phase.MERGE),
    ],
)
def test_phase_at(offset: float, phase: Phase) -> None:
    assert SCHEDULE.phase_at(G + 120 + offset) == (2, phase)


def test_phase_windows_tile_the_round() -> None:
    windows = [SCHEDULE.phase_window(4, p) for p in PHASES]
    assert windows[0][0] == SCHEDULE.round_start(4)
    assert windows[-1][1] == SCHEDULE.round_start(5)
    for (_, end), (start, _) in zip(windows, windows[1:], strict=False):
        assert end == start
    assert SCHEDULE.phase_window(4, Phase.REVEAL) == (G + 240 + 35, G + 240 + 45)


def test_next_phase_start() -> None:
    assert SCHEDULE.next_phase_start(G - 100) == (0, Phase.TRAIN, G)
    assert SCHEDULE.next_phase_start(G) == (0, Phase.COMMIT, G + 30)
    assert SCHEDULE.next_phase_start(G + 57) == (1, Phase.TRAIN, G + 60)


def test_invalid_lengths_refused() -> None:
    with pytest.raises(ValueError, match="commit phase length"):
        Schedule(G, train_s=1, commit_s=0, reveal_s=1, evaluate_s=1, merge_s=1)
    with pytest.raises(ValueError, match="clock skew"):
        Schedule(G, train_s=1, commit_s=1, reveal_s=1, evaluate_s=1, merge_s=1, clock_skew_s=-1)
    with pytest.raises(ValueError, match="genesis must be a finite timestamp, got inf"):
        Schedule(float("inf"), train_s=1, commit_s=1, reveal_s=1, evaluate_s=1, merge_s=1)


lengths = st.floats(min_value=0.01, max_value=5000, allow_nan=False)


@given(
    genesis=st.floats(min_value=0, max_value=2e9),
    parts=st.tuples(lengths, lengths, lengths, lengths, lengths),
    dt=st.floats(min_value=0, max_value=1e7),
)
def test_phase_at_is_consistent_with_windows(genesis: float, parts: tuple[float, ...], dt: float) -> None:
    schedule = Schedule(genesis, *parts)
    t = genesis + dt
    r, phase = schedule.phase_at(t)
    start, end = schedule.phase_window(r, phase)
    assert start <= t < end
    nr, nphase, nstart = schedule.next_phase_start(t)
    assert nstart == end > t
    assert schedule.phase_at(nstart) == (nr, nphase)
