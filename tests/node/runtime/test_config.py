"""Node config: one TOML file plus TESSERA_* overrides; every error names the file or variable and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.net.config import P2PConfig
from node.runtime.config import ConfigError, load_config, render_config

MINIMAL = '[node]\nrole = "miner"\nspec = "net/spec.toml"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_and_paths_relative_to_the_config_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config.node.role == "miner"
    assert config.node.spec == (tmp_path / "net" / "spec.toml").resolve()
    assert config.node.key == (tmp_path / "node.key").resolve()
    assert config.db_path == (tmp_path / "data" / "node.db").resolve()
    assert (config.http.host, config.http.port, config.http.enabled) == ("127.0.0.1", 8080, True)
    assert config.p2p.host == "127.0.0.1" and config.p2p.bootstrap == ()
    assert config.miner.forward == "full" and config.storage.blob_retention_rounds == 3


def test_absolute_paths_stay_absolute(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL + 'data_dir = "/srv/tessera"\n'))
    assert config.node.data_dir == Path("/srv/tessera")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[node\nrole = 1\n", "not valid TOML"),
        (MINIMAL + "colour = 3\n", "node.colour: Extra inputs are not permitted"),
        (MINIMAL + "[p2p]\nport = 70000\n", "p2p.port: Input should be less than or equal to 65535"),
        (MINIMAL + '[http]\nport = "eighty"\n', "http.port: Input should be a valid integer"),
        (MINIMAL + '[miner]\nforward = "sideways"\n', "miner.forward: Input should be 'full' or 'compressed'"),
        (MINIMAL + '[p2p]\nbootstrap = ["127.0.0.1:4001"]\n', "p2p.bootstrap: '127.0.0.1:4001' is not a multiaddr"),
        (MINIMAL + "[p2p]\ndial_timeout_s = 0\n", "p2p.dial_timeout_s: Input should be greater than 0"),
        (MINIMAL + "[p2p]\npenalty_threshold = 0\n", "p2p.penalty_threshold: Input should be greater than or equal to 1"),
        (MINIMAL + "[p2p]\nserve_rate_bytes_s = 1000\n", "p2p: serve_rate_bytes_s (1000) is below"),
        (MINIMAL + "[p2p]\nblob_min_rate_bytes_s = 0\n", "p2p.blob_min_rate_bytes_s: Input should be greater than 0"),
        ('[node]\nrole = "miner"\n', "node.spec: Field required"),
        ('[node]\nrole = "validator"\nspec = "s.toml"\n', "validator.heldout: a validator needs"),
        ("[unknown]\nx = 1\n" + MINIMAL, "unknown: Extra inputs are not permitted"),
        ('_env_file = "x.env"\n' + MINIMAL, "_env_file: Extra inputs are not permitted"),
        (MINIMAL + "[http]\nport = true\n", "http.port: Input should be a valid integer, got true"),
        (MINIMAL + '[http]\nenabled = "off"\n', 'http.enabled: Input should be a valid boolean (true or false), got "off"'),
        (MINIMAL + "[miner]\ncheckpointing = 1\n", "miner.checkpointing: Input should be a valid boolean"),
        (MINIMAL + "[miner]\nmicro_batch_size = true\n", "miner.micro_batch_size: Input should be a valid integer"),
        (MINIMAL + "[storage]\nmessage_retention_rounds = 2.0\n",
         "storage.message_retention_rounds: Input should be a valid integer, got 2.0"),
        (MINIMAL + "[p2p]\ndial_timeout_s = true\n", "p2p.dial_timeout_s: Input should be a valid number, got true"),
        (MINIMAL + 'data_dir = ""\n', "node.data_dir: an empty path; name a file or directory"),
        ('[node]\nrole = "miner"\nspec = ""\n', "node.spec: an empty path"),
        (MINIMAL + '[miner]\ndata = ""\n', "miner.data: an empty path"),
        (MINIMAL + '[http]\nhost = ""\n', "http.host: an empty host would listen on every interface"),
        (MINIMAL + '[http]\nhost = " "\n', "http.host: an empty host would listen on every interface"),
    ],
)
def test_errors_name_the_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, MINIMAL + "[http]\nport = 8081\nhost = \"127.0.0.2\"\n")
    monkeypatch.setenv("TESSERA_HTTP__PORT", "9000")
    monkeypatch.setenv("TESSERA_MINER__FORWARD", "compressed")
    config = load_config(path)
    assert config.http.port == 9000
    assert config.http.host == "127.0.0.2"  # untouched fields of the section keep the file's value
    assert config.miner.forward == "compressed"


def test_environment_error_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_HTTP__PORT", "not-a-port")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL))
    assert str(info.value).startswith("TESSERA_HTTP__PORT (environment): http.port: ")


def test_overrides_are_text_parsed_as_before_but_an_empty_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL + "[p2p]\ndial_timeout_s = 5\n")  # an integer is a number
    for name, value in (("TESSERA_HTTP__ENABLED", "off"), ("TESSERA_HTTP__PORT", "9000"),
                        ("TESSERA_MINER__CHECKPOINTING", "1"), ("TESSERA_STORAGE__BLOB_RETENTION_ROUNDS", "4")):
        monkeypatch.setenv(name, value)
    config = load_config(path)
    assert (config.http.enabled, config.http.port, config.miner.checkpointing) == (False, 9000, True)
    assert (config.storage.blob_retention_rounds, config.p2p.dial_timeout_s) == (4, 5.0)
    for name, field in (("TESSERA_NODE__DATA_DIR", "node.data_dir"), ("TESSERA_MINER__DATA", "miner.data"),
                        ("TESSERA_VALIDATOR__HELDOUT", "validator.heldout")):
        monkeypatch.setenv(name, "")
        with pytest.raises(ConfigError, match=rf"^{name} \(environment\): {field}: an empty path; name a file"):
            load_config(path)
        monkeypatch.delenv(name)
    monkeypatch.setenv("TESSERA_HTTP__HOST", "")  # would bind every interface, not loopback
    with pytest.raises(ConfigError, match=r"^TESSERA_HTTP__HOST \(environment\): http.host: an empty host"):
        load_config(path)


def test_an_override_that_overrides_nothing_or_is_not_json_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL)
    for name in ("TESSERA_HTTP_PORT", "TESSERA_BOGUS__PORT", "TESSERA_HTTP__PROT"):  # typos a user makes
        monkeypatch.setenv(name, "9000")
        with pytest.raises(ConfigError, match=rf"^{name} \(environment\): no such setting; overrides are named"):
            load_config(path)
        monkeypatch.delenv(name)
    monkeypatch.setenv("TESSERA_P2P__BOOTSTRAP", "garbage")
    with pytest.raises(ConfigError, match=r"^TESSERA_P2P__BOOTSTRAP \(environment\): not JSON; a list takes JSON"):
        load_config(path)


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(ValueError):
        config.http.port = 1  # type: ignore[misc]


def test_rendered_config_loads_back(tmp_path: Path) -> None:
    text = render_config("validator", Path("../spec.toml"), Path("node.key"), Path("data"), 4101, 0,
                         heldout=Path("heldout.jsonl"), bootstrap=("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc",))
    config = load_config(write(tmp_path, text))
    assert config.node.role == "validator"
    assert config.node.spec == (tmp_path.parent / "spec.toml").resolve()
    assert config.validator.heldout == (tmp_path / "heldout.jsonl").resolve()
    assert config.p2p.port == 4101 and config.http.port == 0
    assert config.p2p.bootstrap == ("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc",)


def test_every_p2p_setting_comes_from_the_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = MINIMAL + "[p2p]\nport = 0\nserve_rate_bytes_s = 100000.0\npenalty_threshold = 5\nexchange_interval_s = 2.5\n"
    monkeypatch.setenv("TESSERA_P2P__PENALTY_BACKOFF_S", "60")
    monkeypatch.setenv("TESSERA_P2P__BOOTSTRAP", '["/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWabc"]')
    config = load_config(write(tmp_path, text))
    assert isinstance(config.p2p, P2PConfig)  # the network layer's own type, handed down as is
    assert (config.p2p.port, config.p2p.serve_rate_bytes_s, config.p2p.exchange_interval_s) == (0, 100000.0, 2.5)
    assert (config.p2p.penalty_threshold, config.p2p.penalty_backoff_s) == (5, 60.0)
    assert config.p2p.bootstrap == ("/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWabc",)
    assert set(P2PConfig.model_fields) >= {"sender_budget", "penalty_threshold", "penalty_backoff_s", "max_peers"}
