"""How many miners one ScoreReport can name within a spec's message size, and fitting a report whose
reasons make it too long."""

from __future__ import annotations

import pytest

from protocol.messages import (
    MAX_REPORT_ENTRIES,
    REPORT_REASON_CHARS,
    ScoreEntry,
    ScoreReport,
    fit_report,
    report_bytes,
    report_capacity,
    seal,
)
from tests.conftest import make_identity

H = "ab" * 32
LONGEST_LOSS = 2.2250738585072014e-308


def longest_report(n: int) -> ScoreReport:
    entry = ScoreEntry(miner="f" * 64, commitment="f" * 64, loss=LONGEST_LOSS, verdict="accept")
    return ScoreReport(round=2**40, base=H, base_loss=LONGEST_LOSS, entries=(entry,) * n)


def test_report_bytes_is_the_size_of_the_sealed_envelope() -> None:
    entries = (ScoreEntry(miner=H, commitment=H, loss=2.5, verdict="accept"),
               ScoreEntry(miner="cd" * 32, commitment=H, verdict="reject", reason="hash mismatch"))
    report = ScoreReport(round=7, base=H, base_loss=3.25, entries=entries)
    assert report_bytes(report) == len(seal(report, "ee" * 32, make_identity(0)).to_bytes())


@pytest.mark.parametrize("max_bytes", [2048, 65536])
def test_a_report_at_capacity_fits_and_one_more_entry_does_not(max_bytes: int) -> None:
    n = report_capacity(max_bytes)
    assert n >= 1
    assert report_bytes(longest_report(n)) <= max_bytes < report_bytes(longest_report(n + 1))


def test_capacity_stops_at_the_reports_entry_limit() -> None:
    assert report_capacity(1 << 20) == MAX_REPORT_ENTRIES
    assert report_capacity(65536) == 296  # the default limit


def test_reasons_are_cut_short_or_dropped_until_the_report_fits() -> None:
    entries = tuple(ScoreEntry(miner=f"{i:02x}" * 32, commitment=H, verdict="reject", reason="x" * 200)
                    for i in range(20))
    report = ScoreReport(round=3, base=H, base_loss=3.0, entries=entries)
    assert report_bytes(report) > 6000
    cut = fit_report(report, 6000)
    assert report_bytes(cut) <= 6000 and {e.reason for e in cut.entries} == {"x" * REPORT_REASON_CHARS}
    dropped = fit_report(report, 5000)
    assert report_bytes(dropped) <= 5000 and {e.reason for e in dropped.entries} == {""}
    assert [(e.miner, e.verdict) for e in dropped.entries] == [(e.miner, e.verdict) for e in entries]
    assert fit_report(report, 1 << 20) is report  # it fits: unchanged
