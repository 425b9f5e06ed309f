"""A pgrad network's validator fetches a revealed blob with the compressed format's size cap, not the
full-experts one: a blob between the two caps is refused at fetch (never stored, scored "missing"),
while a lazy miner's blob of the right size is fetched and scored as usual."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.duties.miner import Job
from node.sim.adversaries import STRATEGIES, Lazy
from node.sim.twins import Twins
from protocol.rounds import Phase
from training.blob import decode_blob, encode_blob, max_blob_bytes
from training.pgrad import pgrad_config
from validator.checks import Expectation, submission_cap

pytestmark = pytest.mark.timeout(180)

# A small header cap, so the full-experts cap is not dominated by it and a blob fits between the caps.
EXTRA = '\n[submission]\nformat = "pgrad"\n\n[limits]\nmax_header_bytes = 4096\n'


def _caps(spec, shapes) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return submission_cap(spec, shapes), max_blob_bytes(shapes, spec.model.dtype, spec.limits.max_header_bytes)


class Oversize(Lazy):
    """A valid-looking pgrad blob padded with an extra tensor to halfway between the pgrad and full caps."""

    name = "noise"

    def build(self, job: Job) -> bytes:
        spec = job.model.spec
        meta, tensors = decode_blob(super().build(job), spec.limits.max_header_bytes)
        pgrad_cap, full_cap = _caps(spec, job.model.shapes)
        tensors["zz.pad"] = torch.zeros((pgrad_cap + full_cap) // 2, dtype=torch.uint8)
        return encode_blob(tensors, meta)


def test_submission_cap_is_the_formats_own_cap(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=1, extra=EXTRA)
    shapes = {"layers.0.experts.1.down_proj": (64, 32), "layers.0.experts.1.gate_up_proj": (64, 64)}
    cfg = pgrad_config(net.spec)
    assert cfg is not None
    expect = Expectation(network=net.spec.network_id, round=0, miner="m", base="b", group=net.spec.group,
                         shapes=shapes, dtype=net.spec.model.dtype, commitment="c",
                         max_header_bytes=net.spec.limits.max_header_bytes, pgrad=cfg)
    pgrad_cap, full_cap = _caps(net.spec, shapes)
    assert pgrad_cap == expect.max_bytes() < full_cap
    experts = Twins(tmp_path / "experts", validators=1)
    assert submission_cap(experts.spec, shapes) == max_blob_bytes(shapes, experts.spec.model.dtype,
                                                                  experts.spec.limits.max_header_bytes)


async def test_an_oversize_pgrad_blob_is_refused_at_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGIES, "noise", Oversize)
    net = Twins(tmp_path, validators=1, extra=EXTRA)
    try:
        validator = await net.start("validator-0")
        big = await net.start("miner-0", "noise")
        lazy = await net.start("miner-1", "lazy")
        for phase in (Phase.TRAIN, Phase.COMMIT, Phase.REVEAL, Phase.EVALUATE):
            await net.phase(0, phase)
        submissions = {name: await node.ctx.storage.submission(0) for name, node in (("big", big), ("lazy", lazy))}
        assert submissions["big"] is not None and submissions["lazy"] is not None
        pgrad_cap, full_cap = _caps(net.spec, (await big.duties.model.get()).shapes)  # type: ignore[attr-defined]
        assert pgrad_cap < submissions["big"].size <= full_cap  # only the format's own cap refuses it
        assert submissions["lazy"].size <= pgrad_cap

        report = (await validator.ctx.storage.score_reports(0))[net.id("validator-0")]
        entries = {entry.miner: entry for entry in report.entries}
        assert (entries[net.id("miner-0")].verdict, entries[net.id("miner-0")].reason) == ("missing", "missing")
        assert entries[net.id("miner-1")].verdict == "accept"
        assert not validator.ctx.blobs.has(submissions["big"].hash)
        assert validator.ctx.blobs.has(submissions["lazy"].hash)
    finally:
        await net.close()
