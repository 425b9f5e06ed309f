"""`check_header_cap` (run by `spec new`, `spec check` and `select-experts --into`) also bounds the headers
of the global state and momentum blobs validators write and every node reads.

They hold fp32 tensors and name no miner, so in a bf16 network their offsets are twice a submission's
and can take a digit more: for Qwen3-30B-A3B's experts, 22 per layer in its 48 layers, a cap that fits
every miner's blob exactly is too small for the network's own states, and every node would refuse them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from node.cli.spec import check_header_cap, submission_header_bytes
from protocol.spec import parse_spec
from training.adapters import adapter_for
from training.blob import BlobMeta, header_size
from training.experts import expected_shapes, extract, tensor_name
from training.state import MOMENTUM_FORMAT, GlobalExperts
from training.tiny import build_tiny_model, tiny_config


def _qwen3_30b_group(spec_dict: dict[str, Any], cap: int) -> tuple[Any, dict[str, tuple[int, ...]]]:
    layers, experts = 48, 22
    spec_dict["model"]["dtype"] = "bfloat16"
    spec_dict["group"] = {str(layer): list(range(experts)) for layer in range(layers)}
    spec_dict["limits"] = {"max_header_bytes": cap}
    shapes = {}
    for layer in range(layers):
        for expert in range(experts):
            shapes[tensor_name(layer, expert, "gate_up_proj")] = (1536, 2048)
            shapes[tensor_name(layer, expert, "down_proj")] = (2048, 768)
    return parse_spec(spec_dict), shapes


def test_a_cap_that_fits_every_submission_but_not_the_states_is_refused(spec_dict: dict[str, Any]) -> None:
    spec, shapes = _qwen3_30b_group(spec_dict, 1 << 20)
    momentum = BlobMeta(network=spec.network_id, round=999_999_999, miner="", base="f" * 64,
                        group={layer: list(ids) for layer, ids in spec.group.items()}, format=MOMENTUM_FORMAT)
    submission = submission_header_bytes(spec, shapes)
    state = header_size({name: ("F32", shape) for name, shape in shapes.items()}, momentum)
    assert submission < state
    spec, shapes = _qwen3_30b_group(spec_dict, submission)
    with pytest.raises(ValueError) as refused:
        check_header_cap(spec, shapes)
    assert str(refused.value) == (
        f"limits.max_header_bytes ({submission}) is too small: the validators' global state and momentum blobs "
        f"for this expert group can need a header of up to {state} bytes, and every node refuses a blob over the "
        f"limit; raise it to {state} (`spec new`: --set limits.max_header_bytes={state}; a spec file: its [limits]) "
        "or choose fewer experts (--top-d, --mass, the group)")
    spec, shapes = _qwen3_30b_group(spec_dict, state)
    check_header_cap(spec, shapes)


def test_the_state_bound_is_the_validators_own_header_at_its_largest(spec_dict: dict[str, Any]) -> None:
    from node.cli.spec import state_header_bytes

    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 7)
    adapter = adapter_for("qwen3_moe")
    spec = parse_spec(spec_dict)
    shapes = expected_shapes(model, adapter, spec.group)
    genesis = GlobalExperts.genesis(spec, extract(model, adapter, spec.group))
    state = genesis.child(999_999_999, genesis.tensors,
                          {name: torch.ones_like(t) for name, t in genesis.momentum.items()})
    headers = [int.from_bytes(blob[:8], "little") for blob in (state.to_blob(), state.momentum_blob())]
    assert max(headers) == state_header_bytes(spec, shapes)
