"""`tessera train` is the miner: for the same key, round and starting state it writes the very bytes
the miner duty commits to, for round 0 (the base) and for a later round (a global state blob)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.cli.main import main
from protocol.identity import save_identity
from tests.node.twins import Twins, identity

pytestmark = pytest.mark.timeout(180)


async def test_tessera_train_writes_the_blob_the_miner_duty_commits_to(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path)
    try:
        for name in ("validator-0", "validator-1", "miner-0"):
            await net.start(name)
        await net.rounds(0, 0)  # round 1's TRAIN trains from round 0's state
        miner = net.nodes["miner-0"]
        head = await miner.ctx.storage.head()
        assert head is not None and head != net.spec.model.base_hash
        submissions = [await miner.ctx.storage.submission(r) for r in (0, 1)]
        duty_blobs = [miner.ctx.blobs.path(s.hash).read_bytes() for s in submissions if s is not None]
        state = miner.ctx.blobs.path(head)
        assert state.is_file() and len(duty_blobs) == 2
    finally:
        await net.close()
    key, spec = tmp_path / "miner-0.key", net.spec_path
    for r, extra in ((0, []), (1, ["--global", str(state)])):
        out = tmp_path / f"train-{r}.blob"
        assert main(["train", "--spec", str(spec), "--key", str(key), "--round", str(r), "--out", str(out),
                     *extra]) == 0
        assert out.read_bytes() == duty_blobs[r], f"round {r}: tessera train and the miner duty differ"
    capsys.readouterr()


def test_tessera_train_refuses_a_global_blob_that_is_not_a_state(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    junk = tmp_path / "junk.blob"
    junk.write_bytes(b"not a blob")
    code = main(["train", "--spec", str(net.spec_path), "--key", str(tmp_path / "miner.key"), "--round", "0",
                 "--global", str(junk), "--out", str(tmp_path / "out.blob")])
    assert code == 2 and not (tmp_path / "out.blob").exists()
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: error: {junk}: state blob: ") and err.count("\n") == 1, err
