"""`tessera spec successor | sign | offer` as a user types them: a draft of the next group that every node would
take, signatures added in place, an offer answered with the node's verdict; bad input refused in one `tessera:
error:` line naming the flag or file, and no output file written over."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from node.cli.main import main
from node.runtime.http import HttpApi
from node.sim.twins import GENESIS, identity, write_network
from protocol.identity import save_identity
from protocol.spec import load_spec
from protocol.successor import judge_document, load_document


def refused(capsys: pytest.CaptureFixture[str], argv: list[object], match: str) -> None:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and match in err, err


@pytest.fixture
def net(tmp_path: Path) -> Path:
    """The twins' network with its genesis far ahead (no round is in progress), a group file and the next domain."""
    spec = write_network(tmp_path / "net")
    text = spec.read_text(encoding="utf-8").replace(GENESIS.isoformat().replace("+00:00", "Z"), "2099-01-01T00:00:00Z")
    spec.write_text(text, encoding="utf-8")
    (tmp_path / "group.json").write_text(json.dumps({"group": {"0": [3, 7], "1": [0, 4]}, "rule": "gate-mass",
                                                     "data": [{"path": "x", "sha256": "ab" * 32}]}), encoding="utf-8")
    (tmp_path / "bad.json").write_text(json.dumps({"group": {"0": [3, 9]}}), encoding="utf-8")
    for name in ("train2", "heldout2"):
        rows = range(100) if name == "train2" else range(1000, 1060)
        (tmp_path / "net" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"record {i}: qty {i * 7 % 31}"}) + "\n" for i in rows), encoding="utf-8")
    for i in range(2):
        save_identity(identity(f"validator-{i}"), tmp_path / f"validator-{i}.key")
    return spec


def draft_argv(net: Path, out: Path, *extra: object) -> list[object]:
    return ["spec", "successor", "--spec", net, "--round", 3, "--group", net.parent.parent / "group.json",
            "--train", net.parent / "train2.jsonl", "--heldout", net.parent / "heldout2.jsonl", *extra, "--out", out]


def test_a_drafted_document_signed_by_both_validators_is_one_every_node_takes(
        net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "next.toml"
    assert main([str(a) for a in draft_argv(net, out, "--set", "aggregation.forgetting_budget=0.05")]) == 0
    printed = json.loads(capsys.readouterr().out)
    document = load_document(out)
    spec = load_spec(net)
    assert printed["document"] == document.hash and document.predecessor == spec.network_id
    assert (document.group, document.data.train, document.aggregation.forgetting_budget) == (
        {0: [3, 7], 1: [0, 4]}, ["train2.jsonl"], 0.05)
    assert document.selection is not None and document.selection.rule == "gate-mass"
    assert "signed by 0 of 2" in str(judge_document(document, spec, 0, {0: 8, 1: 8}))
    for i in range(2):
        assert main(["spec", "sign", str(out), "--key", str(tmp_path / f"validator-{i}.key")]) == 0
    signed = load_document(out)
    assert signed.hash == document.hash and len(signed.signatures) == 2
    assert judge_document(signed, spec, 0, {0: 8, 1: 8}) is None
    refused(capsys, draft_argv(net, out), f"--out {out}: already exists")  # never written over


@pytest.mark.parametrize(("extra", "argv_change", "match"), [
    ((), {"--round": 0}, "--round 0: the successor must begin after round 0"),
    ((), {"--group": "bad.json"}, "group layer 0: experts [9] do not exist (the model has 8)"),
    (("--set", "timing.train_s=10"), {}, "a successor changes only [data], [training], [rewards], [aggregation], "
                                         "[submission] and the group; [timing] stays the network's"),
    (("--set", "training.lr=-1"), {}, "spec setting training.lr: Input should be greater than 0"),
    ((), {"--heldout": "train2.jsonl"}, "shares"),
    ((), {"--spec": "missing.toml"}, "no such spec file"),
])
def test_a_draft_with_bad_input_is_refused_in_one_line_and_nothing_is_written(
        net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[object, ...],
        argv_change: dict[str, object], match: str) -> None:
    argv = draft_argv(net, tmp_path / "next.toml", *extra)
    for flag, value in argv_change.items():
        at = argv.index(flag) + 1
        argv[at] = value if not isinstance(value, str) else (
            tmp_path / value if flag == "--group" else net.parent / value)
    refused(capsys, argv, match)
    assert not (tmp_path / "next.toml").exists()


def test_a_round_already_begun_is_refused(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = net.read_text(encoding="utf-8").replace("2099-01-01T00:00:00Z", "2020-01-01T00:00:00Z")
    net.write_text(text, encoding="utf-8")
    now = (datetime.now(UTC) - datetime(2020, 1, 1, tzinfo=UTC)).total_seconds()
    current = int(now // load_spec(net).timing.round_seconds)
    refused(capsys, draft_argv(net, tmp_path / "next.toml"), f"--round 3: round {current} is in progress")


def test_sign_refuses_a_file_that_is_no_successor_document(net: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["spec", "sign", net, "--key", tmp_path / "validator-0.key"], "not a successor document")


class _Node:
    """What `tessera spec offer` talks to: a node's HTTP API answering offers with a fixed verdict."""

    def __init__(self, verdict: dict[str, Any]) -> None:
        self.verdict = verdict
        self.offered: list[bytes] = []

    async def offer_successor(self, data: bytes) -> dict[str, Any]:
        self.offered.append(data)
        return self.verdict

    async def status(self) -> dict[str, Any]:
        return {}

    async def rewards(self) -> dict[str, Any]:
        return {}

    async def rounds(self) -> list[dict[str, Any]]:
        return []

    async def round_report(self, round: int) -> dict[str, Any] | None:
        return None

    async def miner(self, miner: str) -> list[dict[str, Any]]:
        return []

    async def metrics_text(self) -> bytes:
        return b""


@pytest.mark.parametrize("verdict", [{"verdict": "accept", "reason": "", "activation": 3},
                                     {"verdict": "refuse", "reason": "signed by 1 of 2 validators"}])
async def test_offer_posts_the_document_and_says_the_node_s_verdict(
        net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], verdict: dict[str, Any]) -> None:
    import asyncio

    out = tmp_path / "next.toml"
    assert main([str(a) for a in draft_argv(net, out)]) == 0
    capsys.readouterr()
    node = _Node(verdict)
    api = await HttpApi.start(node, "127.0.0.1", 0)
    try:
        code = await asyncio.to_thread(main, ["spec", "offer", str(out), "--url", api.url])
    finally:
        await api.close()
    captured = capsys.readouterr()
    assert node.offered == [load_document(out).to_bytes()]
    if verdict["verdict"] == "accept":
        assert code == 0 and json.loads(captured.out)["activation"] == 3
    else:
        assert code == 2 and f"{out}: the node refused it: signed by 1 of 2 validators" in captured.err


def test_offer_to_no_node_is_one_line(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "next.toml"
    assert main([str(a) for a in draft_argv(net, out)]) == 0
    refused(capsys, ["spec", "offer", out, "--url", "http://127.0.0.1:9"], "no answer from the node")
