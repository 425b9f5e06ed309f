"""A node on CUDA traces its role's work over a round's steady state before it loads anything. A miner whose config
leaves memory settings unset gets the fastest that fit; one whose settings are all set, or that nothing fits,
refuses to start in one line naming the memory needed and the settings that would make it fit (or the nearest);
it starts when it can."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.net.judge import GossipJudge
from node.net.twin import MemoryHub
from node.runtime.clock import ManualClock
from node.runtime.config import ConfigError, NodeConfig, load_config
from node.runtime.daemon import Node
from node.runtime.preflight import check_memory, fit_memory, planned_model
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


SET = 'forward = "compressed"\nautocast = false\noptimizer = "adamw"\nstep_in_backward = false\n'
"""Every memory setting but checkpointing and micro_batch_size, set in the file."""
LEAST = ('forward = "compressed"\nautocast = true\noptimizer = "adamw8bit"\nstep_in_backward = false\n'
         'checkpointing = true\nmicro_batch_size = 1\n')
"""Every memory setting set, each to what saves most (the step in backward cannot split the spec's batch)."""


def needed(config: NodeConfig, spec: NetworkSpec, **changes: object) -> int:
    """Bytes the plan asks for (peak and margin) for the test spec's miner with `changes`."""
    model = planned_model(spec, config.node.spec)
    batch = spec.training.batch_size
    kwargs: dict[str, Any] = {"micro_batch": batch, "forward": "compressed", **changes}
    setting = Setting(role="miner", seq_len=spec.data.seq_len, batch_size=batch, device="cuda", **kwargs)
    result = plan(model.config, setting, {k: list(v) for k, v in spec.group.items()}, family=model.family,
                  dtype=model.dtype, attn_implementation=model.attn)
    return result.peak_bytes + result.margin_bytes


async def start(config: NodeConfig, tmp_path: Path) -> None:
    spec = load_spec(config.node.spec)
    clock = ManualClock(spec.genesis_ts - 100)
    network = MemoryHub().join(MINER.node_id, GossipJudge(spec, clock.now), BlobStore(tmp_path / "b"))
    node = await Node.create(config, network, clock)
    await node._close()


@pytest.mark.slow  # several traces; make check keeps a miner that fits and starts
async def test_a_miner_whose_plan_exceeds_its_declared_memory_refuses_to_start_naming_what_fits(
    tmp_path: Path
) -> None:
    config = write_miner(tmp_path, f'device = "cuda"\n{SET}')
    spec = load_spec(config.node.spec)
    as_set, checkpointed = needed(config, spec), needed(config, spec, checkpointing=True)
    assert checkpointed < as_set
    between = (as_set + checkpointed) / 2 / GIB
    config = write_miner(tmp_path, f'device = "cuda"\n{SET}checkpointing = false\nmicro_batch_size = 8\n'
                                   f'device_memory_gib = {between!r}\n')
    with pytest.raises(ConfigError) as refused:
        await start(config, tmp_path)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("miner.device: this miner needs about "), line
    assert f"may use (miner.device_memory_gib) {between:.1f} GiB" in line
    assert line.endswith("it fits with miner.checkpointing = true (tessera plan traces any setting)"), line
    assert not (tmp_path / "data").exists()  # refused before it locked or opened anything


@pytest.mark.slow  # several traces
def test_a_miner_gets_the_fastest_of_the_settings_its_config_leaves_unset_that_fits(tmp_path: Path) -> None:
    config = write_miner(tmp_path, f'device = "cuda"\n{SET}')
    spec = load_spec(config.node.spec)
    as_set, checkpointed = needed(config, spec), needed(config, spec, checkpointing=True)
    between = (as_set + checkpointed) / 2 / GIB
    roomy, _ = fit_memory(write_miner(tmp_path, f'device = "cuda"\n{SET}device_memory_gib = 64\n'), spec)
    assert roomy.miner.checkpointing is False and roomy.miner.micro_batch_size == spec.training.batch_size
    tight, line = fit_memory(write_miner(tmp_path, f'device = "cuda"\n{SET}device_memory_gib = {between!r}\n'), spec)
    chosen = {"checkpointing": tight.miner.checkpointing, "micro_batch": tight.miner.micro_batch_size}
    assert chosen != {"checkpointing": False, "micro_batch": spec.training.batch_size}  # the defaults do not fit
    assert needed(config, spec, **chosen) <= between * GIB  # what it chose does
    assert line is not None and "\n" not in line and line.startswith("memory: chose miner.micro_batch_size = ")
    assert tight.miner.forward == "compressed" and tight.miner.optimizer == "adamw"  # as the file set them


async def test_a_miner_that_fits_its_declared_memory_starts(tmp_path: Path) -> None:
    await start(write_miner(tmp_path, 'device = "cuda"\ndevice_memory_gib = 64\n'), tmp_path)
    assert (tmp_path / "data").exists()


def test_a_device_that_does_not_exist_is_refused_in_one_line_and_a_cpu_without_a_budget_is_not_planned(
    tmp_path: Path
) -> None:
    spec = load_spec(write_miner(tmp_path, "").node.spec)
    with pytest.raises(ConfigError, match=r"^miner.device = 'cuda:7' does not exist: this machine has \d CUDA"):
        check_memory(write_miner(tmp_path, 'device = "cuda:7"\n'), spec)
    check_memory(write_miner(tmp_path, 'device = "cpu"\n'), spec)  # a CPU miner without a budget: no plan


@pytest.mark.slow  # several traces
def test_a_miner_that_nothing_fits_is_refused_naming_the_nearest_on_cuda_and_in_host_memory(tmp_path: Path) -> None:
    every = write_miner(tmp_path, f'device = "cuda:0"\n{LEAST}device_memory_gib = 0.5\n')
    spec = load_spec(every.node.spec)
    with pytest.raises(ConfigError, match=r"^miner.device: .* 0\.5 GiB; no setting of this node makes it fit"):
        check_memory(every, spec)
    config = write_miner(tmp_path, 'device = "cuda:0"\ndevice_memory_gib = 0.5\n')
    with pytest.raises(ConfigError, match=r"^miner.device: .* 0\.5 GiB, .* nothing fits 0\.5 GiB; the nearest, "):
        check_memory(config, spec)
    with pytest.raises(ConfigError, match=r"^miner.device: .* of cpu .* 0\.5 GiB; no setting of this node makes it"):
        check_memory(write_miner(tmp_path, f'device = "cpu"\n{LEAST}device_memory_gib = 0.5\n'), spec)  # host memory
