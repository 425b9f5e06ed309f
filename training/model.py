"""Building, loading and fingerprinting the base model.

A network's base model is either a tiny model built from a config dict and an init seed (simulation)
or a local Hugging Face checkpoint directory, loaded by transformers' own `from_pretrained` (its
conversion mapping fuses per-expert hub keys; safetensors only, pickle is never read). Tiny models
use eager attention and eager experts so every node computes the same numbers the same way;
checkpoints default to sdpa. `load_compressed` (`load_compressed_base` for a spec) builds a
compressed-mode miner's model Θ̃0 from a checkpoint without ever reading the group layers'
unselected experts. `state_hash` is a loaded model's fingerprint and
`training.checkpoint.checkpoint_hash` the same fingerprint streamed from a checkpoint's files; the
spec pins it as `base_hash` (framing: training/checkpoint.py), and the model config as
`config_sha256` (`training.checkpoint.config_hash`) where it sets one. Tiny models come from
`training.tiny`. This module knows nothing about training or the network; it reads only the files a
spec names.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from protocol.spec import NetworkSpec, spec_dir_path
from training.adapters import MoEAdapter, adapter_for, family_of, tensor_attr
from training.checkpoint import (
    STATE_TAG,
    Stored,
    checkpoint_config,
    checkpoint_hash,
    config_hash,
    meta_model,
    model_sources,
    read_config,
    read_rows,
    stored_dtype,
    tensor_frame,
    weight_files,
)
from training.compressed import CompressedModel, compress
from training.experts import PARAMS, ExpertGroup, check_group, parse_name, tensor_name
from training.tiny import build_tiny_model, meta_tiny_model

DeviceMap = str | dict[str, Any] | None

_SYNC_LOAD_ENV = "HF_DEACTIVATE_ASYNC_LOAD"


class BaseMismatchError(ValueError):
    """The base model does not hash to the spec's `base_hash`, or its config not to `config_sha256`."""


def load_checkpoint(
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device_map: DeviceMap = None,
    attn_implementation: str = "sdpa",
    progress: bool = False,
) -> PreTrainedModel:
    """Load a local HF checkpoint directory with transformers' `from_pretrained`, in eval mode.

    The safetensors files are opened with pread and handed to `from_pretrained` as lazy slices, and
    transformers' asynchronous read-ahead is switched off for the call, so the peak memory is the
    model plus about one fused tensor in flight (bench/load.py measures it).

    `dtype` None keeps the checkpoint's dtype; `device_map` is passed to transformers (e.g. "auto",
    "cpu", {"": 0}); `attn_implementation` "sdpa" by default, "eager" where bit-exactness matters;
    `progress` shows transformers' loading bar when stderr is a terminal (operator commands).
    """
    directory = Path(directory)
    meta_model(directory)  # a config.json no model can be built from is refused here, before any weight is read
    return _from_pretrained(directory, checkpoint_config(directory), dtype, device_map, attn_implementation,
                            progress, skip_keys=set(), placeholders={})


def load_compressed(
    directory: str | Path,
    group: ExpertGroup,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    progress: bool = False,
) -> CompressedModel:
    """The compressed model Θ̃0 of `group` from a checkpoint, on the CPU, never holding an unselected expert.

    Everything but the group layers' fused experts loads through `from_pretrained` as in
    `load_checkpoint`; those come from `training.checkpoint.read_rows`, which reads just the group's
    experts: from hub per-expert checkpoints (what transformers 5 `save_pretrained` writes) only
    the selected experts' keys, from fused-key checkpoints only their rows. The unselected experts
    are never read, so the process never holds them; the result equals `compress` of the full
    model, tensor for tensor.
    """
    directory = Path(directory)
    config = checkpoint_config(directory)
    adapter = adapter_for(config.model_type)
    meta = meta_model(directory)
    check_group(meta, adapter, group)
    fused = expert_tensor_names(meta, adapter, list(group))
    shapes = {name: tuple(meta.get_parameter(name).shape) for name in fused.values()}
    sources = model_sources(directory)
    model = _from_pretrained(directory, config, dtype, None, attn_implementation, progress,
                             skip_keys={part.key for name in shapes for part in sources[name]}, placeholders=shapes)
    load_dtype = dtype or stored_dtype(config)
    rows = {layer: {param: read_rows(sources[fused[layer, param]], shapes[fused[layer, param]],
                                     sorted(group[layer])).to(load_dtype) for param in PARAMS}
            for layer in group}
    return compress(model, adapter, group, rows=rows)


