"""`load_checkpoint` turns what a malformed checkpoint raises into one ValueError naming the directory, and
lets every other exception through: a bug inside the load is not reported as a bad checkpoint.

A config.json no model can be built from is judged first, on the meta device; weights whose shape
differs from the config's are named by key; what transformers raises for weights it cannot convert
(RuntimeError) and unreadable files (OSError, SafetensorError) become the one-line refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.training.test_hostile_checkpoint import _copy
from training.model import load_checkpoint


@pytest.mark.parametrize("bug", [KeyError("layers"), AssertionError("an invariant"), TypeError("an argument")])
def test_a_bug_inside_from_pretrained_is_not_called_a_bad_checkpoint(
        good: Path, monkeypatch: pytest.MonkeyPatch, bug: Exception) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise bug

    monkeypatch.setattr(transformers.Qwen3MoeForCausalLM, "from_pretrained", broken)
    with pytest.raises(type(bug)) as raised:
        load_checkpoint(good)
    assert raised.value is bug


def test_a_config_no_model_can_use_is_refused_before_loading(good: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _copy(good, tmp_path)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    (directory / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}), encoding="utf-8")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.Qwen3MoeForCausalLM, "from_pretrained", never)
    with pytest.raises(ValueError, match="config.json describes no buildable qwen3_moe model: ZeroDivisionError"):
        load_checkpoint(directory)


def test_a_weight_of_the_wrong_shape_is_named(good: Path, tmp_path: Path) -> None:
    directory = _copy(good, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({**tensors, "model.norm.weight": torch.zeros(3, 5)}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights do not match the config \(missing or mismatched: "
                                         r"\[\"\('model\.norm\.weight', torch\.Size\(\[3, 5\]\)"):
        load_checkpoint(directory)


def test_weights_transformers_cannot_convert_are_refused_in_one_line(good: Path, tmp_path: Path) -> None:
    directory = _copy(good, tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({**tensors, "model.layers.0.mlp.experts.0.down_proj.weight": torch.zeros(7)},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{directory}: transformers cannot load this checkpoint: "):
        load_checkpoint(directory)
