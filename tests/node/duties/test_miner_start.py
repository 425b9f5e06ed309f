"""A miner refuses to start, in one line naming the setting, without its device, base checkpoint or data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.duties.miner import check_inputs
from node.runtime.config import MinerSection
from protocol.spec import parse_spec


def test_a_miner_without_its_device_checkpoint_or_training_file_refuses_to_start(
    spec_dict: dict[str, Any], tmp_path: Path
) -> None:
    spec_path = tmp_path / "spec.toml"  # the spec names train.txt beside it
    spec = parse_spec(spec_dict)
    with pytest.raises(ValueError, match=r"^data\.train: .*train\.txt is not a file$"):
        check_inputs(spec, spec_path, MinerSection())
    (tmp_path / "train.txt").write_text("some text to train on\n", encoding="utf-8")
    check_inputs(spec, spec_path, MinerSection())  # everything there: it starts
    with pytest.raises(ValueError, match=r"^miner\.data: .*mine\.jsonl is not a file$"):
        check_inputs(spec, spec_path, MinerSection(data=tmp_path / "mine.jsonl"))
    for device, reason in (("banana", "is not a torch device"), ("cuda:99", "does not exist"),
                           ("auto", "a miner trains on one device")):
        with pytest.raises(ValueError, match=rf"^miner\.device.*{reason}"):
            check_inputs(spec, spec_path, MinerSection(device=device))
    spec_dict["model"] = {**spec_dict["model"], "config": None, "checkpoint": "base"}
    with pytest.raises(ValueError, match=r"^model\.checkpoint: .*base is not a directory"):
        check_inputs(parse_spec(spec_dict), spec_path, MinerSection())