class StoredExperts(Mapping[str, torch.Tensor]):
    """`group`'s experts in a checkpoint, named by full expert id (the blob format), in the stored dtype, each
    read from the checkpoint's files when asked for (`training.checkpoint.read_rows`) and not kept.

    A compressed miner's genesis state: the base's experts at no memory (0.4 GB in bf16 for OLMoE-1B-7B's
    two experts a layer), where its model's own rows are overwritten as it trains. The files are read as they
    are when asked; the node checked them against `base_hash` when it loaded the model, and they must not
    change while it runs.
    """

    def __init__(self, directory: str | Path, group: ExpertGroup) -> None:
        meta = meta_model(directory)
        adapter = adapter_for(meta.config.model_type)
        check_group(meta, adapter, group)
        fused = expert_tensor_names(meta, adapter, sorted(group))
        sources = model_sources(directory)
        self._where: dict[str, tuple[list[Stored], tuple[int, ...]]] = {}
        for layer, experts in sorted(group.items()):
            for param in PARAMS:
                name = fused[layer, param]
                where = (sources[name], tuple(meta.get_parameter(name).shape))
                for expert in experts:
                    self._where[tensor_name(layer, expert, param)] = where
        self.shapes = {name: shape[1:] for name, (_, shape) in sorted(self._where.items())}
        """Name -> shape of each tensor, sorted: known without reading one."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        parts, shape = self._where[name]
        return read_rows(parts, shape, [parse_name(name)[1]])[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def base_experts(spec: NetworkSpec, spec_path: str | Path, model: CompressedModel) -> Mapping[str, torch.Tensor]:
    """The base's group experts in the dtype `model` (`load_compressed_base`'s) holds them: a checkpoint's read
    from its files when asked for (`StoredExperts`), a tiny base's copied out of `model`."""
    if spec.model.config is not None:
        return model.tensors(tensor_attr(model.experts(min(model.group)), "gate_up_proj").dtype)
    assert spec.model.checkpoint is not None, "the spec validator requires config or checkpoint"
    return StoredExperts(spec_dir_path(spec_path, spec.model.checkpoint), spec.group)


def expert_tensor_names(model: torch.nn.Module, adapter: MoEAdapter, layers: list[int]) -> dict[tuple[int, str], str]:
    """(layer, param) -> the name in `model.state_dict()` of that layer's fused expert tensor, for each of `layers`."""
    names = {id(t): name for name, t in model.named_parameters()}
    return {(layer, param): names[id(getattr(adapter.experts(model, layer), param))]
            for layer in layers for param in PARAMS}


def load_base(
    spec: NetworkSpec,
    spec_path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device_map: DeviceMap = None,
    attn_implementation: str | None = None,
    progress: bool = False,
) -> tuple[PreTrainedModel, MoEAdapter]:
    """The spec's base model and its adapter; refuses a base that does not hash to `base_hash` (or whose
    config does not hash to `config_sha256`).

    A tiny model (`model.config`) is built in fp32 with eager attention on the CPU. A checkpoint is
    hashed from its files first, then loaded with `load_checkpoint(dtype, device_map,
    attn_implementation or "sdpa", progress)`.
    """
    adapter = adapter_for(spec.model.family)
    if spec.model.config is not None:
        model = _tiny_base(spec, spec_path)
    else:
        model = load_checkpoint(checked_checkpoint(spec, spec_path), dtype=dtype, device_map=device_map,
                                attn_implementation=attn_implementation or "sdpa", progress=progress)
    check_group(model, adapter, spec.group)
    return model, adapter


