"""`tessera train` is the miner: for the same key, round and starting state it writes the very bytes
the miner duty commits to, for round 0 (the base) and for a later round (a global state blob). In a
pgrad network `--feedback FILE` carries the miner's error-feedback buffer from one round to the next
as the duty does; a bad buffer file (a blob, or one in a full-experts network), an `--out` that
exists, is the buffer or cannot be written, or an unusable data file is one error line, exit 2, with
nothing written or overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from miner.model import MinerModel
from miner.settings import MinerSettings
from miner.submission import ErrorFeedback, build_submission, encode_submission
from node.cli.main import main
from node.sim.twins import Twins, identity
from protocol.identity import save_identity
from training.blob import BlobMeta, encode_blob
from training.pgrad import error_bytes

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


PGRAD = '\n[submission]\nformat = "pgrad"\n'


def _train(spec: Path, key: Path, round: int, out: Path, *extra: str) -> int:
    return main(["train", "--spec", str(spec), "--key", str(key), "--round", str(round), "--steps", "2",
                 "--out", str(out), *extra])


def test_tessera_train_carries_the_error_feedback_buffer_across_rounds(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path, extra=PGRAD)
    key, feedback_file = tmp_path / "miner.key", tmp_path / "state" / "feedback.safetensors"
    save_identity(identity("miner-0"), key)
    for r in (0, 1):
        assert _train(net.spec_path, key, r, tmp_path / f"train-{r}.blob", "--feedback", str(feedback_file)) == 0
    capsys.readouterr()

    model = MinerModel.load(net.spec, net.spec_path)
    head, base, me = net.spec.model.base_hash, model.genesis.tensors, identity("miner-0").node_id
    feedback = ErrorFeedback()
    for r in (0, 1):
        kept, result = build_submission(model, me, r, head, base, MinerSettings(), steps=2, feedback=feedback)
        assert (tmp_path / f"train-{r}.blob").read_bytes() == kept, f"round {r}: not the duty's buffered build"
    assert feedback.error is not None and feedback_file.read_bytes() == error_bytes(feedback.error)
    fresh = encode_submission(net.spec, 1, me, head, result.tensors, base)  # round 1 from an empty buffer
    assert (tmp_path / "train-1.blob").read_bytes() != fresh


def _buffer(shapes: dict[str, tuple[int, ...]], damage: str) -> bytes:
    error = {name: torch.zeros(shape) for name, shape in shapes.items()}
    first = sorted(shapes)[0]
    if damage == "junk":
        return b"not a safetensors file"
    if damage == "names":
        error[f"{first}.extra"] = torch.zeros(2)
    elif damage == "shape":
        error[first] = torch.zeros(3, 3)
    elif damage == "nan":
        error[first][0, 0] = float("nan")
    elif damage == "unmarked":  # expert weights of the group's names, fp32 and shapes, saved by hand
        return safetensors.torch.save(error)
    return error_bytes(error)


@pytest.mark.parametrize(("damage", "says"), [
    ("junk", "not a safetensors error-feedback buffer"),
    ("names", "names other tensors than the expert group"),
    ("shape", "is not fp32 of shape"),
    ("nan", "holds non-finite values"),
    ("unmarked", "not an error-feedback buffer (its metadata does not name tessera-error-feedback/1)"),
])
def test_tessera_train_refuses_a_bad_feedback_file(tmp_path: Path, capsys, damage: str, says: str) -> None:
    net = Twins(tmp_path, extra=PGRAD)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    shapes = MinerModel.load(net.spec, net.spec_path).shapes
    feedback_file, out = tmp_path / "feedback.safetensors", tmp_path / "out.blob"
    feedback_file.write_bytes(_buffer(shapes, damage))
    before = feedback_file.read_bytes()
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out, "--feedback", str(feedback_file)) == 2
    assert not out.exists() and feedback_file.read_bytes() == before
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: error: {feedback_file}: ") and says in err and err.count("\n") == 1, err


def test_tessera_train_refuses_feedback_in_a_full_experts_network(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    feedback_file, out = tmp_path / "feedback.safetensors", tmp_path / "out.blob"
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out, "--feedback", str(feedback_file)) == 2
    assert not out.exists() and not feedback_file.exists()
    err = capsys.readouterr().err
    assert err == "tessera: error: --feedback: this network submits full experts, which keep no error-feedback buffer\n"


def test_tessera_train_refuses_a_blob_as_the_feedback_file_and_leaves_it_whole(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path, extra=PGRAD)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    model = MinerModel.load(net.spec, net.spec_path)
    meta = BlobMeta(network=net.spec.network_id, round=0, miner=identity("miner-0").node_id,
                    base=net.spec.model.base_hash, group=dict(net.spec.group))
    blob = tmp_path / "miner.blob"  # fp32 experts of the group's names and shapes: load_error alone takes them
    blob.write_bytes(encode_blob({name: torch.zeros(shape) for name, shape in model.shapes.items()}, meta))
    before, out = blob.read_bytes(), tmp_path / "out.blob"
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out, "--feedback", str(blob)) == 2
    assert not out.exists() and blob.read_bytes() == before
    err = capsys.readouterr().err
    assert err == (f"tessera: error: {blob}: a tessera-experts/1 blob, not an error-feedback buffer; give "
                   "--feedback the buffer file an earlier run kept, or a new path\n")


def test_tessera_train_refuses_out_and_feedback_on_one_file(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path, extra=PGRAD)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    shared = tmp_path / "shared.safetensors"
    assert _train(net.spec_path, tmp_path / "miner.key", 0, shared, "--feedback", str(tmp_path / "." / shared.name)) == 2
    assert not shared.exists()
    err = capsys.readouterr().err
    assert err == (f"tessera: error: --out {shared}: the same file as --feedback; the blob and the buffer need "
                   "their own files\n")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be made")
def test_tessera_train_refuses_an_unwritable_feedback_path_before_writing_the_blob(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path, extra=PGRAD)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    out = tmp_path / "out.blob"
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out, "--feedback", "/proc/feedback.safetensors") == 2
    assert not out.exists() and not list(tmp_path.glob(".*"))
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: --feedback /proc/feedback.safetensors: cannot write a file there: ")
    assert err.count("\n") == 1, err


def test_tessera_train_never_overwrites_its_out_file(tmp_path: Path, capsys) -> None:
    net = Twins(tmp_path)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    out = tmp_path / "out.blob"
    out.write_bytes(b"an earlier round's blob")
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out) == 2
    assert out.read_bytes() == b"an earlier round's blob"
    assert capsys.readouterr().err == (f"tessera: error: --out {out}: already exists; choose another path "
                                       "(it is never overwritten)\n")
    assert _train(net.spec_path, tmp_path / "miner.key", 0, tmp_path) == 2
    assert capsys.readouterr().err == f"tessera: error: --out {tmp_path}: is a directory; give a file path\n"


@pytest.mark.parametrize(("content", "says"), [
    (b"", "the data file holds no documents"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 text (byte 0xe9 at offset 28)"),
])
def test_tessera_train_names_the_data_file_it_cannot_use(tmp_path: Path, capsys, content: bytes, says: str) -> None:
    net = Twins(tmp_path)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    data, out = tmp_path / "train.jsonl", tmp_path / "out.blob"
    data.write_bytes(content)
    assert _train(net.spec_path, tmp_path / "miner.key", 0, out, "--data", str(data)) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: error: {data}") and says in err and err.count("\n") == 1, err


def test_tessera_train_takes_the_miners_memory_settings_as_flags(tmp_path: Path, capsys) -> None:
    """Checkpointing and micro-batches change no number; 8-bit moments and the step in backward train too."""
    net = Twins(tmp_path)
    save_identity(identity("miner-0"), tmp_path / "miner.key")
    base = ["train", "--spec", str(net.spec_path), "--key", str(tmp_path / "miner.key"), "--round", "0",
            "--steps", "2"]
    runs = {"plain": [], "checkpointed": ["--checkpointing", "--micro-batch", "2"],
            "8-bit": ["--optimizer", "adamw8bit"], "in backward": ["--step-in-backward"]}
    printed = {}
    for name, flags in runs.items():
        assert main([*base, *flags, "--out", str(tmp_path / f"{name}.blob")]) == 0
        printed[name] = json.loads(capsys.readouterr().out)
    assert printed["checkpointed"]["first_loss"] == pytest.approx(printed["plain"]["first_loss"], rel=1e-6)
    assert printed["checkpointed"]["last_loss"] == pytest.approx(printed["plain"]["last_loss"], rel=1e-5)
    assert all(p["steps"] == 2 for p in printed.values())
    for flags, says in ((["--micro-batch", "0"], "--micro-batch must be from 1"),
                        (["--micro-batch", "1", "--step-in-backward"], "--step-in-backward")):
        assert main([*base, *flags, "--out", str(tmp_path / "refused.blob")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tessera: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "refused.blob").exists()
