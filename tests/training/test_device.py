"""Refusing a validator device that is missing or too small, with one line naming the setting and memory."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node.duties.validator import ValidatorDuties
from node.runtime.config import NodeConfig
from node.sim.twins import write_network
from protocol.spec import load_spec
from training.device import GIB, check_device, scoring_bytes
from training.tiny import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model("olmoe", tiny_config("olmoe"), seed=0)


def test_cpu_and_meta_are_accepted(model: torch.nn.Module) -> None:
    check_device("cpu", model, 16, 64)
    check_device("meta", model, 16, 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "auto"])
def test_missing_gpu_is_refused(model: torch.nn.Module, device: str) -> None:
    with pytest.raises(ValueError, match=r"^validator\.device = .*(does not exist|has none)") as info:
        check_device(device, model, 16, 64)
    assert "\n" not in str(info.value)


def test_not_a_device_is_refused(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        check_device("gpu0", model, 16, 64)


def test_too_small_gpu_names_the_memory_needed(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    need = scoring_bytes(model, 16, 64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert need > weights
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (need - 1, 24 * GIB))
    with pytest.raises(ValueError, match=rf"validator\.device = 'cuda:1' .* needs about {need / GIB:.1f} GiB"):
        check_device("cuda:1", model, 16, 64)
    with pytest.raises(ValueError, match="'cuda:2' does not exist: this machine has 2 CUDA device"):
        check_device("cuda:2", model, 16, 64)
    check_device("auto", model, 16, 64)  # two GPUs together hold it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (need, 24 * GIB))
    check_device("cuda:1", model, 16, 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_validator_on_a_missing_gpu_refuses_to_start(tmp_path: Path) -> None:
    spec_path = write_network(tmp_path / "net")
    config = NodeConfig(node={"role": "validator", "spec": spec_path, "data_dir": tmp_path / "v"},
                        validator={"heldout": tmp_path / "net" / "heldout.jsonl", "device": "cuda:7"})
    ctx = SimpleNamespace(config=config, spec=load_spec(spec_path))
    with pytest.raises(ValueError, match=r"^validator\.device = 'cuda:7' does not exist: this machine has 0 CUDA"):
        ValidatorDuties(ctx)  # type: ignore[arg-type]
