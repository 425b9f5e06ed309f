"""The daemon on the in-memory network and a ManualClock: it records accepted gossip before its duties
see it, runs the phase duties, serves HTTP, and shuts everything down cleanly."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
from pathlib import Path

import aiohttp
import pytest

import node.runtime.daemon as daemon_module
from node.net.judge import GossipJudge
from node.net.twin import MemoryHub, MemoryNetwork
from node.runtime.clock import ManualClock
from node.runtime.config import NodeConfig, load_config
from node.runtime.context import HeartbeatDuties, NodeContext, history_providers
from node.runtime.daemon import CATCH_UP_WAIT_S, Node
from node.store.blobs import BlobStore
from node.store.db import Storage
from node.store.lock import AlreadyRunning
from node.store.records import Submission
from protocol.identity import Identity, load_identity, save_identity
from protocol.messages import Commit, Envelope, GlobalState, Heartbeat, Message, Reveal, seal
from protocol.rounds import Phase, Schedule
from protocol.spec import NetworkSpec, load_spec, parse_spec
from tests.conftest import make_identity, make_spec_dict, to_toml, write_model_config

VALIDATOR = make_identity(0)
MINER = make_identity(100)
STRANGER = make_identity(101)
WAIT_S = 10.0


class Probe(HeartbeatDuties):
    """Heartbeats like the built-in duty, and notes what storage held when each message arrived."""

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.phases: list[tuple[int, Phase]] = []
        self.messages: asyncio.Queue[tuple[Envelope, list[str]]] = asyncio.Queue()
        self.phase_seen = asyncio.Event()
        self.own: list[Envelope] = []

    async def on_phase(self, round: int, phase: Phase) -> None:
        self.phases.append((round, phase))
        self.phase_seen.set()
        await super().on_phase(round, phase)

    async def on_message(self, envelope: Envelope, message: Message) -> None:
        assert message == envelope.message()
        if envelope.sender == self.ctx.identity.node_id:
            self.own.append(envelope)  # our own envelopes take the same path as everyone else's
            return
        stored = [c.commitment for c in await self.ctx.storage.commits_for(envelope.round)]
        await self.messages.put((envelope, stored))
        if envelope.kind == "reveal":
            raise RuntimeError("a broken duty must not stop the gossip consumer")


def write_node(tmp_path: Path) -> tuple[NodeConfig, NetworkSpec]:
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(to_toml(make_spec_dict()), encoding="utf-8")
    write_model_config(tmp_path)
    save_identity(VALIDATOR, tmp_path / "node.key")
    (tmp_path / "node.toml").write_text(
        '[node]\nrole = "validator"\nspec = "spec.toml"\n[http]\nport = 0\n[validator]\nheldout = "h.jsonl"\n',
        encoding="utf-8")
    return load_config(tmp_path / "node.toml"), load_spec(spec_path)


def join(hub: MemoryHub, spec: NetworkSpec, clock: ManualClock, node_id: str, root: Path) -> MemoryNetwork:
    return hub.join(node_id, GossipJudge(spec, clock.now), BlobStore(root))


@pytest.fixture
async def setup(tmp_path: Path):
    config, spec = write_node(tmp_path)
    clock = ManualClock(spec.genesis_ts + 31)  # round 0, COMMIT
    hub = MemoryHub()
    net = join(hub, spec, clock, VALIDATOR.node_id, tmp_path / "blobs")
    peer = join(hub, spec, clock, MINER.node_id, tmp_path / "peer-blobs")
    node = await Node.create(config, network=net, clock=clock, duties=Probe)
    task = asyncio.create_task(node.run())
    probe: Probe = node.duties  # type: ignore[assignment]
    await asyncio.wait_for(probe.phase_seen.wait(), WAIT_S)
    yield node, probe, peer, hub, clock, spec, task
    node.stop()
    await asyncio.wait_for(task, WAIT_S)


async def test_accepted_messages_are_stored_before_duties_see_them(setup) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    commit = Commit(round=0, commitment="11" * 32)
    await peer.publish(seal(commit, spec.network_id, MINER))
    envelope, stored_then = await asyncio.wait_for(probe.messages.get(), WAIT_S)
    assert envelope.kind == "commit" and envelope.sender == MINER.node_id
    assert stored_then == ["11" * 32]  # already in storage when the duty ran


async def test_rejected_gossip_never_reaches_storage_or_duties(setup) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    forged = seal(GlobalState(round=0, hash="22" * 32, parent="33" * 32, contributors=()), spec.network_id, STRANGER)
    hub.inject(forged.to_bytes(), STRANGER.node_id, to=[VALIDATOR.node_id])  # not a validator: REJECT
    hub.inject(b"{not json", STRANGER.node_id, to=[VALIDATOR.node_id])
    late = seal(Commit(round=0, commitment="44" * 32), spec.network_id, STRANGER)
    clock.advance(6)  # REVEAL: the COMMIT window (plus 1 s skew) is over
    hub.inject(late.to_bytes(), STRANGER.node_id, to=[VALIDATOR.node_id])
    good = seal(Reveal(round=0, commitment="55" * 32, size=10), spec.network_id, MINER)
    hub.inject(good.to_bytes(), MINER.node_id, to=[VALIDATOR.node_id])
    envelope, _ = await asyncio.wait_for(probe.messages.get(), WAIT_S)
    assert envelope.kind == "reveal" and probe.messages.empty()
    assert await node.ctx.storage.global_states() == [] and await node.ctx.storage.commits_for(0) == []
    assert node.ctx.network.reject_counts() == {STRANGER.node_id: 3}
    metrics = node.metrics_text().decode()
    assert 'tessera_messages_total{kind="global_state",verdict="reject"} 1.0' in metrics
    assert f'tessera_peer_rejects_total{{peer="{STRANGER.node_id[:16]}"}} 3.0' in metrics
    # the duty raised on the reveal; the consumer keeps going
    await peer.publish(seal(Heartbeat(round=0, role="miner", head="66" * 32), spec.network_id, MINER))
    envelope, _ = await asyncio.wait_for(probe.messages.get(), WAIT_S)
    assert envelope.kind == "heartbeat"


async def test_phase_duties_publish_heartbeats_and_http_reports(setup) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    received = peer.subscribe(["heartbeat"])
    clock.set(spec.genesis_ts + 35)  # REVEAL: same round, same head, so no second heartbeat
    await asyncio.wait_for(_until(lambda: len(probe.phases) == 2), WAIT_S)
    clock.set(spec.genesis_ts + 60)  # round 1 TRAIN
    beats = [(await received.get(WAIT_S)).envelope.message()]
    if beats[0].round == 0:  # the COMMIT heartbeat may still have been on its way when we subscribed
        beats.append((await received.get(WAIT_S)).envelope.message())
    beat = beats[-1]
    assert isinstance(beat, Heartbeat) and beat.round == 1
    assert beat.role == "validator" and beat.head == spec.model.base_hash
    assert probe.phases == [(0, Phase.COMMIT), (0, Phase.REVEAL), (1, Phase.TRAIN)]
    await asyncio.wait_for(_until(lambda: len(probe.own) == 2), WAIT_S)
    assert [(e.kind, e.round) for e in probe.own] == [("heartbeat", 0), ("heartbeat", 1)]
    assert {m.sender for m in await node.ctx.storage.messages(1)} == {VALIDATOR.node_id}  # recorded too
    assert node.http is not None
    async with aiohttp.ClientSession() as session, session.get(f"{node.http.url}/status") as response:
        status = await response.json()
    assert status["role"] == "validator" and status["node_id"] == VALIDATOR.node_id
    assert status["network_id"] == spec.network_id
    assert (status["round"], status["phase"], status["peers"]) == (1, "train", 1)
    assert status["head"] is None
    learning = status["learning"]
    assert (learning["format"], learning["inner_steps"], learning["outer_lr"]) == (
        spec.submission.format, spec.training.inner_steps, spec.aggregation.outer_lr)
    await asyncio.wait_for(_until(lambda: len(node.scheduler.runs) == 3), WAIT_S)
    assert [(r.phase, r.ok) for r in node.scheduler.runs] == [("commit", True), ("reveal", True), ("train", True)]


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_clean_shutdown_closes_everything_and_state_survives(setup) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    config, net = node.ctx.config, node.ctx.network
    await peer.publish(seal(Commit(round=0, commitment="77" * 32), spec.network_id, MINER))
    await asyncio.wait_for(probe.messages.get(), WAIT_S)
    while not await node.ctx.storage.phase_runs(0):
        await asyncio.sleep(0.001)
    assert node.http is not None
    url = node.http.url
    node.stop()
    await asyncio.wait_for(task, WAIT_S)
    assert net.closed  # type: ignore[attr-defined]  (the in-memory twin)
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session, session.get(f"{url}/healthz"):
            pass
    store = await Storage.open(config.db_path)
    try:
        assert [c.commitment for c in await store.commits_for(0)] == ["77" * 32]
        assert [r.phase for r in await store.phase_runs(0)] == ["commit"]
    finally:
        await store.close()


async def test_messages_from_several_validators_before_their_windows_say_our_clock_is_behind(setup) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    assert (await node.status())["clock_behind"] is None

    def inject_early(who: Identity) -> None:  # COMMIT of round 0: a reveal is 4 s early, 3 s past the tolerance
        early = seal(Reveal(round=0, commitment="99" * 32, size=10), spec.network_id, who)
        hub.inject(early.to_bytes(), who.node_id, to=[VALIDATOR.node_id])

    for who in (MINER, STRANGER):  # anyone can make keys: early miners say nothing of this node's clock
        inject_early(who)
    assert (await node.status())["clock_behind"] is None
    for who in (make_identity(1), make_identity(2)):  # the two other validators
        inject_early(who)
    assert (await node.status())["clock_behind"] == {"early_validators": 2, "behind_by_at_least_s": 4.0}
    metrics = node.metrics_text().decode()
    assert "tessera_early_validators 2.0" in metrics and "tessera_clock_behind_seconds 4.0" in metrics


async def test_a_message_storage_cannot_record_is_left_out_and_the_node_goes_on(
        setup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    record = node.ctx.storage.record_accepted

    async def full_once(envelope: Envelope, *args: object) -> bool:  # the disk is full for the commit only
        if envelope.kind == "commit":
            raise sqlite3.OperationalError("database or disk is full")
        return await record(envelope, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(node.ctx.storage, "record_accepted", full_once)
    with caplog.at_level("ERROR", logger="node.runtime.daemon"):
        await peer.publish(seal(Commit(round=0, commitment="11" * 32), spec.network_id, MINER))
        await peer.publish(seal(Heartbeat(round=0, role="miner", head="66" * 32), spec.network_id, MINER))
        envelope, _ = await asyncio.wait_for(probe.messages.get(), WAIT_S)
    assert envelope.kind == "heartbeat" and not task.done()  # the commit was left out; the node goes on
    assert await node.ctx.storage.commits_for(0) == []
    assert any("cannot record a commit" in r.getMessage() and "database or disk is full" in r.getMessage()
               for r in caplog.records)
    monkeypatch.undo()  # room again: a peer's history hands the commit on once more, and it is kept
    assert await node.ctx.network.catch_up(0, [MINER.node_id]) == 1
    envelope, _ = await asyncio.wait_for(probe.messages.get(), WAIT_S)
    assert envelope.kind == "commit" and [c.miner for c in await node.ctx.storage.commits_for(0)] == [MINER.node_id]


async def test_a_round_far_past_the_last_one_prunes_nothing_until_the_next(setup) -> None:
    """A clock stepped ten rounds ahead (to be corrected later) must not prune the real round's state."""
    node, probe, peer, hub, clock, spec, task = setup
    storage, round_s = node.ctx.storage, node.ctx.schedule.round_seconds
    await storage.set_own_seed(0, "ab" * 32)
    await storage.set_submission(0, Submission("cd" * 32, 10))
    clock.set(spec.genesis_ts + 10 * round_s + 1)  # round 10 TRAIN; message retention is 8 rounds
    await asyncio.wait_for(_until(lambda: (10, Phase.TRAIN) in probe.phases), WAIT_S)
    await asyncio.wait_for(_until(lambda: any(r.round == 10 for r in node.scheduler.runs)), WAIT_S)
    assert await storage.own_seed(0) == "ab" * 32 and await storage.submission(0) is not None
    clock.set(spec.genesis_ts + 11 * round_s + 1)  # the next round: now it is real, and round 0 ages out
    await asyncio.wait_for(_until(lambda: any(r.round == 11 for r in node.scheduler.runs)), WAIT_S)
    assert await storage.own_seed(0) is None and await storage.submission(0) is None
    assert "tessera_round 11.0" in node.metrics_text().decode()


