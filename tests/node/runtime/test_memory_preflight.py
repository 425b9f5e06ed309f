"""A node on CUDA traces its role's step before it loads anything and refuses to start, in one line naming the
memory needed and the settings that would make it fit, when its device cannot hold it; it starts when it can."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime.clock import ManualClock
from node.runtime.config import ConfigError, NodeConfig, load_config
from node.runtime.daemon import Node
from node.runtime.preflight import check_memory, planned_model
from node.store.blobs import BlobStore
from protocol.identity import save_identity
from protocol.spec import NetworkSpec, load_spec
from tests.conftest import make_identity, make_spec_dict, to_toml
from training.device import GIB
from training.plan import Setting, plan
from training.tiny import tiny_config

MINER = make_identity(100)


def write_miner(tmp_path: Path, miner: str) -> NodeConfig:
    (tmp_path / "spec.toml").write_text(to_toml(make_spec_dict()), encoding="utf-8")
    (tmp_path / "tiny.json").write_text(json.dumps(tiny_config("qwen3_moe")), encoding="utf-8")
    if not (tmp_path / "node.key").exists():
        save_identity(MINER, tmp_path / "node.key")
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\nrole = "miner"\nspec = "spec.toml"\n[http]\nport = 0\n[miner]\n{miner}',
                      encoding="utf-8")
    return load_config(config)


def needed(config: NodeConfig, spec: NetworkSpec, **changes: object) -> int:
    """Bytes the plan asks for (peak and margin) for the test spec's miner with `changes`."""
    model = planned_model(spec, config.node.spec)
    setting = Setting(role="miner", seq_len=spec.data.seq_len, micro_batch=spec.training.batch_size, device="cuda",
                      forward="compressed", **changes)  # type: ignore[arg-type]
    result = plan(model.config, setting, {k: list(v) for k, v in spec.group.items()}, family=model.family,
                  dtype=model.dtype, attn_implementation=model.attn)
    return result.peak_bytes + result.margin_bytes


async def start(config: NodeConfig, tmp_path: Path) -> None:
    spec = load_spec(config.node.spec)
    clock = ManualClock(spec.genesis_ts - 100)
    network = MemoryHub().join(MINER.node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / "b"))
    node = await Node.create(config, network, clock)
    await node._close()


async def test_a_miner_whose_plan_exceeds_its_declared_memory_refuses_to_start_naming_what_fits(
    tmp_path: Path
) -> None:
    config = write_miner(tmp_path, 'device = "cuda"\nforward = "compressed"\nautocast = false\n')
    spec = load_spec(config.node.spec)
    as_set, checkpointed = needed(config, spec), needed(config, spec, checkpointing=True)
    assert checkpointed < as_set
    between = (as_set + checkpointed) / 2 / GIB
    config = write_miner(tmp_path, f'device = "cuda"\nforward = "compressed"\nautocast = false\n'
                                   f'device_memory_gib = {between!r}\n')
    with pytest.raises(ConfigError) as refused:
        await start(config, tmp_path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("miner.device: this miner needs about "), line
    assert f"may use (miner.device_memory_gib) {between:.1f} GiB" in line
    assert line.endswith("it fits with miner.checkpointing = true (tessera plan traces any setting)"), line
    assert not (tmp_path / "data").exists()  # refused before it locked or opened anything


async def test_a_miner_that_fits_its_declared_memory_starts(tmp_path: Path) -> None:
    await start(write_miner(tmp_path, 'device = "cuda"\ndevice_memory_gib = 64\n'), tmp_path)
    assert (tmp_path / "data").exists()


def test_a_device_that_holds_no_setting_or_does_not_exist_is_refused_in_one_line(tmp_path: Path) -> None:
    config = write_miner(tmp_path, 'device = "cuda:0"\ndevice_memory_gib = 0.5\n')
    spec = load_spec(config.node.spec)
    with pytest.raises(ConfigError, match=r"^miner.device: .* 0\.5 GiB; no setting of this node makes it fit"):
        check_memory(config, spec)
    with pytest.raises(ConfigError, match=r"^miner.device = 'cuda:7' does not exist: this machine has \d CUDA"):
        check_memory(write_miner(tmp_path, 'device = "cuda:7"\n'), spec)
    check_memory(write_miner(tmp_path, 'device = "cpu"\ndevice_memory_gib = 0.5\n'), spec)  # no plan off CUDA
