"""Tiny models for simulation and tests: the six families' small configs and a seeded, thread-safe builder.

`tiny_config(family)` gives a small JSON-able config; `build_tiny_model` builds that family's model
from such a dict with no weights on the meta device (`meta_tiny_model`; transformers runs no init
there), moves it to the CPU and initialises every tensor explicitly from a local `torch.Generator`,
by the rule `INIT_RULE` names (see `_initialise`). Neither torch's global RNG nor any library function is
touched, so concurrent builds on other threads cannot change a model's bytes. `hf_config` turns a
config dict (a tiny one, or a checkpoint's config.json) into the family's transformers config.
This module knows nothing about checkpoints, training or the network.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from training.adapters import MoEAdapter, adapter_for

INIT_RULE = "tessera-init/2"
"""Names `build_tiny_model`'s init rule; bump it when the rule changes (pretrained bases are cached by it)."""

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
_DEEPSEEK = {
    **_COMMON,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "routed_scaling_factor": 1.0,
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
    "qwen2_moe": {
        **_COMMON,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 8,
    },
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": {**_DEEPSEEK, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0},
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A small JSON-able config for `family`: hidden 64, 2 MoE layers of 8 experts, top-2, vocab 260.

    The vocabulary fits the byte tokenizer: ids 0-255 are bytes, 256 pad, 257 bos, 258 eos, 259 spare.
    The DeepSeek families get one extra dense first layer, as their real configs have.
    """
    adapter_for(family)
    return {**_TINY[family], **overrides}


def build_tiny_model(
    family: str, config: dict[str, Any], seed: int | None = None, *, generator: torch.Generator | None = None
) -> PreTrainedModel:
    """A freshly initialised fp32 model of `family` from a config dict, drawn from `generator`.

    Give either a generator or a seed (which seeds a local generator). The same seed gives the same
    bytes on every thread and every run; torch's global RNG is neither read nor advanced.
    """
    assert (seed is None) != (generator is None), "give exactly one of seed or generator"
    model = meta_tiny_model(family, config)
    with torch.device("cpu"):  # a caller's device context would leave the rotary buffers on it
        model.to_empty(device="cpu")
        if model.config.tie_word_embeddings:  # to_empty gives each tied name its own tensor
            # Tied here rather than by `model.tie_weights()`: transformers' from_pretrained swaps that method for
            # a no-op on the class while it loads, and two loads on two threads can leave the no-op in place.
            output = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
            output.weight = model.get_input_embeddings().weight
        _initialise(model, generator if generator is not None else torch.Generator().manual_seed(cast(int, seed)))
    return model


def meta_tiny_model(family: str, config: dict[str, Any]) -> PreTrainedModel:
    """`build_tiny_model`'s model with no weights (on the meta device), in eval mode: names, shapes, layout."""
    adapter = adapter_for(family)
    with torch.device("meta"):  # transformers runs no weight init on the meta device
        # transformers leaves from_config unannotated.
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            hf_config(adapter, config), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager",
        )
    adapter.check_layout(model)
    return model.eval()  # type: ignore[no-untyped-call, no-any-return]  # unannotated in transformers


def hf_config(adapter: MoEAdapter, config: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of `adapter`'s family from a config dict; ValueError when it is not one."""
    model_type = config.get("model_type", adapter.family)
    if model_type != adapter.family:
        raise ValueError(
            f"the model config is for {model_type!r}, but the spec's family is {adapter.family!r}"
        )
    try:
        return AutoConfig.for_model(adapter.family, **{k: v for k, v in config.items() if k != "model_type"})
    except (AttributeError, TypeError, ValueError, StrictDataclassError) as exc:  # e.g. an unknown dtype name
        raise ValueError(f"invalid {adapter.family} model config: {exc}") from exc


@torch.no_grad()
def _initialise(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Fill every parameter and buffer of a model fresh from `to_empty`: the `INIT_RULE` rule.

    Parameters and persistent buffers, in name order, tied ones once: biases (the router's
    correction bias too) zeros, norm weights ones, everything else (projections, fused experts,
    routers, embeddings) normal(0, initializer_range) drawn from `generator`; then the padding
    token's embedding row is zeroed. That is transformers' own `_init_weights` in spirit. The
    rotary embeddings' non-persistent `inv_freq` buffers are computed from the config again.
    """
    std = model.config.initializer_range
    seen: set[int] = set()
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        owner, _, kind = name.rpartition(".")
        if kind.endswith("bias"):
            tensor.zero_()
        elif _is_norm(model.get_submodule(owner)):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    persistent = model.state_dict().keys()
    transient = {name for name, _ in model.named_buffers() if name not in persistent}
    rotary = {f"{prefix}.{buffer}".lstrip(".") for prefix, module in model.named_modules()
              if hasattr(module, "original_inv_freq") for buffer in ("inv_freq", "original_inv_freq")}
    assert transient == rotary, f"no init rule for the buffers {sorted(transient - rotary)}"
    for module in model.modules():
        if hasattr(module, "original_inv_freq"):
            inv_freq = _rope_inv_freq(module)
            module.get_buffer("inv_freq").copy_(inv_freq)
            module.get_buffer("original_inv_freq").copy_(inv_freq)


def _is_norm(module: torch.nn.Module) -> bool:
    """transformers' own test: its norm classes are named per family (`Qwen3MoeRMSNorm`, ...)."""
    return "RMSNorm" in type(module).__name__ or "LayerNorm" in type(module).__name__


def _rope_inv_freq(rotary: torch.nn.Module) -> torch.Tensor:
    """A rotary embedding's inverse frequencies, computed from its config as its constructor does."""
    rope_type = cast(str, rotary.rope_type)
    compute: Callable[..., tuple[torch.Tensor, float]]
    if rope_type == "default":
        compute = cast(Callable[..., tuple[torch.Tensor, float]], rotary.compute_default_rope_parameters)
    else:
        compute = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = compute(rotary.config)
    return inv_freq