def load_compressed_base(
    spec: NetworkSpec,
    spec_path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    progress: bool = False,
) -> CompressedModel:
    """The spec's compressed model Θ̃0 for its group, on the CPU; refuses a base that does not hash to `base_hash`.

    A tiny model is built whole (it is small) and cut with `compress`. A checkpoint is hashed from
    its files, then loaded with `load_compressed`, so its unselected experts are never held.
    """
    if spec.model.config is not None:
        return compress(_tiny_base(spec, spec_path), adapter_for(spec.model.family), spec.group)
    return load_compressed(checked_checkpoint(spec, spec_path), spec.group, dtype=dtype,
                           attn_implementation=attn_implementation or "sdpa", progress=progress)


def meta_base(spec: NetworkSpec, spec_path: str | Path) -> PreTrainedModel:
    """The spec's base model on the meta device: the checkpoint's config.json or the tiny config; reads no weights."""
    if spec.model.checkpoint is not None:
        directory = spec_dir_path(spec_path, spec.model.checkpoint)
        model = meta_model(directory)
        if model.config.model_type != spec.model.family:
            raise ValueError(f"{directory}: the checkpoint is {model.config.model_type!r}, "
                             f"but the spec's family is {spec.model.family!r}")
        return model
    return meta_tiny_model(spec.model.family, spec_model_config(spec, spec_path))


def moe_experts(model: torch.nn.Module, adapter: MoEAdapter) -> dict[int, int]:
    """The model's MoE layers -> how many routed experts each holds."""
    count = adapter.num_experts(model)
    return {layer: count for layer in adapter.moe_layers(model)}


def spec_model_config(spec: NetworkSpec, spec_path: str | Path) -> dict[str, Any]:
    """The JSON object the spec's `model.config` names; ValueError naming the file when it is not one."""
    assert spec.model.config is not None, "only a spec with model.config has a tiny base"
    config_path = spec_dir_path(spec_path, spec.model.config)
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read the model config named by model.config: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: the model config must be a JSON object")
    return config


def _tiny_base(spec: NetworkSpec, spec_path: str | Path) -> PreTrainedModel:
    """The spec's tiny model (`model.config` + `init_seed`), checked against `base_hash`."""
    config = spec_model_config(spec, spec_path)
    assert spec.model.config is not None, "only a spec with model.config has a tiny base"
    _check_config(config, spec, spec_dir_path(spec_path, spec.model.config))
    model = build_tiny_model(spec.model.family, config, spec.model.init_seed)
    _check_hash(state_hash(model), spec.model.base_hash)
    return model


def checked_checkpoint(spec: NetworkSpec, spec_path: str | Path) -> Path:
    """The spec's checkpoint directory, once its family, config hash and streamed hash match the spec
    (BaseMismatchError when they do not)."""
    assert spec.model.checkpoint is not None, "the spec validator requires config or checkpoint"
    directory = spec_dir_path(spec_path, spec.model.checkpoint)
    config = read_config(directory)
    family = family_of(config)
    if family != spec.model.family:
        raise ValueError(f"{directory}: the checkpoint is {family!r}, but the spec's family is {spec.model.family!r}")
    _check_config(config, spec, directory / "config.json")
    _check_hash(checkpoint_hash(directory), spec.model.base_hash)
    return directory