async def test_the_round_gauge_is_the_round_in_progress_while_its_first_phase_runs(tmp_path: Path) -> None:
    config, spec = write_node(tmp_path)
    clock = ManualClock(spec.genesis_ts + 5 * 60 + 1)  # round 5 TRAIN: a node (re)started there
    release = asyncio.Event()

    class LongTrain(Probe):
        async def on_phase(self, round: int, phase: Phase) -> None:
            await super().on_phase(round, phase)
            await release.wait()  # a miner's TRAIN runs for most of the phase

    hub = MemoryHub()
    join(hub, spec, clock, MINER.node_id, tmp_path / "peer")  # a peer to catch up from, so it does not wait
    node = await Node.create(config, network=join(hub, spec, clock, VALIDATOR.node_id, tmp_path / "b"),
                             clock=clock, duties=LongTrain)
    task = asyncio.create_task(node.run())
    try:
        await asyncio.wait_for(_until(lambda: (5, Phase.TRAIN) in node.duties.phases), WAIT_S)  # type: ignore[attr-defined]
        assert "tessera_round 5.0" in node.metrics_text().decode()  # not 0 until the handler ends
    finally:
        release.set()
        node.stop()
        await asyncio.wait_for(task, WAIT_S)


async def test_a_message_signed_with_our_key_that_we_did_not_send_is_reported(
        setup, caplog: pytest.LogCaptureFixture) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    assert (await node.status())["key_used_elsewhere"] is None

    def twin_commit(round: int) -> None:  # from another node with our key
        twin = seal(Commit(round=round, commitment="88" * 32), spec.network_id, VALIDATOR)
        hub.inject(twin.to_bytes(), MINER.node_id, to=[VALIDATOR.node_id])

    with caplog.at_level("WARNING", logger="node.runtime.daemon"):
        # The node started in round 0 on a new database: a round-0 message may be this key's own from
        # before the data directory was made, so it is logged and not counted.
        twin_commit(0)
        await asyncio.wait_for(_until(lambda: any(e.kind == "commit" for e in probe.own)), WAIT_S)
        assert (await node.status())["key_used_elsewhere"] is None
        clock.set(spec.genesis_ts + 91)  # round 1, COMMIT
        twin_commit(1)
        own = ["commit", "commit", "heartbeat", "heartbeat"]  # its own heartbeats of rounds 0 and 1 too
        await asyncio.wait_for(_until(lambda: sorted(e.kind for e in probe.own) == own), WAIT_S)
    assert (await node.status())["key_used_elsewhere"] == {"messages": 1, "last_kind": "commit", "last_round": 1}
    assert "tessera_key_used_elsewhere_total 1.0" in node.metrics_text().decode()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if "this node's key" in r.getMessage()] == [
        ("WARNING", "round 0: a commit signed with this node's key reached it from the network, and this node has "
                    "no record of sending it; its database is new, so it is probably this key's own from before "
                    "(if another node runs with the key, the next round shows it)"),
        ("ERROR", f"round 1: a commit signed with this node's key reached it from the network, and this node has no "
                  f"record of sending it: another node is running with the key {node.ctx.config.node.key}; stop one "
                  f"of them, or give each its own key (tessera keygen)")]


