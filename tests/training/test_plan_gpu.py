"""On a CUDA machine: the memory plan, traced on fake CPU tensors, is within a tenth of the peak the same miner
step and validator pass allocate on the GPU (`torch.cuda.max_memory_allocated`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from training.adapters import adapter_for
from training.evaluate import loss_with_experts
from training.experts import extract
from training.plan import Setting, first_experts, plan
from training.trainer import TrainConfig, train_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAMILY = "qwen3_moe"
CONFIG = {"num_hidden_layers": 4, "num_experts": 32, "hidden_size": 1024, "moe_intermediate_size": 512,
          "intermediate_size": 2048, "num_experts_per_tok": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 2048, "norm_topk_prob": True}
"""Big enough (about 1.5 GiB at its peak) that the allocator's 512-byte rounding and cuBLAS's workspace,
which the plan leaves to its margin, stay far below a tenth of it."""
SEQ_LEN, MICRO_BATCH, PER_LAYER = 512, 2, 4


def real_model() -> Any:
    config = AutoConfig.for_model(FAMILY, **CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa",
                                             experts_implementation="eager")
    return model.to("cuda").eval()


def planned(setting: Setting) -> int:
    return plan({"model_type": FAMILY, **CONFIG}, setting, PER_LAYER, family=FAMILY, dtype=torch.float32,
                attn_implementation="sdpa").peak_bytes


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_a_miner_steps_gpu_peak_is_within_a_tenth_of_its_plan(optimizer: str) -> None:
    setting = Setting(role="miner", seq_len=SEQ_LEN, micro_batch=MICRO_BATCH, device="cuda", forward="full",
                      optimizer=optimizer)  # type: ignore[arg-type]
    model = real_model()
    adapter = adapter_for(FAMILY)
    group = first_experts(model, adapter, PER_LAYER)
    ids_BL = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ_LEN))
    cfg = TrainConfig(steps=1, batch_size=MICRO_BATCH, forward="full", device="cuda", autocast=False, pad_id=-1,
                      experts_implementation="eager", optimizer=optimizer)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_experts(model, adapter, group, iter([ids_BL]), cfg)
    measured = torch.cuda.max_memory_allocated()
    assert abs(planned(setting) - measured) <= 0.1 * measured, (planned(setting), measured)


def test_a_validators_gpu_peak_is_within_a_tenth_of_its_plan() -> None:
    setting = Setting(role="validator", seq_len=SEQ_LEN, micro_batch=MICRO_BATCH, device="cuda")
    model = real_model()
    adapter = adapter_for(FAMILY)
    submission = {name: t + 0.01 for name, t in extract(model, adapter, first_experts(model, adapter, PER_LAYER)).items()}
    ids_BL = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ_LEN))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss_with_experts(model, adapter, submission, ids_BL, batch_size=MICRO_BATCH, device="cuda", pad_id=-1)
    measured = torch.cuda.max_memory_allocated()
    assert abs(planned(setting) - measured) <= 0.1 * measured, (planned(setting), measured)
