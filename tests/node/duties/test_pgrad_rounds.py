"""Compressed pseudo-gradients end to end on the in-memory twins (issue 13).

A network whose spec says `[submission] format = "pgrad"` runs two rounds with two validators, two
honest miners and a lazy one: the miners submit compressed blobs (the compressed size, a fraction of
bf16 full experts), the validators rebuild, score and merge them, agree on the state, and the merged
state lowers the held-out loss. The honest miner restarted between the rounds resumes with the
error-feedback buffer its round-0 submission left: its round-1 blob is byte for byte the one that
buffer gives, and not the one an empty buffer gives; its round-0 blob is the one `tessera train`'s
build (no buffer) gives. A network with partitions has each miner send the chunks its id and the round
draw, and the merge moves each entry by the mean of the miners that sent it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miner.model import MinerModel
from miner.settings import MinerSettings
from miner.submission import ErrorFeedback, build_submission
from node.duties.consensus import decode_state
from node.runtime.daemon import Node
from node.sim.twins import Twins
from protocol.rounds import PHASES
from training.blob import PGRAD_FORMAT, decode_blob, decode_header
from training.outer import norm
from training.pgrad import chunk_draw, compressed_bytes, coverage, decode, load_error, pgrad_config
from validator.merge import outer_config

pytestmark = pytest.mark.timeout(240)

SUBMISSION = '\n[submission]\nformat = "pgrad"\nchunk = 1024\ntopk = 32\nquant = "2bit"\npartitions = 1\n'
MINERS = {"miner-0": "honest", "miner-1": "honest", "miner-2": "lazy"}


async def _submission(node: Node, round: int) -> bytes:
    submission = await node.ctx.storage.submission(round)
    assert submission is not None, f"no submission in round {round}"
    data = node.ctx.blobs.read_checked(submission.hash)
    assert data is not None
    return data


async def test_pgrad_rounds_score_merge_agree_and_keep_the_error_buffer_across_a_restart(tmp_path: Path) -> None:
    net = Twins(tmp_path, extra=SUBMISSION)
    cfg = pgrad_config(net.spec)
    assert cfg is not None
    try:
        for name in ("validator-0", "validator-1"):
            await net.start(name)
        for name, behaviour in MINERS.items():
            await net.start(name, behaviour)
        for phase in PHASES:
            await net.phase(0, phase)
        miner0 = net.nodes["miner-0"]
        error0_hash = await miner0.ctx.storage.pgrad_error()
        assert error0_hash is not None
        error0_data = miner0.ctx.blobs.read_checked(error0_hash)
        assert error0_data is not None
        await net.restart("miner-0")  # killed before round 1's TRAIN
        await net.rounds(1, 1)

        model = MinerModel.load(net.spec, net.spec_path)
        payload = compressed_bytes(model.shapes, cfg)
        full_bf16 = 2 * sum(math.prod(shape) for shape in model.shapes.values())
        for r in (0, 1):
            for name in MINERS:
                data = await _submission(net.nodes[name], r)
                header = decode_header(data, net.spec.limits.max_header_bytes)
                assert header.meta.format == PGRAD_FORMAT
                assert sum(info.end - info.begin for info in header.tensors.values()) == payload
        print(f"pgrad payload {payload} B against {full_bf16} B of bf16 experts: {full_bf16 / payload:.1f}x; "
              f"whole blob {len(data)} B: {(full_bf16 + 8) / len(data):.1f}x")
        assert full_bf16 / payload >= 16

        heads = {await net.nodes[name].ctx.storage.head() for name in net.nodes}
        assert len(heads) == 1  # every node adopted the same state
        for r in (0, 1):
            reports = [await net.nodes[v].round_report(r) for v in ("validator-0", "validator-1")]
            assert all(report is not None for report in reports)
            assert reports[0]["proposed_hash"] == reports[1]["proposed_hash"] is not None  # type: ignore[index]
            report = reports[0]
            assert report is not None
            losses = {m["id"]: m for m in report["miners"]}
            for name in ("miner-0", "miner-1"):
                line = losses[net.id(name)]
                assert line["verdict"] == "accept" and line["loss"] is not None and line["reward"] > 0, line
            assert losses[net.id("miner-2")]["reward"] == 0  # the lazy miner's zero update earns nothing
            assert report["global_loss"] < report["base_loss"], report  # the merged state lowers the loss

        # The restarted miner's round-1 blob carries its round-0 buffer, not an empty one.
        round1 = await _submission(net.nodes["miner-0"], 1)
        head0 = decode_header(round1, net.spec.limits.max_header_bytes).meta.base
        state = net.nodes["miner-0"].ctx.blobs.read_checked(head0)
        assert state is not None
        _, base = decode_state(state, net.spec, model.shapes)
        feedback = ErrorFeedback(load_error(error0_data, model.shapes))
        kept, _ = build_submission(model, net.id("miner-0"), 1, head0, base, MinerSettings(), feedback=feedback)
        fresh, _ = build_submission(model, net.id("miner-0"), 1, head0, base, MinerSettings(), feedback=ErrorFeedback())
        assert kept == round1
        assert fresh != round1
        # Round 0 starts from no buffer: what `tessera train` (no feedback) writes is what the duty committed.
        first, _ = build_submission(model, net.id("miner-0"), 0, net.spec.model.base_hash, model.genesis.tensors,
                                    MinerSettings())
        assert first == await _submission(net.nodes["miner-0"], 0)
    finally:
        await net.close()


PARTITIONED = '\n[submission]\nformat = "pgrad"\nchunk = 256\ntopk = 64\nquant = "2bit"\npartitions = 3\n'


async def test_a_partitioned_network_moves_each_entry_by_the_miners_that_sent_it(tmp_path: Path) -> None:
    net = Twins(tmp_path, extra=PARTITIONED)
    cfg = pgrad_config(net.spec)
    assert cfg is not None and cfg.partitions == 3
    honest = ("miner-0", "miner-1", "miner-2")
    try:
        for name in ("validator-0", "validator-1"):
            await net.start(name)
        for name in honest:
            await net.start(name)
        for phase in PHASES:
            await net.phase(0, phase)
        await net.phase(1, PHASES[0])  # round 0's votes are counted as round 1 opens
        model = MinerModel.load(net.spec, net.spec_path)
        genesis = model.genesis.tensors
        sent, masks = [], []
        for name in honest:
            draw = chunk_draw(net.spec.network_id, 0, net.id(name))
            data = await _submission(net.nodes[name], 0)
            _, blob = decode_blob(data, net.spec.limits.max_header_bytes)
            assert sum(t.numel() * t.element_size() for t in blob.values()) == compressed_bytes(model.shapes, cfg, draw)
            sent.append(decode(blob, model.shapes, cfg, draw))
            masks.append({n: m.repeat_interleave(math.prod(model.shapes[n]) // m.numel()).reshape(model.shapes[n])
                          for n, m in coverage(model.shapes, cfg, draw).items()})  # per chunk -> per entry
        heads = {await net.nodes[name].ctx.storage.head() for name in net.nodes}
        assert len(heads) == 1
        report = await net.nodes["validator-0"].round_report(0)
        assert report is not None, report
        assert report["global_loss"] < report["base_loss"], report
        assert all(m["reward"] > 0 for m in report["miners"]) and net.spec.aggregation.top_g >= 3  # all merged
        state = net.nodes["validator-0"].ctx.blobs.read_checked(heads.pop())
        assert state is not None
        _, merged = decode_state(state, net.spec, model.shapes)

        # First outer step: Φ' = Φ − lr (1 + μ) g, with each G_i clipped to the median norm first.
        outer = outer_config(net.spec)
        norms = sorted(norm(g) for g in sent)
        scales = [min(1.0, norms[1] / norm(g)) for g in sent]
        checked = 0
        for name in model.shapes:
            count = sum(m[name] for m in masks)
            moved = genesis[name] - merged[name]
            assert bool((moved[count == 0] == 0).all())  # nobody sent these entries: they keep their bytes
            for g, scale, mask in zip(sent, scales, masks, strict=True):
                alone = (count == 1) & (mask[name] == 1)  # this miner alone sent these: no dilution by the others
                expected = outer.lr * (1 + outer.momentum) * scale * g[name][alone]
                assert torch.allclose(moved[alone], expected, atol=1e-6)
                checked += int(alone.sum()) + int((count == 0).sum())
        assert checked > 0
    finally:
        await net.close()
