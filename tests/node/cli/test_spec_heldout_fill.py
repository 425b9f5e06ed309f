"""`tessera spec new` refuses a held-out file that cannot fill one round's subset, in one error line, before
the checkpoint is hashed or loaded (else it would write a spec whose validators and `eval` refuse the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.cli.main import main
from protocol.spec import DataSpec
from tests.training.hub_checkpoint import write_data, write_hub_checkpoint

KEY = "ab" * 32


@pytest.mark.parametrize("extra", [[], ["--seq-len", "16", "--set", "data.heldout_sequences=200"]])
def test_a_heldout_file_too_small_for_a_round_is_refused_before_the_checkpoint_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        extra: list[str]) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = write_data(tmp_path / "data", heldout_docs=6)
    capsys.readouterr()

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checkpoint was hashed or loaded")

    monkeypatch.setattr("training.model.load_checkpoint", never)
    monkeypatch.setattr("training.checkpoint.checkpoint_hash", never)
    out = tmp_path / "net" / "spec.toml"
    code = main([str(a) for a in ["spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                                  "--validator", KEY, "--seq-len", "32", *extra, "--out", out]])
    err = capsys.readouterr().err
    per_round = 200 if extra else DataSpec.model_fields["heldout_sequences"].default
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tessera: error: --heldout {heldout}: packs into "), err
    assert f"and a round scores {per_round} (--heldout-sequences" in err, err
    assert not (tmp_path / "net").exists()
