"""The `tessera` CLI as a user meets it: help, --version, keygen, spec check, placeholders and error lines."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from node.cli.main import main
from protocol.spec import parse_spec

ROOT = Path(__file__).resolve().parents[3]


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_help_lists_commands_without_importing_torch() -> None:
    result = tessera("--help")
    assert result.returncode == 0
    for command in ("keygen", "spec", "miner", "validator", "simulate", "status"):
        assert command in result.stdout
    code = "import sys; from node.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


def test_version_names_the_release_and_its_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    from protocol.version import PROTOCOL_VERSION, RELEASE

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"tessera {RELEASE} (protocol {PROTOCOL_VERSION})\n"


def test_keygen_writes_0600_and_prints_id(tmp_path: Path) -> None:
    out = tmp_path / "node.key"
    result = tessera("keygen", "--out", str(out))
    assert result.returncode == 0, result.stderr
    node_id = result.stdout.strip()
    assert len(node_id) == 64 and int(node_id, 16) >= 0
    assert os.stat(out).st_mode & 0o777 == 0o600
    again = tessera("keygen", "--out", str(out))
    assert again.returncode == 2
    assert again.stderr.startswith("tessera: error: ") and "refusing to overwrite" in again.stderr
    assert again.stderr.count("\n") == 1


def test_keygen_refuses_a_path_it_cannot_write_in_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory", encoding="utf-8")
    cases = ((tmp_path, "is a directory"), (a_file / "k.key", "is not a directory"),
             (Path("/proc/tessera-no-such-dir/k.key"), "cannot write the key file"))
    for out, reason in cases:
        assert main(["keygen", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tessera: error: {out}: ") and reason in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no temporary key left behind


def test_a_file_system_error_from_any_command_is_one_line_naming_the_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def unwritable(args: object) -> int:
        raise PermissionError(13, "Permission denied", "/data/out.safetensors")

    monkeypatch.setattr("node.cli.keys.run_keygen", unwritable)
    assert main(["keygen", "--out", "k.key"]) == 2
    assert capsys.readouterr().err == "tessera: error: /data/out.safetensors: Permission denied\n"


def test_spec_check_prints_network_id(spec_dict, write_spec) -> None:
    result = tessera("spec", "check", str(write_spec(spec_dict)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == parse_spec(spec_dict).network_id


def test_spec_check_warns_of_a_skew_that_lets_seeds_out_while_commits_are_taken(spec_dict, write_spec) -> None:
    assert "warning" not in tessera("spec", "check", str(write_spec(spec_dict))).stderr  # skew 1 s, REVEAL 10 s
    data = copy.deepcopy(spec_dict)
    data["timing"]["clock_skew_s"] = data["timing"]["reveal_s"] / 2
    result = tessera("spec", "check", str(write_spec(data)))
    assert result.returncode == 0 and result.stdout.strip() == parse_spec(data).network_id  # still a valid spec
    assert "tessera: warning: timing.clock_skew_s (5.0) is over a quarter of timing.reveal_s" in result.stderr


@pytest.mark.parametrize(
    ("section", "key", "value", "field"),
    [
        ("model", "base_hash", "1234", "model.base_hash"),
        ("timing", "train_s", "slow", "timing.train_s"),
        ("data", "heldout_sha256", None, "data.heldout_sha256"),
    ],
)
def test_spec_check_names_the_bad_field(spec_dict, write_spec, section, key, value, field) -> None:
    data = copy.deepcopy(spec_dict)
    if value is None:
        del data[section][key]
    else:
        data[section][key] = value
    result = tessera("spec", "check", str(write_spec(data)))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("tessera: error: ") and f": {field}: " in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_spec_check_bad_toml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    result = tessera("spec", "check", str(bad))
    assert result.returncode == 2 and "not valid TOML" in result.stderr
    assert result.stderr.count("\n") == 1


def test_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["keygen"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera keygen: error: ") and err.count("\n") == 1


def test_bootstrap_refuses_bad_input_with_one_line_and_no_key_written(
    spec_dict, write_spec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = str(write_spec(spec_dict))
    data = tmp_path / "boot"
    code = main(["bootstrap", "--spec", spec, "--sim-key", "0", "--data-dir", str(data), "--bootstrap", "127.0.0.1:4001"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tessera: error: ") and "not a multiaddr" in err and err.count("\n") == 1
    assert not data.exists()  # nothing half-written
    code = main(["bootstrap", "--spec", str(tmp_path / "absent.toml"), "--key", str(tmp_path / "k")])
    assert code == 2 and capsys.readouterr().err.startswith("tessera: error: ")  # --key needs no --data-dir
    assert not (tmp_path / "k").exists()
    code = main(["bootstrap", "--spec", spec, "--sim-key", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--sim-key needs --data-dir" in err and err.count("\n") == 1
    code = main(["bootstrap", "--spec", spec, "--key", str(tmp_path / "k"), "--port", "70000"])
    assert code == 2 and capsys.readouterr().err == (
        "tessera: error: --port: Input should be less than or equal to 65535\n")
    assert not (tmp_path / "k").exists()
    code = main(["bootstrap", "--spec", spec, "--key", str(tmp_path / "k"), "--host", "nohost"])
    assert code == 2 and capsys.readouterr().err == (
        "tessera: error: --host: 'nohost' is not an IPv4 address like 127.0.0.1 or 0.0.0.0\n")
    assert not (tmp_path / "k").exists()  # refused before the key was written
    bad_peer = "/ip4/127.0.0.1/tcp/4001/p2p/abc"
    code = main(["bootstrap", "--spec", spec, "--key", str(tmp_path / "k"), "--bootstrap", bad_peer])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"tessera: error: --bootstrap: {bad_peer!r} is not a multiaddr ending in "
                                        "/p2p/<peer id>") and err.count("\n") == 1, err
    assert not (tmp_path / "k").exists()


@pytest.mark.timeout(60)  # a bootstrap that did not refuse would listen beside the other process and run on
def test_bootstrap_refuses_a_port_another_process_listens_on(
    spec_dict, write_spec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as libp2p listens: a second bind would share
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["bootstrap", "--spec", str(write_spec(spec_dict)), "--key", str(tmp_path / "k"),
                     "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"tessera: error: --port: 127.0.0.1:{port} is in use (by another node, or another "
                                 "program?); stop it or pick another --port\n"), err
    assert not (tmp_path / "k").exists()


def test_the_bootstrap_command_is_not_the_test_harness() -> None:
    code = ("import sys; from node.cli import bootstrap; print(any(m.startswith('node.sim.peer') "
            "for m in sys.modules))")
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr
    assert "node.sim.peer" not in (ROOT / "node" / "cli" / "bootstrap.py").read_text()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", "no answer from the node"),  # not HTTP at all
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", "no answer from the node"),  # cut short
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n[1,2]", "not a node's status"),  # JSON, not a status
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", "not a node's status"),
    ],
)
def test_status_against_something_that_answers_garbage_is_one_line_and_exit_2(
    answer: bytes, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        def reply() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

        thread = threading.Thread(target=reply, daemon=True)
        thread.start()
        code = main(["status", "--url", f"http://127.0.0.1:{server.getsockname()[1]}", "--timeout", "5"])
        thread.join(5)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and reason in captured.err, captured
    assert captured.err.startswith("tessera: error: ") and captured.err.count("\n") == 1


def test_status_with_a_url_it_cannot_use_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for url in ("http://127.0.0.1:abc", "http://exa mple.com"):
        assert main(["status", "--url", url, "--timeout", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tessera: error: {url}/status: ") and err.count("\n") == 1, err


def test_init_never_overwrites_a_config_that_appeared_while_it_ran(
    write_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import protocol.identity

    spec, node_dir = str(write_spec()), tmp_path / "node"
    config_path = node_dir / "node.toml"
    create = protocol.identity.load_or_create_identity

    def racing_init(path: Path) -> protocol.identity.Identity:  # another `tessera init` wrote its config meanwhile
        config_path.write_text("# the other node's config\n", encoding="utf-8")
        return create(path)

    monkeypatch.setattr(protocol.identity, "load_or_create_identity", racing_init)
    assert main(["init", "--role", "miner", "--spec", spec, "--dir", str(node_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tessera: error: node config {config_path}: ") and "not overwritten" in err
    assert err.count("\n") == 1
    assert config_path.read_text(encoding="utf-8") == "# the other node's config\n"
    assert sorted(p.name for p in node_dir.iterdir()) == ["node.key", "node.toml"]  # no temporary file left


def test_ctrl_c_at_any_point_says_interrupted_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object) -> int:  # Ctrl-C while a command imports torch or loads a model
        raise KeyboardInterrupt

    monkeypatch.setattr("node.cli.keys.run_keygen", interrupted)
    assert main(["keygen", "--out", "k.key"]) == 130
    assert capsys.readouterr().err == "tessera: interrupted\n"
    monkeypatch.setattr("node.cli.main.build_parser", interrupted)  # while the command modules import
    assert main(["keygen", "--out", "k.key"]) == 130
    assert capsys.readouterr().err == "tessera: interrupted\n"