async def test_a_node_on_a_database_it_had_before_reports_a_twin_in_the_round_it_started(tmp_path: Path) -> None:
    config, spec = write_node(tmp_path)
    clock = ManualClock(spec.genesis_ts + 31)  # round 0, COMMIT
    storage = await Storage.open(config.db_path)  # a node ran here before
    await storage.close()
    hub = MemoryHub()
    net = join(hub, spec, clock, VALIDATOR.node_id, tmp_path / "blobs")
    node = await Node.create(config, network=net, clock=clock, duties=Probe)
    task = asyncio.create_task(node.run())
    try:
        probe: Probe = node.duties  # type: ignore[assignment]
        twin = seal(Commit(round=0, commitment="88" * 32), spec.network_id, VALIDATOR)
        hub.inject(twin.to_bytes(), MINER.node_id, to=[VALIDATOR.node_id])
        await asyncio.wait_for(_until(lambda: any(e.kind == "commit" for e in probe.own)), WAIT_S)
        assert (await node.status())["key_used_elsewhere"] == {"messages": 1, "last_kind": "commit", "last_round": 0}
    finally:
        node.stop()
        await asyncio.wait_for(task, WAIT_S)


async def test_a_node_stopped_while_it_waits_for_a_peer_to_catch_up_from_stops_at_once(tmp_path: Path) -> None:
    config, spec = write_node(tmp_path)
    clock = ManualClock(spec.genesis_ts + 31)  # after genesis, and no peer: it waits CATCH_UP_WAIT_S for one
    node = await Node.create(config, network=join(MemoryHub(), spec, clock, VALIDATOR.node_id, tmp_path / "b"),
                             clock=clock, duties=Probe)
    task = asyncio.create_task(node.run())
    await asyncio.sleep(0.3)
    node.stop()
    await asyncio.wait_for(task, CATCH_UP_WAIT_S / 4)
    assert not node.scheduler.runs  # it never got to run a phase


