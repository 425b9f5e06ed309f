"""Spec loading (errors name the field) and key files (mode 0600, never overwritten)."""

from __future__ import annotations

import copy
import os
import typing
from datetime import UTC, datetime, timedelta, timezone

import pytest
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel

from protocol.identity import (
    Identity,
    KeyFileError,
    load_identity,
    load_or_create_identity,
    save_identity,
    verify,
)
from protocol.spec import NetworkSpec, SpecError, apply_settings, load_spec, parse_spec
from tests.conftest import make_identity


def test_valid_spec_round_trips_through_toml(spec_dict, write_spec) -> None:
    spec = load_spec(write_spec(spec_dict))
    assert spec == parse_spec(spec_dict)
    assert spec.group == {0: [1, 3], 1: [0]}
    assert spec.timing.round_seconds == 60
    assert len(spec.network_id) == 64


def test_network_id_ignores_spelling_but_not_content(spec_dict) -> None:
    base = parse_spec(spec_dict).network_id
    respelled = copy.deepcopy(spec_dict)
    respelled["timing"]["train_s"] = 30.0
    respelled["group"] = {"1": [0], "0": [3, 1]}
    respelled["genesis"] = datetime(2026, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    assert parse_spec(respelled).network_id == base
    changed = copy.deepcopy(spec_dict)
    changed["rewards"]["top_k"] = 4
    assert parse_spec(changed).network_id != base


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of a spec model's leaf fields; a list of models is `name[].field` (its first item)."""
    leaves: list[str] = []
    for name, info in model.model_fields.items():
        inner = [a for a in typing.get_args(info.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            leaves += _leaf_fields(info.annotation, f"{prefix}{name}.")
        elif inner and typing.get_origin(info.annotation) is list:
            leaves += _leaf_fields(inner[0], f"{prefix}{name}[].")
        elif inner:  # an optional table: its fields are named as a table's
            leaves += _leaf_fields(inner[0], f"{prefix}{name}.")
        else:
            leaves.append(prefix + name)
    return leaves


LINEAGE = {"genesis": "a1" * 32, "predecessor": "a2" * 32, "document": "a3" * 32, "activation": 3,
           "base": "a4" * 32, "inherits": ["a4" * 32]}
# Each leaf field: (settings that make the fixture's spec a base to change it from, mostly none; another value).
CHANGES: dict[str, tuple[dict[str, object], object]] = {
    "name": ({}, "othernet"),
    "genesis": ({}, datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)),
    "timing.train_s": ({}, 31.0), "timing.commit_s": ({}, 6.0), "timing.reveal_s": ({}, 11.0),
    "timing.evaluate_s": ({}, 11.0), "timing.merge_s": ({}, 6.0), "timing.clock_skew_s": ({}, 1.5),
    "model.family": ({}, "mixtral"),
    "model.checkpoint": ({"model.config": KeyError, "model.checkpoint": "ckpt"}, "other-ckpt"),
    "model.config": ({}, "other.json"), "model.init_seed": ({}, 8), "model.dtype": ({}, "bfloat16"),
    "model.base_hash": ({}, "ef" * 32), "model.config_sha256": ({}, "01" * 32),
    "group": ({}, {"0": [1, 3], "1": [0, 2]}),
    "data.train": ({}, ["train.txt", "more.txt"]), "data.heldout_sha256": ({}, "ee" * 32),
    "data.tokenizer": ({}, "tok"), "data.seq_len": ({}, 64), "data.heldout_sequences": ({}, 16),
    "data.gate_sequences": ({}, 16), "data.general_sha256": ({}, "dd" * 32),
    "training.inner_steps": ({}, 21), "training.lr": ({}, 2e-3), "training.beta1": ({}, 0.656),
    "training.weight_decay": ({}, 0.1), "training.batch_size": ({}, 4), "training.grad_clip": ({}, 0.5),
    "validators[].key": ({}, make_identity(99).node_id), "validators[].weight": ({}, 2.0),
    "rewards.replication": ({}, 1), "rewards.top_k": ({}, 4), "rewards.ema_alpha": ({}, 0.5),
    "rewards.duplicate_cosine": ({}, 0.95),
    "aggregation.top_g": ({}, 2), "aggregation.outer_lr": ({}, 0.7),
    "aggregation.momentum": ({}, 0.9), "aggregation.weighting": ({}, "utility"),
    "aggregation.clip_to_median": ({}, False),
    "aggregation.gate_margin": ({}, 0.01), "aggregation.forgetting_budget": ({}, 0.5),
    "limits.max_message_bytes": ({}, 32768), "limits.max_header_bytes": ({}, 1 << 19),
    "submission.format": ({}, "pgrad"), "submission.chunk": ({}, 128), "submission.topk": ({}, 36),
    "submission.quant": ({}, "int8"), "submission.partitions": ({}, 4),
    "lineage.genesis": ({"lineage": LINEAGE}, "b1" * 32), "lineage.predecessor": ({"lineage": LINEAGE}, "b2" * 32),
    "lineage.document": ({"lineage": LINEAGE}, "b3" * 32), "lineage.activation": ({"lineage": LINEAGE}, 4),
    "lineage.base": ({"lineage": LINEAGE}, "b4" * 32), "lineage.inherits": ({"lineage": LINEAGE}, []),
}


def test_the_changes_below_cover_every_leaf_field_of_the_spec() -> None:
    assert sorted(CHANGES) == sorted(_leaf_fields(NetworkSpec))


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_field_is_in_the_network_id_and_changing_it_changes_the_id(spec_dict, field: str) -> None:
    before, value = CHANGES[field]
    for dotted, held in before.items():
        spec_dict = _set(spec_dict, dotted, held)
    spec = parse_spec(spec_dict)
    *_, name = field.split(".")
    assert f'"{name.removesuffix("[]")}":'.encode() in spec.canonical_bytes()  # written even at its default
    changed = _set(spec_dict, field.replace("[]", ".0"), value)
    assert parse_spec(changed).network_id != spec.network_id


def test_a_genesis_spec_has_no_lineage_in_its_canonical_bytes_so_its_id_did_not_move(spec_dict) -> None:
    spec = parse_spec(spec_dict)
    assert spec.lineage is None and b'"lineage"' not in spec.canonical_bytes()
    assert spec.gossip_id == spec.network_id and spec.root == spec.model.base_hash and spec.first_round == 0
    successor = parse_spec({**spec_dict, "lineage": LINEAGE})
    assert (successor.gossip_id, successor.root, successor.first_round) == ("a1" * 32, "a4" * 32, 3)


def test_genesis_as_iso_string(spec_dict) -> None:
    spec_dict["genesis"] = "2026-01-01T00:00:00Z"
    assert parse_spec(spec_dict).genesis == datetime(2026, 1, 1, tzinfo=UTC)


def _set(data: dict, dotted: str, value: object) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model.base_hash", "not-a-hash"),
        ("model.base_hash", "AB" * 32),
        ("data.heldout_sha256", KeyError),
        ("timing.train_s", "fast"),
        ("timing.commit_s", True),
        ("timing.merge_s", -1),
        ("data.seq_len", "64"),
        ("rewards.top_k", 0),
        ("genesis", "yesterday"),
        ("genesis", datetime(2026, 1, 1)),
        ("name", KeyError),
        ("group", {"x": [1]}),
        ("group", {"0": []}),
        ("unknown_field", 1),
        ("model.checkpoint", "ckpt"),
        ("training.beta1", 1.0),
        ("training.beta1", -0.1),
    ],
)
def test_malformed_spec_names_the_field(spec_dict, field: str, value: object) -> None:
    name = field.split(".")[0] if field.startswith("group") or field == "model.checkpoint" else field
    with pytest.raises(SpecError) as info:
        parse_spec(_set(spec_dict, field, value))
    assert str(info.value).startswith(name), str(info.value)
    assert "\n" not in str(info.value)


