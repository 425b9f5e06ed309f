"""Building, loading and fingerprinting the base model.

A network's base model is either a tiny model built from a config dict and an init seed (simulation)
or a local Hugging Face checkpoint directory (config.json + safetensors, sharded or not; per-expert
hub keys are fused on load; pickle is never read). `state_hash` is the base's fingerprint that the
spec pins as `base_hash`. Models come back in eval mode with eager attention and eager experts, so
every node computes the same numbers the same way. This module knows nothing about training or the
network; it reads only the files a spec names.

state_hash framing (all integers little-endian): the ASCII tag `tessera-state/1\\n`, then for every
parameter and persistent buffer of `model.state_dict()` sorted by name:
    u32 len(name) | name (UTF-8) | u32 len(dtype) | dtype (e.g. "float32") | u32 ndim |
    u64 dim for each dim | u64 nbytes | the tensor's bytes (C order, little-endian)
and the hash is SHA-256 of that stream, as lower-case hex.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import PreTrainedModel
from transformers.initialization import no_init_weights

from protocol.spec import NetworkSpec, spec_dir_path
from training.adapters import MoEAdapter, adapter_for
from training.experts import check_group

_STATE_TAG = b"tessera-state/1\n"
_SPECIAL_TOKENS = {"pad_token_id": 256, "bos_token_id": 257, "eos_token_id": 258}
_COMMON = {
    "vocab_size": 260,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
    **_SPECIAL_TOKENS,
}
_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **_COMMON,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "norm_topk_prob": True,
    },
    "olmoe": {**_COMMON, "num_hidden_layers": 2, "intermediate_size": 32, "num_experts": 8},
    "mixtral": {**_COMMON, "num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8},
    "deepseek_v3": {
        **_COMMON,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
    },
}

assert sys.byteorder == "little", (
    "state_hash writes tensor bytes as stored; big-endian hosts are not supported"
)


class BaseMismatchError(ValueError):
    """The base model does not hash to the spec's `base_hash`."""


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A small JSON-able config for `family`: hidden 64, 2 MoE layers of 8 experts, top-2, vocab 260.

    The vocabulary fits the byte tokenizer: ids 0-255 are bytes, 256 pad, 257 bos, 258 eos, 259 spare.
    DeepSeek-V3 gets one extra dense first layer, as its real configs have.
    """
    adapter_for(family)
    return {**_TINY[family], **overrides}


def build_tiny_model(family: str, config: dict[str, Any], seed: int) -> PreTrainedModel:
    """A freshly initialised fp32 model of `family` from a config dict; the same seed gives the same bytes."""
    adapter = adapter_for(family)
    hf_config = _make_config(adapter, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = adapter.model_class._from_config(
            hf_config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
    return model.eval()


def load_checkpoint(family: str, directory: str | Path) -> PreTrainedModel:
    """Load a local HF checkpoint directory: config.json plus safetensors weights (sharded or single)."""
    adapter = adapter_for(family)
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        config_dict = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"{config_path}: no config.json in the checkpoint directory") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read the model config: {exc}") from exc
    hf_config = _make_config(adapter, config_dict)
    dtype = _config_dtype(hf_config)
    state = adapter.convert_hub_state_dict(_read_weights(directory), hf_config)
    with no_init_weights():
        model = adapter.model_class._from_config(
            hf_config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    _load_state(model, state, directory)
    return model.eval()


def load_base(spec: NetworkSpec, spec_path: str | Path) -> tuple[PreTrainedModel, MoEAdapter]:
    """The spec's base model and its adapter; refuses a model that does not hash to `base_hash`."""
    adapter = adapter_for(spec.model.family)
    if spec.model.config is not None:
        config_path = spec_dir_path(spec_path, spec.model.config)
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"{config_path}: cannot read the model config named by model.config: {exc}"
            ) from exc
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: the model config must be a JSON object")
        model = build_tiny_model(spec.model.family, config, spec.model.init_seed)
    else:
        assert spec.model.checkpoint is not None, "the spec validator requires config or checkpoint"
        model = load_checkpoint(spec.model.family, spec_dir_path(spec_path, spec.model.checkpoint))
    actual = state_hash(model)
    if actual != spec.model.base_hash:
        raise BaseMismatchError(
            f"the base model hashes to {actual} but the spec's model.base_hash is {spec.model.base_hash}; "
            "this node has a different base model than the network"
        )
    check_group(model, adapter, spec.group)
    return model, adapter


def state_hash(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and persistent buffer in canonical form (framing: module docstring)."""
    digest = hashlib.sha256(_STATE_TAG)
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        dtype = str(data.dtype).removeprefix("torch.").encode("ascii")
        encoded = name.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<I", len(dtype)) + dtype)
        digest.update(struct.pack("<I", data.dim()) + b"".join(struct.pack("<Q", d) for d in data.shape))
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        digest.update(struct.pack("<Q", len(raw)) + raw)
    return digest.hexdigest()


def _make_config(adapter: MoEAdapter, config: dict[str, Any]) -> Any:
    model_type = config.get("model_type", adapter.family)
    if model_type != adapter.family:
        raise ValueError(
            f"the model config is for {model_type!r}, but the spec's family is {adapter.family!r}"
        )
    try:
        return adapter.config_class.from_dict({k: v for k, v in config.items() if k != "model_type"})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid {adapter.family} model config: {exc}") from exc


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or "float32"
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}; use float32, bfloat16 or float16")
    return getattr(torch, dtype)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: not a valid safetensors index: {exc}") from exc
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            shard = load_file(path)
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"{path}: cannot read safetensors weights: {exc}") from exc
        duplicate = state.keys() & shard.keys()
        if duplicate:
            raise ValueError(f"{path}: tensor {sorted(duplicate)[0]} also appears in another shard")
        state.update(shard)
    return state


def _load_state(model: PreTrainedModel, state: dict[str, torch.Tensor], directory: Path) -> None:
    expected = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(expected.keys() - state.keys() - tied)
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{directory}: weights do not match the config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"{directory}: {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)
