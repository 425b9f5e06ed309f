"""Tiny qwen3_moe models whose routing is planted, so a test knows which experts a domain uses.

`planted_domains()`: two embedding coordinates are overwritten, `K` constant for every token and `J`
positive on arithmetic bytes (digits and operators) and negative elsewhere. In every MoE layer the
router row of expert U reads `K` (U is popular everywhere), A reads `+J` (arithmetic) and B reads
`-J` (everything else); all other router weights on those coordinates are zeroed. With top-2
routing, arithmetic tokens go to {U, A} and prose tokens to {U, B} in every layer. With
`harmful=True` every other expert writes a large value into coordinate Q, which the LM head turns
into a confident prediction of token 0 (never a target), so any pruned model that keeps one of
them has a much higher loss.

`planted_chain(dependency)`: in layer 0 every token goes to P (router weight 3 on `K`) and C (2.9);
in layer 1 expert Y reads `K` and expert X reads coordinate M, which the embeddings set negative.
With `dependency=True` expert C of layer 0 writes a large positive M, so in the full model layer 1
routes to X, but once layer 0 is pruned to P alone it routes to Y.
"""

from __future__ import annotations

import torch

from training.adapters import MoEAdapter, adapter_for
from training.corpus import generate
from training.data import pack
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer

U, A, B = 5, 2, 6
P, C, X, Y = 1, 4, 6, 3
J, K, M, Q = 3, 7, 11, 13
ARITH_BYTES = [ord(c) for c in "0123456789+-*()="]
SEQ_LEN = 64


def _tiny() -> tuple[torch.nn.Module, MoEAdapter]:
    return build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), seed=0), adapter_for("qwen3_moe")


def _write_constant(experts: torch.nn.Module, expert: int, coordinate: int, value: float) -> None:
    """Make `expert` read the constant coordinate K and write `value` (> 0 scaled) into `coordinate`."""
    experts.gate_up_proj[expert] = 0.0
    experts.gate_up_proj[expert][:, K] = 1.0
    experts.down_proj[expert] = 0.0
    experts.down_proj[expert][coordinate, :] = value


@torch.no_grad()
def planted_domains(harmful: bool = False) -> tuple[torch.nn.Module, MoEAdapter]:
    model, adapter = _tiny()
    emb = model.get_input_embeddings().weight
    emb[:, K] = 4.0
    emb[:, J] = -4.0
    emb[ARITH_BYTES, J] = 4.0
    emb[:, Q] = 0.0
    for layer in adapter.moe_layers(model):
        w = adapter.router(model, layer).weight
        w[:, J] = 0.0
        w[:, K] = 0.0
        w[U, K] = 2.0
        w[A, J] = 2.0
        w[B, J] = -2.0
        if harmful:
            for expert in set(range(adapter.num_experts(model))) - {U, A}:
                _write_constant(adapter.experts(model, layer), expert, Q, 0.5)
    if harmful:
        head = model.get_output_embeddings().weight
        head[:, Q] = 0.0
        head[0, Q] = 5.0
    return model, adapter


@torch.no_grad()
def planted_chain(dependency: bool) -> tuple[torch.nn.Module, MoEAdapter]:
    model, adapter = _tiny()
    first, second = adapter.moe_layers(model)
    emb = model.get_input_embeddings().weight
    emb[:, K] = 4.0
    emb[:, M] = -2.0
    for layer in (first, second):
        w = adapter.router(model, layer).weight
        w[:, K] = 0.0
        w[:, M] = 0.0
    adapter.router(model, first).weight[P, K] = 3.0
    adapter.router(model, first).weight[C, K] = 2.9
    adapter.router(model, second).weight[X, M] = 3.0
    adapter.router(model, second).weight[Y, K] = 1.0
    if dependency:
        _write_constant(adapter.experts(model, first), C, M, 0.1)
    return model, adapter


def documents(domain: str, n: int, seed: int = 11) -> list[torch.Tensor]:
    """`n` documents of a synthetic domain, each packed on its own into [rows, SEQ_LEN]."""
    return [pack([doc], ByteTokenizer(), SEQ_LEN) for doc in generate(domain, n, seed)]


def rows(domain: str, n: int, seed: int = 11) -> torch.Tensor:
    """`n` packed rows [n, SEQ_LEN] of a synthetic domain."""
    return pack(generate(domain, 5 * n, seed), ByteTokenizer(), SEQ_LEN)[:n]