def test_duplicate_validator_refused(spec_dict) -> None:
    spec_dict["validators"].append(dict(spec_dict["validators"][0]))
    with pytest.raises(SpecError, match="validators: .*appears twice"):
        parse_spec(spec_dict)


def test_settings_land_over_a_sections_values_and_a_bad_one_changes_nothing(spec_dict) -> None:
    spec_dict["aggregation"] = {"outer_lr": 0.7, "top_g": 3}
    before = copy.deepcopy(spec_dict)
    with pytest.raises(ValueError, match="spec setting aggregation.momentum: Input should be less than 1"):
        apply_settings(spec_dict, [("aggregation.outer_lr", 2.5), ("aggregation.momentum", 1.5)])
    assert spec_dict == before
    apply_settings(spec_dict, [("aggregation.outer_lr", 2.0), ("aggregation.outer_lr", 2.5),
                               ("submission.format", "pgrad")])
    spec = parse_spec(spec_dict)
    assert (spec.aggregation.outer_lr, spec.aggregation.top_g, spec.submission.format) == (2.5, 3, "pgrad")


def test_load_spec_file_errors(tmp_path) -> None:
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\n[timing\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(bad)


def test_key_file_written_0600_and_never_overwritten(tmp_path) -> None:
    path = tmp_path / "keys" / "node.key"
    identity = Identity.from_seed(bytes(32))
    save_identity(identity, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_identity(path).node_id == identity.node_id
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        save_identity(Identity.generate(), path)
    assert load_identity(path).node_id == identity.node_id


def test_key_file_readable_by_others_refused(tmp_path) -> None:
    path = tmp_path / "node.key"
    save_identity(Identity.generate(), path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_identity(path)


def test_key_file_errors(tmp_path) -> None:
    with pytest.raises(KeyFileError, match="keygen"):
        load_identity(tmp_path / "none.key")
    junk = tmp_path / "junk.key"
    junk.write_text("hello")
    os.chmod(junk, 0o600)
    with pytest.raises(KeyFileError, match="not a PEM"):
        load_identity(junk)
    locked = tmp_path / "locked.key"
    locked.write_bytes(Identity.generate().private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    os.chmod(locked, 0o600)
    with pytest.raises(KeyFileError, match="locked.key: the key is encrypted; a node key has no passphrase"):
        load_identity(locked)


def test_a_key_written_by_another_process_meanwhile_is_kept_and_used(tmp_path, monkeypatch) -> None:
    """Two `tessera init` runs on one directory: the one that finishes second must neither replace the
    first one's key (whose node id it printed) nor use another."""
    path = tmp_path / "node.key"
    other = Identity.from_seed(bytes(32))
    fsync = os.fsync

    def racing_fsync(fd: int) -> None:  # the other process saves its key between our check and our write
        fsync(fd)
        if not raced:  # (its own temporary file would be named by its own pid)
            raced.append(True)
            path.write_bytes(other.private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            path.chmod(0o600)

    raced: list[bool] = []

    monkeypatch.setattr(os, "fsync", racing_fsync)
    with pytest.raises(KeyFileError, match="appeared there while this ran; refusing to overwrite"):
        save_identity(Identity.generate(), path)
    assert load_identity(path).node_id == other.node_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.key"]  # no temporary file left
    path.unlink()
    raced.clear()  # the same race on a node's first start: it uses the key that won
    assert load_or_create_identity(path).node_id == other.node_id


def test_load_or_create_is_stable(tmp_path) -> None:
    path = tmp_path / "node.key"
    first = load_or_create_identity(path)
    assert load_or_create_identity(path).node_id == first.node_id


def test_signatures() -> None:
    identity = Identity.from_seed(bytes(range(32)))
    sig = identity.sign(b"data")
    assert verify(identity.node_id, b"data", sig)
    assert not verify(identity.node_id, b"date", sig)
    assert not verify("zz", b"data", sig)
    assert not verify(identity.node_id, b"data", sig[:-1])
