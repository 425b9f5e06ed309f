"""Specs that never move: the network id hashes every field, the defaults of fields a file leaves out too, so
`tessera spec new` writes every field and `tessera spec check` names each one a file leaves to this release's
defaults. The test changes a default in the code, as a later release would: the file `spec new` wrote keeps its
network id, and a file that left the field out gets another one, which `spec check` had warned of."""

from __future__ import annotations

import contextlib
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.cli.main import main
from node.sim.layout import to_toml
from protocol.identity import Identity
from protocol.spec import AggregationSpec, NetworkSpec, defaults_left, load_spec, parse_spec, written_out
from tests.conftest import make_spec_dict
from tests.training.hub_checkpoint import write_data, write_hub_checkpoint


@contextlib.contextmanager
def release_default(field: str, value: Any) -> Iterator[None]:
    """`aggregation.<field>` defaults to `value` inside the block, as in a release that changed it."""
    info = AggregationSpec.model_fields[field]
    old = info.default

    def rebuild(default: Any) -> None:
        info.default = default
        AggregationSpec.model_rebuild(force=True)
        NetworkSpec.model_fields["aggregation"].default = AggregationSpec()
        NetworkSpec.model_rebuild(force=True)

    rebuild(value)
    try:
        yield
    finally:
        rebuild(old)


def check(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[str, str]:
    assert main(["spec", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    return out.strip(), err


def test_a_spec_new_spec_keeps_its_network_id_when_a_release_changes_a_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "ckpt"
    write_hub_checkpoint(checkpoint, "qwen3_moe")
    train, heldout = write_data(tmp_path / "data")
    written = tmp_path / "net" / "spec.toml"
    assert main(["spec", "new", "--checkpoint", str(checkpoint), "--train", str(train), "--heldout", str(heldout),
                 "--validator", Identity.from_seed(bytes(32)).node_id, "--top-d", "2", "--timing", "sim",
                 "--seq-len", "32", "--max-sequences", "16", "--out", str(written)]) == 0
    capsys.readouterr()
    data = tomllib.loads(written.read_text(encoding="utf-8"))
    assert defaults_left(data) == []
    assert data["aggregation"]["outer_lr"] == AggregationSpec().outer_lr  # the default, written out
    # The same network as an operator of an earlier release might have written it: [aggregation] left out.
    terse = written.with_name("terse.toml")
    terse.write_text(to_toml({k: v for k, v in data.items() if k != "aggregation"}), encoding="utf-8")
    network_id, note = check(capsys, written)
    assert check(capsys, terse)[0] == network_id and "leaves" not in note
    terse_note = check(capsys, terse)[1].splitlines()[-1]
    left = sum(value is not None for value in AggregationSpec().model_dump().values())  # unset ones stay out
    assert terse_note.startswith(f"tessera: note: {terse} leaves {left} field(s) to the defaults of tessera ")
    assert f"aggregation.outer_lr = {AggregationSpec().outer_lr}" in terse_note and network_id in terse_note

    ours = AggregationSpec().outer_lr
    with release_default("outer_lr", 0.7):
        assert check(capsys, written)[0] == network_id  # written out: the same network
        moved, note = check(capsys, terse)
        assert moved != network_id  # left to the default: another network
        assert "aggregation.outer_lr = 0.7" in note
        assert load_spec(written).aggregation.outer_lr == ours != AggregationSpec().outer_lr == 0.7
    assert check(capsys, terse)[0] == network_id  # the code's default is back


def test_written_out_is_the_same_spec_and_names_no_default(spec_dict: dict[str, Any]) -> None:
    spec = parse_spec(spec_dict)
    left = defaults_left(spec_dict)
    assert ("aggregation.outer_lr", AggregationSpec().outer_lr) in left and ("timing.clock_skew_s", 2.0) not in left
    assert ("validators[0].weight", 1.0) not in left  # the fixture writes each weight
    unset = {"model.config_sha256", "data.general_sha256", "aggregation.forgetting_budget"}
    assert not unset & {name for name, _ in left}  # unset (None) is off in every release: nothing to pin
    again = written_out(spec)
    assert defaults_left(again) == [] and parse_spec(again).network_id == spec.network_id
    weightless = make_spec_dict()
    del weightless["validators"][1]["weight"]
    assert ("validators[1].weight", 1.0) in defaults_left(weightless)
