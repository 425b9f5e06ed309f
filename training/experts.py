"""Expert slicing: the named tensors of an expert group, cut from and written into the fused model.

A group maps MoE layer -> expert ids. Its tensors have fixed names
    layers.{l}.experts.{e}.gate_up_proj   [2I, H]   (rows [gate; up], as in the fused model)
    layers.{l}.experts.{e}.down_proj      [H, I]
and every ordered walk over them (blobs, `flatten`, norms, cosines) uses the names sorted as
strings. This module also defines the pseudo-gradient G = global - miner. It knows nothing about
training, blobs or the network.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from training.adapters import MoEAdapter, tensor_attr

if TYPE_CHECKING:  # only a type here; keeps training/ importable where pydantic is absent (bench/gpu.py)
    from protocol.spec import NetworkSpec

ExpertGroup = Mapping[int, Sequence[int]]
Tensors = Mapping[str, torch.Tensor]
PARAMS = ("gate_up_proj", "down_proj")
_NAME = re.compile(r"layers\.(?P<layer>\d+)\.experts\.(?P<expert>\d+)\.(?P<param>gate_up_proj|down_proj)")


def tensor_name(layer: int, expert: int, param: str) -> str:
    """The fixed name of one expert tensor."""
    assert param in PARAMS, f"unknown expert parameter {param}"
    return f"layers.{layer}.experts.{expert}.{param}"


def parse_name(name: str) -> tuple[int, int, str]:
    """(layer, expert, param) of an expert tensor name; ValueError if it is not one."""
    match = _NAME.fullmatch(name)  # not match(...$): `$` also matches before a trailing newline
    if match is None:
        raise ValueError(f"{name!r} is not an expert tensor name like layers.0.experts.3.gate_up_proj")
    return int(match["layer"]), int(match["expert"]), match["param"]


def expert_names(group: ExpertGroup) -> list[str]:
    """Every tensor name of `group`, sorted."""
    return sorted(
        tensor_name(layer, e, p) for layer, experts in group.items() for e in experts for p in PARAMS
    )


def group_from_spec(spec: NetworkSpec) -> dict[int, list[int]]:
    """The spec's expert group keyed by layer, experts ascending."""
    return {layer: sorted(experts) for layer, experts in sorted(spec.group.items())}


def check_group(model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup) -> None:
    """Refuse a group that names a dense or missing layer or an expert the model does not have."""
    if not group:
        raise ValueError("the expert group is empty")
    moe_layers = adapter.moe_layers(model)
    n_experts = adapter.num_experts(model)
    for layer, experts in group.items():
        if layer not in moe_layers:
            raise ValueError(
                f"group layer {layer} is not an MoE layer of the model; MoE layers: {moe_layers}"
            )
        if not experts or len(set(experts)) != len(experts):
            raise ValueError(f"group layer {layer}: expert ids must be distinct and at least one")
        bad = [e for e in experts if not 0 <= e < n_experts]
        if bad:
            raise ValueError(f"group layer {layer}: experts {bad} do not exist (the model has {n_experts})")


def expected_shapes(
    model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of `group` in this model."""
    check_group(model, adapter, group)
    shapes: dict[str, tuple[int, ...]] = {}
    for layer, experts in group.items():
        module = adapter.experts(model, layer)
        gate_up_EIH, down_EHI = tensor_attr(module, "gate_up_proj"), tensor_attr(module, "down_proj")
        for e in experts:
            shapes[tensor_name(layer, e, "gate_up_proj")] = tuple(gate_up_EIH.shape[1:])
            shapes[tensor_name(layer, e, "down_proj")] = tuple(down_EHI.shape[1:])
    return dict(sorted(shapes.items()))


@torch.no_grad()
def extract(
    model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of `group`'s expert rows, by name, sorted."""
    check_group(model, adapter, group)
    out: dict[str, torch.Tensor] = {}
    for name in expert_names(group):
        layer, expert, param = parse_name(name)
        fused = getattr(adapter.experts(model, layer), param)
        out[name] = fused[expert].detach().to(device="cpu", dtype=dtype).clone().contiguous()
    return out


@torch.no_grad()
def insert(model: torch.nn.Module, adapter: MoEAdapter, tensors: Tensors) -> None:
    """Write named expert tensors into the model's fused rows in place; all are checked before any is.

    Values are cast to the model's dtype, so fp32 tensors into an fp32 model round-trip bit-exactly. Each
    tensor is taken from `tensors` once to check it and once to write it, and none is kept in between, so
    a mapping that reads its tensors when asked for (validator.accepted) costs one tensor at a time.
    """
    n_experts = adapter.num_experts(model)
    moe_layers = adapter.moe_layers(model)
    targets: list[tuple[str, torch.Tensor, int]] = []
    for name in sorted(tensors):
        layer, expert, param = parse_name(name)
        if layer not in moe_layers:
            raise ValueError(
                f"{name}: layer {layer} is not an MoE layer of the model; MoE layers: {moe_layers}"
            )
        if expert >= n_experts:
            raise ValueError(f"{name}: expert {expert} does not exist (the model has {n_experts})")
        fused = getattr(adapter.experts(model, layer), param)
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(fused.shape[1:]):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}, the model expects {tuple(fused.shape[1:])}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        targets.append((name, fused, expert))
    for name, fused, expert in targets:
        fused[expert].copy_(tensors[name].to(device=fused.device, dtype=fused.dtype))


def pseudo_gradient(global_tensors: Tensors, miner_tensors: Tensors) -> dict[str, torch.Tensor]:
    """G = Φ_global − Φ_miner per name, in fp32 on the CPU; both sides must name the same tensors."""
    return dict(PseudoGradient(global_tensors, miner_tensors))


class PseudoGradient(Mapping[str, torch.Tensor]):
    """G = Φ_global − Φ_miner as a mapping that computes each tensor when asked for it (fp32, CPU, sorted
    names) and keeps none: a walk over it name by name holds one tensor of G at a time, where the whole
    of it is the size of the group in fp32 (0.8 GB for OLMoE-1B-7B's two experts a layer)."""

    def __init__(self, global_tensors: Tensors, miner_tensors: Tensors) -> None:
        check_same_names(global_tensors, miner_tensors, "miner")
        self._global, self._miner = global_tensors, miner_tensors
        self._names = sorted(global_tensors)

    def __getitem__(self, name: str) -> torch.Tensor:
        g, m = self._global[name], self._miner[name]
        if g.shape != m.shape:
            raise ValueError(f"{name}: miner shape {tuple(m.shape)} differs from global {tuple(g.shape)}")
        return g.detach().to("cpu", torch.float32) - m.detach().to("cpu", torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def flatten(tensors: Tensors) -> torch.Tensor:
    """All tensors as one 1-D fp32 CPU vector, concatenated in sorted-name order."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(
        [tensors[name].detach().to("cpu", torch.float32).reshape(-1) for name in sorted(tensors)]
    )


def check_same_names(reference: Mapping[str, object], other: Mapping[str, object], what: str) -> None:
    """Refuse `other` unless it names exactly the tensors of `reference` (only the names are read)."""
    missing = sorted(reference.keys() - other.keys())
    extra = sorted(other.keys() - reference.keys())
    if missing or extra:
        raise ValueError(
            f"{what} tensors do not match the global set (missing {missing[:3]}, extra {extra[:3]})"
        )
