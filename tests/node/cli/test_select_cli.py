"""`tessera select-experts | eval-subset | cluster-data` on a network whose base model has planted routing.

The base is the planted model of tests/training/planted.py saved as a checkpoint: arithmetic tokens
route to experts {U, A}, prose tokens to {U, B}, and every other expert makes the loss much worse.
Commands run in-process through `node.cli.main.main`, so each test pays for torch's import once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from node.cli.main import main
from node.sim.layout import to_toml
from protocol.spec import load_spec
from tests.conftest import make_spec_dict
from tests.training.planted import A, U, planted_domains
from training.checkpoint import checkpoint_hash
from training.corpus import generate, write_documents
from training.data import file_sha256

PLANTED = sorted([U, A])


def tessera(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("select")
    model, _ = planted_domains(harmful=True)
    model.save_pretrained(root / "planted")
    write_documents(root / "data/train.jsonl", generate("arithmetic", 12, seed=1))
    write_documents(root / "data/prose.jsonl", generate("prose", 12, seed=2))
    write_documents(root / "data/heldout.jsonl", generate("arithmetic", 24, seed=3))
    (root / "data/empty.jsonl").write_text("\n", encoding="utf-8")
    spec = make_spec_dict()
    spec["model"] = {"family": "qwen3_moe", "checkpoint": "planted", "base_hash": checkpoint_hash(root / "planted")}
    spec["data"] = {"train": ["data/train.jsonl"], "heldout_sha256": file_sha256(root / "data/heldout.jsonl"),
                    "seq_len": 64, "heldout_sequences": 8, "tokenizer": "byte"}
    (root / "spec.toml").write_text(to_toml(spec), encoding="utf-8")
    return root


def test_select_then_judge_the_group(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    group = tmp_path / "group.json"
    code, out, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                             "--rule", "gate-mass", "--top-d", "2", "--examples", "1", "--mode", "layerwise",
                             "--out", group)
    assert code == 0, err
    assert json.loads(out)["group"] == {"0": PLANTED, "1": PLANTED}
    selection = json.loads(group.read_text())
    assert selection["examples"] == 1 and selection["documents"] == 1 and selection["mode"] == "layerwise"
    assert selection["shared"] == "keep" and selection["model"]["base_hash"] == load_spec(net / "spec.toml").model.base_hash
    assert selection["data"] == [{"path": str(net / "data/train.jsonl"), "sha256": file_sha256(net / "data/train.jsonl")}]

    report = tmp_path / "subset.json"
    code, out, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group,
                             "--fractions", "0.25", "1", "--seeds", "2", "--out", report)
    assert code == 0, err
    assert out.splitlines()[0].split() == ["keep", "experts", "rule", "random", "min", "max"]
    assert "25.00%" in out and "full model:" in out
    result = json.loads(report.read_text())
    quarter, everything = result["curve"]
    assert quarter["kept"] == 2 and len(quarter["random"]) == 2
    assert quarter["rule"] < quarter["random_mean"] - 1.0
    assert everything["rule"] == pytest.approx(result["full"], rel=1e-6)
    assert result["group"]["experts"] == {"0": PLANTED, "1": PLANTED}


def test_into_rewrites_the_spec_group(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = net / "into.toml"
    shutil.copy(net / "spec.toml", target)
    before = load_spec(target)
    code, out, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                             "--rule", "gate-mass", "--top-d", "2", "--examples", "5", "--into", target,
                             "--stability", tmp_path / "stability.json", "--out", tmp_path / "g.json")
    assert code == 0, err
    stability = json.loads((tmp_path / "stability.json").read_text())
    assert sorted(stability["counts"]) == ["1", "10", "5"] and stability["skipped"] == [100]
    assert stability["reference"] == {"0": PLANTED, "1": PLANTED} and stability["documents"] == 12
    assert json.loads(out)["stability"] == {"1": 1.0, "5": 1.0, "10": 1.0}
    after = load_spec(target)
    assert after.group == {0: PLANTED, 1: PLANTED} != before.group
    into = json.loads(out)["into"]
    assert into["network_id_before"] == before.network_id and into["network_id"] == after.network_id
    assert after.network_id != before.network_id and "network id changed" in into["note"]
    assert after.model_dump(exclude={"group"}) == before.model_dump(exclude={"group"})

    other = make_spec_dict()
    other["data"]["tokenizer"] = "byte"
    (net / "other.toml").write_text(to_toml(other), encoding="utf-8")
    untouched = (net / "other.toml").read_bytes()
    code, _, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/prose.jsonl",
                           "--rule", "gate-mass", "--top-d", "2", "--into", net / "other.toml",
                           "--out", tmp_path / "h.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is not the one measured" in err
    assert (net / "other.toml").read_bytes() == untouched and not (tmp_path / "h.json").exists()


def test_cluster_data_separates_the_planted_domains(net: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "clusters"
    code, out, err = tessera(capsys, "cluster-data", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                             net / "data/prose.jsonl", "--max-k", "4", "--out", out_dir)
    assert code == 0, err
    assert json.loads(out)["k"] == 2
    report = json.loads((out_dir / "report.json").read_text())
    assert sorted(c["documents"] for c in report["clusters"]) == [12, 12]
    arithmetic = set(generate("arithmetic", 12, seed=1))
    for entry in report["clusters"]:
        texts = [json.loads(line)["text"] for line in (out_dir / entry["file"]).read_text().splitlines()]
        share = sum(t in arithmetic for t in texts) / len(texts)
        assert max(share, 1 - share) >= 0.9
    code, _, err = tessera(capsys, "cluster-data", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                           "--out", out_dir)
    assert code == 2 and "already exists and is not empty" in err


def test_bad_input_is_one_line_and_exit_2(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = net / "spec.toml"
    select = ("select-experts", "--spec", spec, "--rule", "gate-mass", "--top-d", "2", "--out", tmp_path / "g.json")
    wrong_model = tmp_path / "wrong.json"
    wrong_model.write_text(json.dumps({"group": {"0": [1]}, "stats": {"0": [0.1] * 16}}))
    other_base = tmp_path / "other.json"
    other_base.write_text(json.dumps({"group": {"0": [1]}, "stats": {"0": [0.1] * 8},
                                      "model": {"base_hash": "ef" * 32}}))
    subset = ("eval-subset", "--spec", spec, "--out", tmp_path / "r.json")
    cases = [
        ((*select, "--data", net / "data/empty.jsonl"), "the data file holds no documents"),
        ((*select, "--data", net / "data/train.jsonl", "--examples", "13"), "the data holds only 12 documents"),
        ((*subset, "--group", wrong_model, "--fractions", "0"), "keep fractions must be in (0, 1], got 0"),
        ((*subset, "--group", wrong_model, "--fractions", "1.5"), "keep fractions must be in (0, 1], got 1.5"),
        ((*subset, "--group", wrong_model), "it was made for another model"),
        ((*subset, "--group", other_base), "select again for this model"),
        (("cluster-data", "--spec", spec, "--data", net / "data/empty.jsonl", "--out", tmp_path / "c"),
         "the data file holds no documents"),
    ]
    for args, message in cases:
        code, out, err = tessera(capsys, *args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)
    assert not (tmp_path / "g.json").exists() and not (tmp_path / "r.json").exists() and not (tmp_path / "c").exists()


SELECTION = {"group": {"0": PLANTED, "1": PLANTED}, "stats": {"0": [0.1] * 8, "1": [0.1] * 8}}


@pytest.mark.parametrize(("change", "says"), [
    ({"group": {"0": [5.5], "1": PLANTED}}, "group layer 0: expected a list of expert ids (non-negative integers), "
                                            "got [5.5]"),
    ({"group": {"0": [True], "1": PLANTED}}, "group layer 0: expected a list of expert ids (non-negative integers), "
                                             "got [true]"),
    ({"group": {"0": [-1], "1": PLANTED}}, "group layer 0: expected a list of expert ids (non-negative integers), "
                                           "got [-1]"),
    ({"group": {"0": [1, 1], "1": PLANTED}}, "group layer 0: names an expert twice"),
    ({"group": {"00": PLANTED}}, "group: layer '00' is not a layer number"),
    ({"stats": {"0": [float("nan")] + [0.1] * 7, "1": [0.1] * 8}}, "stats layer 0: expected a list of finite numbers"),
    ({"stats": {"0": [True] * 8, "1": [0.1] * 8}}, "stats layer 0: expected a list of finite numbers"),
    ({"group": [1]}, "not a selection: expected 'group' and 'stats' objects keyed by layer"),
    ({"group": {"0": [8], "1": PLANTED}}, "the selection's layer 0 names experts this model does not have (it has 8); "
                                          "it was made for another model"),
])
def test_a_bad_group_file_is_named_and_nothing_is_written(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          change: dict[str, object], says: str) -> None:
    group, report = tmp_path / "group.json", tmp_path / "report.json"
    group.write_text(json.dumps(SELECTION | change))
    code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group, "--out", report)
    assert (code, err) == (2, f"tessera: error: {group}: {says}\n")
    assert sorted(tmp_path.iterdir()) == [group]


@pytest.mark.parametrize("flag", ["--out", "--stability"])
def test_select_experts_never_overwrites_a_file(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                flag: str) -> None:
    taken = tmp_path / "taken.json"
    taken.write_text("an earlier selection")
    paths = {"--out": tmp_path / "g.json", "--stability": tmp_path / "s.json"} | {flag: taken}
    code, _, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                           "--rule", "gate-mass", "--top-d", "2", *(a for kv in paths.items() for a in kv))
    assert (code, err) == (2, f"tessera: error: {flag} {taken}: already exists; choose another path "
                              "(it is never overwritten)\n")
    assert taken.read_text() == "an earlier selection" and sorted(tmp_path.iterdir()) == [taken]


def test_eval_subset_checks_its_out_file_first(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    group = tmp_path / "group.json"
    group.write_text(json.dumps(SELECTION))
    code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group, "--out", group)
    assert (code, err) == (2, f"tessera: error: --out {group}: already exists; choose another path "
                              "(it is never overwritten)\n")
    assert json.loads(group.read_text()) == SELECTION
    code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group, "--out", tmp_path)
    assert (code, err) == (2, f"tessera: error: --out {tmp_path}: is a directory; give a file path\n")
    code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group,
                           "--out", group / "report.json")
    assert (code, err) == (2, f"tessera: error: --out {group / 'report.json'}: {group} is not a directory\n")


def test_a_failed_final_write_leaves_no_temporary_file(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    group, report = tmp_path / "group.json", tmp_path / "report.json"
    group.write_text(json.dumps(SELECTION))
    real_link = os.link

    def disk_full_at_report(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == report:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        real_link(src, dst)

    monkeypatch.setattr(os, "link", disk_full_at_report)  # the last step of writing the report
    code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group, "--fractions", "1",
                           "--seeds", "1", "--out", report)
    assert (code, err) == (2, f"tessera: error: {report}: {os.strerror(errno.ENOSPC)}\n")
    assert sorted(tmp_path.iterdir()) == [group]


def test_bad_seed_and_data_files_are_named(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    group = tmp_path / "group.json"
    group.write_text(json.dumps(SELECTION))
    for seed in ("xyz", "", "0" * 63, "g" * 64):
        code, _, err = tessera(capsys, "eval-subset", "--spec", net / "spec.toml", "--group", group, "--seed", seed,
                               "--out", tmp_path / "r.json")
        assert code == 2 and err.startswith("tessera eval-subset: error: argument --seed: a round seed is exactly "
                                            f"64 hex digits, got {seed!r}"), err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\N{LATIN SMALL LETTER E WITH ACUTE}".encode("latin-1"))
    code, _, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", latin1,
                           "--rule", "gate-mass", "--top-d", "2", "--out", tmp_path / "g.json")
    assert (code, err) == (2, f"tessera: error: {latin1}:1: not UTF-8 text (byte 0xe9 at offset 3)\n")
    assert sorted(tmp_path.iterdir()) == [group, latin1]


@pytest.mark.parametrize(("budget", "says"), [
    (("--top-d", "0"), "--top-d must be at least 1, got 0"),
    (("--mass", "0"), "--mass must be in (0, 1], got 0.0"),
    (("--mass", "1.5"), "--mass must be in (0, 1], got 1.5"),
    (("--mass", "nan"), "--mass must be in (0, 1], got nan"),
])
def test_a_bad_budget_is_refused_before_the_model_loads(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, budget: tuple[str, str],
                                                        says: str) -> None:
    def no_model(path: Path) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("node.cli.select.load_spec_model", no_model)
    code, _, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                           "--rule", "gate-mass", *budget, "--out", tmp_path / "g.json")
    assert (code, err) == (2, f"tessera: error: {says}\n")
    assert list(tmp_path.iterdir()) == []


def test_a_top_d_above_the_layer_names_the_flag(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                           "--rule", "gate-mass", "--top-d", "9", "--out", tmp_path / "g.json")
    assert (code, err) == (2, "tessera: error: --top-d 9: the model has only 8 experts per layer\n")
    assert list(tmp_path.iterdir()) == []


def test_cluster_data_leaves_other_files_beside_its_out_dir_alone(net: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    beside = tmp_path / ".clusters.tmp"
    beside.mkdir()
    (beside / "notes.txt").write_text("mine")
    code, _, err = tessera(capsys, "cluster-data", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                           net / "data/prose.jsonl", "--k", "2", "--out", tmp_path / "clusters")
    assert code == 0, err
    assert (beside / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".clusters.tmp", "clusters"]


def _into_run(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: Path,
              top_d: str = "2") -> tuple[int, str, str]:
    return tessera(capsys, "select-experts", "--spec", net / "spec.toml", "--data", net / "data/train.jsonl",
                   "--rule", "gate-mass", "--top-d", top_d, "--examples", "1", "--into", target,
                   "--stability", tmp_path / "stability.json", "--out", tmp_path / "g.json")


def test_a_failed_into_write_takes_back_out_and_stability(net: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "into.toml"
    shutil.copy(net / "spec.toml", target)
    untouched = target.read_bytes()
    real_replace = os.replace

    def disk_full_at_spec(src: str | Path, dst: str | Path) -> None:
        if Path(dst) == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", disk_full_at_spec)  # the last step of updating the spec
    code, _, err = _into_run(net, tmp_path, capsys, target)
    assert (code, err) == (2, f"tessera: error: {target}: {os.strerror(errno.ENOSPC)}\n")
    assert target.read_bytes() == untouched and sorted(tmp_path.iterdir()) == [target]


def test_into_refuses_a_group_over_its_header_cap_before_writing(net: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec = tomllib.loads((net / "spec.toml").read_text())
    spec["limits"] = {"max_header_bytes": 1024}
    target = tmp_path / "into.toml"
    target.write_text(to_toml(spec), encoding="utf-8")
    untouched = target.read_bytes()
    code, _, err = _into_run(net, tmp_path, capsys, target, top_d="8")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tessera: error: --into {target}: with this group, limits.max_header_bytes (1024) is too "
                          "small: a miner's experts blob for this expert group can need a header of up to "), err
    assert target.read_bytes() == untouched and sorted(tmp_path.iterdir()) == [target]


def test_into_never_loses_an_edit_made_while_it_ran(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import training.selection

    target = tmp_path / "into.toml"
    shutil.copy(net / "spec.toml", target)
    edited = target.read_text() + "# the operator's note\n"
    real_select = training.selection.select_experts

    def edit_meanwhile(*args: object, **kwargs: object) -> object:
        target.write_text(edited)
        return real_select(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(training.selection, "select_experts", edit_meanwhile)
    code, _, err = _into_run(net, tmp_path, capsys, target)
    assert (code, err) == (2, f"tessera: error: --into {target}: the spec changed while this ran; it was not updated, "
                              "and nothing was written (run again)\n")
    assert target.read_text() == edited and sorted(tmp_path.iterdir()) == [target]


def test_into_follows_a_link_to_the_spec(net: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "specs" / "into.toml"
    real.parent.mkdir()
    shutil.copy(net / "spec.toml", real)
    link = tmp_path / "into.toml"
    link.symlink_to(real)
    code, _, err = _into_run(net, tmp_path, capsys, link)
    assert code == 0, err
    assert link.is_symlink() and load_spec(real).group == {0: PLANTED, 1: PLANTED}