async def test_network_with_another_identity_is_refused(tmp_path: Path) -> None:
    config, spec = write_node(tmp_path)
    clock = ManualClock(spec.genesis_ts)
    net = join(MemoryHub(), spec, clock, MINER.node_id, tmp_path / "blobs")
    with pytest.raises(ValueError, match="but the key is"):
        await Node.create(config, network=net, clock=clock)


async def test_a_second_node_on_the_same_data_directory_or_key_refuses_to_start(setup, tmp_path: Path) -> None:
    node, probe, peer, hub, clock, spec, task = setup
    config = node.ctx.config
    in_flight = config.blob_dir / "tmp" / "download.part"  # a blob the running node is writing
    in_flight.write_bytes(b"half")
    with pytest.raises(AlreadyRunning, match=rf"another node is running on this data directory \(pid {os.getpid()}\)"):
        await Node.create(config, network=join(MemoryHub(), spec, clock, VALIDATOR.node_id, tmp_path / "b1"),
                          clock=clock)
    assert in_flight.read_bytes() == b"half"  # the refused node swept nothing
    other_dir = config.model_copy(update={"node": config.node.model_copy(update={"data_dir": tmp_path / "other"})})
    with pytest.raises(AlreadyRunning, match="another running node uses this key"):
        await Node.create(other_dir, network=join(MemoryHub(), spec, clock, VALIDATOR.node_id, tmp_path / "b2"),
                          clock=clock)
    assert not other_dir.db_path.exists()  # refused before it opened anything
    node.stop()
    await asyncio.wait_for(task, WAIT_S)
    rejoined = MemoryHub()
    join(rejoined, spec, clock, MINER.node_id, tmp_path / "b4")  # a peer, so the catch-up does not wait for one
    again = await Node.create(config, network=join(rejoined, spec, clock, VALIDATOR.node_id, tmp_path / "b3"),
                              clock=clock, duties=Probe)  # the locks went with the stopped node
    running = asyncio.create_task(again.run())
    clock.set(spec.genesis_ts + 35)  # REVEAL (round 0's COMMIT already ran before the restart)
    await asyncio.wait_for(again.duties.phase_seen.wait(), WAIT_S)  # type: ignore[attr-defined]
    again.stop()
    await asyncio.wait_for(running, WAIT_S)


