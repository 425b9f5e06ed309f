"""A validator's frozen weights held in int8 (`[validator] weights = "int8"`): the Scorer loads them so and scores
within a hair of the checkpoint's weights; routers, experts and a tied output layer stay as they are; the memory
plan traces it."""

from __future__ import annotations

import copy

import torch

from protocol.spec import NetworkSpec
from training.adapters import adapter_for
from training.corpus import generate
from training.data import pack
from training.device import Int8Linear, hold_int8
from training.plan import Setting, plan
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer
from validator.scoring import Scorer

FAMILY = "qwen3_moe"


def test_a_scorer_holding_int8_weights_scores_within_a_hundredth_of_the_checkpoints(spec: NetworkSpec) -> None:
    model = build_tiny_model(FAMILY, tiny_config(FAMILY), seed=0)
    adapter = adapter_for(FAMILY)
    group = {layer: [0, 1] for layer in adapter.moe_layers(model)}
    data = spec.data.model_copy(update={"seq_len": 64, "heldout_sequences": 6})
    spec = spec.model_copy(update={"group": group, "data": data})
    heldout = pack(generate("prose", 40, seed=1), ByteTokenizer(), 64)
    checkpoint = Scorer(copy.deepcopy(model), adapter, spec, heldout)
    int8 = Scorer(model, adapter, spec, heldout, weights="int8")
    held = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    assert held and all(m.w_OI.dtype == torch.int8 for m in held)
    expected, got = checkpoint.loss(heldout[:6]), int8.loss(heldout[:6])
    assert abs(got - expected) <= 0.01 * expected, (got, expected)


def test_routers_experts_and_a_tied_output_layer_keep_their_weights() -> None:
    config = {**tiny_config(FAMILY), "tie_word_embeddings": True}
    model = build_tiny_model(FAMILY, config, seed=0)
    adapter = adapter_for(FAMILY)
    routers = [adapter.router(model, layer) for layer in adapter.moe_layers(model)]
    experts = {name: t.clone() for name, t in model.state_dict().items() if ".experts." in name}
    swapped = hold_int8(model, routers)
    assert swapped == 4 * config["num_hidden_layers"]  # q, k, v and o of every layer; not lm_head, tied
    assert not isinstance(model.lm_head, Int8Linear) and model.lm_head.weight is model.get_input_embeddings().weight
    assert all(not isinstance(r, Int8Linear) for r in routers)
    assert all(torch.equal(model.state_dict()[name], t) for name, t in experts.items())


def test_the_plan_of_an_int8_validator_holds_fewer_weight_bytes() -> None:
    setting = Setting(role="validator", seq_len=32, micro_batch=2, device="cpu")
    plans = {weights: plan(tiny_config(FAMILY), Setting(**{**vars(setting), "weights": weights}), 2, family=FAMILY,
                           dtype=torch.float32, attn_implementation="eager") for weights in ("checkpoint", "int8")}
    assert plans["int8"].parts["weights"] < plans["checkpoint"].parts["weights"]