def state_hash(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and persistent buffer in canonical form (training/checkpoint.py)."""
    digest = hashlib.sha256(STATE_TAG)
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        dtype = str(data.dtype).removeprefix("torch.")
        flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.zeros(0, dtype=torch.uint8)
        digest.update(tensor_frame(name, dtype, tuple(data.shape), flat.numel()))
        digest.update(flat.numpy().data)
    return digest.hexdigest()


def _from_pretrained(
    directory: Path,
    config: PretrainedConfig,
    dtype: torch.dtype | None,
    device_map: DeviceMap,
    attn_implementation: str,
    progress: bool,
    skip_keys: set[str],
    placeholders: dict[str, tuple[int, ...]],
) -> PreTrainedModel:
    """`from_pretrained` over lazy pread slices of the checkpoint, never reading the keys in `skip_keys`.

    The model tensors those keys make (`placeholders`, name -> shape) are handed to transformers as
    zero-strided views of one scalar (no memory, nothing read) and replaced by empty tensors on the
    meta device once the model is loaded.
    """
    files = weight_files(directory)
    load_dtype = dtype or stored_dtype(config)
    model: PreTrainedModel
    info: dict[str, Any]
    try:
        with ExitStack() as stack, _synchronous_loading(), _progress_bar(progress and sys.stderr.isatty()):
            # pread, not mmap: mapped file pages would count against the process twice over.
            slices: dict[str, Any] = {}
            for path in files:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu", backend="pread"))
                slices.update({key: handle.get_slice(key) for key in handle.keys() if key not in skip_keys})
            for name, shape in placeholders.items():
                slices[name] = torch.zeros((), dtype=load_dtype).expand(shape)
            # transformers types this mapping's values as pairs of classes (a lookup gives one class) and
            # from_pretrained as returning only the model (output_loading_info adds the loading info).
            model, info = cast(Any, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]).from_pretrained(
                None, config=config, state_dict=slices, dtype=load_dtype,
                device_map=device_map, attn_implementation=attn_implementation,
                experts_implementation="eager", output_loading_info=True, ignore_mismatched_sizes=True,
            )
    except (OSError, SafetensorError, RuntimeError) as exc:  # unreadable files; weights it could not convert
        raise ValueError(f"{directory}: transformers cannot load this checkpoint: {exc}") from exc
    problems = sorted(info["missing_keys"]) + sorted(str(m) for m in info["mismatched_keys"])
    if problems:
        raise ValueError(f"{directory}: weights do not match the config (missing or mismatched: {problems[:3]})")
    for name in placeholders:
        module, _, attr = name.rpartition(".")
        placeholder = model.get_parameter(name)
        assert placeholder.stride()[0] == 0, f"transformers copied the placeholder of {name}"
        setattr(model.get_submodule(module), attr, torch.nn.Parameter(
            torch.empty(placeholder.shape, dtype=placeholder.dtype, device="meta"),
            requires_grad=placeholder.requires_grad))
    adapter_for(config.model_type).check_layout(model)
    return model.eval()  # type: ignore[no-untyped-call, no-any-return]  # unannotated in transformers


@contextmanager
def _progress_bar(shown: bool) -> Iterator[None]:
    """Inside, transformers' loading bar is shown or not; after, its process-wide switch is as it was."""
    was_shown = hf_logging.is_progress_bar_enabled()
    switch = hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar
    switch()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_shown else hf_logging.disable_progress_bar)()  # type: ignore[no-untyped-call]


@contextmanager
def _synchronous_loading() -> Iterator[None]:
    """Inside, transformers reads each tensor when it converts it, not all of them ahead on threads.

    transformers offers this only as an environment variable, read when a load starts; a load that
    starts on another thread meanwhile also runs synchronously, which is slower but not wrong.
    """
    previous = os.environ.get(_SYNC_LOAD_ENV)
    os.environ[_SYNC_LOAD_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_SYNC_LOAD_ENV, None)
        else:
            os.environ[_SYNC_LOAD_ENV] = previous


def _check_hash(actual: str, expected: str) -> None:
    if actual != expected:
        raise BaseMismatchError(
            f"the base model hashes to {actual} but the spec's model.base_hash is {expected}; "
            "this node has a different base model than the network"
        )


def _check_config(config: dict[str, Any], spec: NetworkSpec, path: Path) -> None:
    """Refuse a model config other than the one the spec pins (when it pins one): the base hash covers
    weights only, and a config that routes or normalises differently gives every loss another value."""
    expected = spec.model.config_sha256
    if expected is None:
        return
    try:
        actual = config_hash(config)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if actual != expected:
        raise BaseMismatchError(
            f"{path}: the model config hashes to {actual} but the spec's model.config_sha256 is {expected}; "
            "this node's config differs from the network's (any value counts, e.g. num_experts_per_tok or "
            "rope settings): use the config file the network started from"
        )