def test_init_writes_a_config_that_loads_and_a_private_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from node.cli.main import main

    spec_path = tmp_path / "net" / "spec.toml"
    spec_path.parent.mkdir()
    spec_path.write_text(to_toml(make_spec_dict()), encoding="utf-8")
    node_dir = tmp_path / "miner-1"
    assert main(["init", "--role", "miner", "--spec", str(spec_path), "--dir", str(node_dir), "--http-port", "0"]) == 0
    config = load_config(node_dir / "node.toml")
    assert config.node.role == "miner" and config.node.spec == spec_path.resolve()
    assert config.node.key.stat().st_mode & 0o777 == 0o600
    assert "../net/spec.toml" in (node_dir / "node.toml").read_text()  # the directory can move with its spec
    path, node_id = capsys.readouterr().out.split()
    assert Path(path) == node_dir / "node.toml" and node_id == load_identity(config.node.key).node_id
    assert main(["init", "--role", "miner", "--spec", str(spec_path), "--dir", str(node_dir)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["init", "--role", "validator", "--spec", str(spec_path), "--dir", str(tmp_path / "v")]) == 2
    assert "--heldout" in capsys.readouterr().err


def test_init_judges_everything_before_writing_so_a_corrected_rerun_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from node.cli.main import main

    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(to_toml(make_spec_dict()), encoding="utf-8")
    node_dir = tmp_path / "node"
    init = ["init", "--spec", str(spec_path), "--dir", str(node_dir)]
    refusals = (
        (["--role", "miner", "--p2p-port", "-1"], "p2p.port"),
        (["--role", "miner", "--bootstrap", "garbage"], "p2p.bootstrap"),
        (["--role", "validator", "--heldout", str(spec_path)], "but the spec pins data.heldout_sha256"),
        (["--role", "validator", "--heldout", str(tmp_path / "absent.jsonl")], "is not a file"),
    )
    for extra, reason in refusals:
        assert main([*init, *extra]) == 2
        err = capsys.readouterr().err
        assert reason in err and err.count("\n") == 1, err
        assert not node_dir.exists()
    monkeypatch.setenv("TESSERA_HTTP__PORT", "abc")
    assert main([*init, "--role", "miner"]) == 2
    assert "TESSERA_HTTP__PORT (environment): http.port" in capsys.readouterr().err and not node_dir.exists()
    monkeypatch.delenv("TESSERA_HTTP__PORT")
    node_dir.mkdir()
    (node_dir / "node.key").write_text("garbage", encoding="utf-8")
    (node_dir / "node.key").chmod(0o600)
    assert main([*init, "--role", "miner"]) == 2
    assert "node.key" in capsys.readouterr().err and not (node_dir / "node.toml").exists()
    (node_dir / "node.key").unlink()
    assert main([*init, "--role", "miner"]) == 0  # the same directory, corrected
    assert load_config(node_dir / "node.toml").node.role == "miner"


def test_daemon_command_refuses_the_wrong_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from node.cli.main import main

    write_node(tmp_path)
    assert main(["miner", "--config", str(tmp_path / "node.toml")]) == 2
    assert "node.role is 'validator'; run `tessera validator`" in capsys.readouterr().err


async def test_status_command_prints_the_nodes_status(setup, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from node.cli.main import main

    node = setup[0]
    assert await asyncio.to_thread(main, ["status", "--url", node.http.url]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["node_id"] == VALIDATOR.node_id and printed["phase"] == "commit"
    other = tmp_path / "other.toml"  # another config naming this node's port, bound to all interfaces
    other.write_text(f'[node]\nrole = "miner"\nspec = "spec.toml"\n[http]\nhost = "0.0.0.0"\nport = {node.http.port}\n')
    assert await asyncio.to_thread(main, ["status", "--config", str(other)]) == 0
    assert json.loads(capsys.readouterr().out)["node_id"] == VALIDATOR.node_id
    assert await asyncio.to_thread(main, ["status", "--url", "http://127.0.0.1:1", "--timeout", "2"]) == 2
    assert "no answer from the node" in capsys.readouterr().err
    for timeout in ("0", "-1", "nan"):
        assert await asyncio.to_thread(main, ["status", "--url", node.http.url, "--timeout", timeout]) == 2
        assert "--timeout must be a positive number of seconds" in capsys.readouterr().err


def test_nodes_ask_validators_for_history_first_each_in_an_order_of_its_own() -> None:
    validators = [f"{i:064x}" for i in range(1, 4)]
    peers = [*validators, "ee" * 32, "ff" * 32]
    orders = [history_providers(f"{n:064x}", reversed(peers), validators) for n in range(100, 120)]
    assert all(sorted(order[:3]) == validators and sorted(order[3:]) == ["ee" * 32, "ff" * 32] for order in orders)
    assert len({order[0] for order in orders}) == 3  # 20 nodes restarting together do not all ask one validator
    assert orders[0] == history_providers(f"{100:064x}", peers, validators)  # a node's own order is stable


@pytest.mark.parametrize("same_network", [False, True])
async def test_peers_that_send_nothing_of_this_network_for_a_round_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, same_network: bool
) -> None:
    """A peer on another network (another spec or genesis) is connected but its gossip is not this network's:
    after a whole round of that the node says so; a peer of this network that speaks silences it."""
    monkeypatch.setattr(daemon_module, "PEER_WATCH_S", 0.05)
    config, spec = write_node(tmp_path)
    other = spec if same_network else parse_spec({**make_spec_dict(), "name": "another-network"})
    clock = ManualClock(spec.genesis_ts + 1)
    hub = MemoryHub()
    net = join(hub, spec, clock, VALIDATOR.node_id, tmp_path / "blobs")
    peer = join(hub, other, clock, MINER.node_id, tmp_path / "peer-blobs")
    node = await Node.create(config, network=net, clock=clock, duties=Probe)
    task = asyncio.create_task(node.run())
    try:
        await asyncio.wait_for(node.duties.phase_seen.wait(), WAIT_S)  # type: ignore[attr-defined]
        await peer.publish(seal(Heartbeat(round=0, role="miner", head="66" * 32), other.network_id, MINER))
        await asyncio.sleep(0.3)  # the watcher notes the peer
        with caplog.at_level(logging.WARNING, logger="node.runtime.daemon"):
            clock.advance(Schedule.from_spec(spec).round_seconds)
            await asyncio.sleep(0.5)
        said = [r.getMessage() for r in caplog.records if "for a whole round" in r.getMessage()]
        assert said == ([] if same_network else [
            f"p2p: connected to 1 peer(s) for a whole round and no message of network {spec.network_id[:12]} has "
            "arrived: they may run another spec (compare the network ids `tessera spec check` prints), or no "
            "other node of this network is up"]), said
    finally:
        node.stop()
        await asyncio.wait_for(task, WAIT_S)
