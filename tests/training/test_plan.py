"""The memory plan: a fake trace agrees with the same step on real tensors, and its parts add up to its peak."""

from __future__ import annotations

import pytest
import torch

from training.adapters import adapter_for
from training.plan import MemoryPlan, Setting, first_experts, measure, plan
from training.tiny import build_tiny_model, tiny_config
from training.trace import PARTS

SETTINGS = {
    "compressed miner": Setting(role="miner", seq_len=48, micro_batch=2, device="cpu", forward="compressed"),
    "full miner": Setting(role="miner", seq_len=48, micro_batch=2, device="cpu", forward="full"),
    "checkpointed miner": Setting(role="miner", seq_len=48, micro_batch=2, device="cpu", checkpointing=True),
    "8-bit miner": Setting(role="miner", seq_len=48, micro_batch=2, device="cpu", optimizer="adamw8bit"),
    "validator": Setting(role="validator", seq_len=48, micro_batch=2, device="cpu"),
    "int8 validator": Setting(role="validator", seq_len=48, micro_batch=2, device="cpu", weights="int8"),
}


def fake_plan(family: str, setting: Setting, per_layer: int = 2, steps: int | None = None) -> MemoryPlan:
    return plan(tiny_config(family), setting, per_layer, family=family, dtype=torch.float32,
                attn_implementation="eager", steps=steps)


def real_plan(family: str, setting: Setting, per_layer: int = 2) -> MemoryPlan:
    """Three steps on real tensors (a validator's pass: three batches), one more than a plan traces."""
    adapter = adapter_for(family)
    model = build_tiny_model(family, tiny_config(family), seed=0)
    return measure(model, adapter, first_experts(model, adapter, per_layer), setting, steps=3)


# Three real steps beside each trace: `make check` runs the miner's default setting, `make test` every setting and
# deepseek_v3's sigmoid router too (marked slow: a second or more of CPU each).
@pytest.mark.parametrize(("family", "name"), [
    ("olmoe", "compressed miner"),
    *(pytest.param("olmoe", name, marks=pytest.mark.slow) for name in SETTINGS if name != "compressed miner"),
    pytest.param("deepseek_v3", "compressed miner", marks=pytest.mark.slow),
])
def test_a_fake_trace_peaks_within_a_tenth_of_three_steps_on_real_tensors(family: str, name: str) -> None:
    fake, real = fake_plan(family, SETTINGS[name]), real_plan(family, SETTINGS[name])
    assert fake.parts["weights"] == real.parts["weights"]
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.1 * real.peak_bytes, (fake, real)


def test_the_parts_add_up_to_the_peak_and_a_miners_step_holds_copies_gradients_and_adam_state() -> None:
    short = Setting(role="miner", seq_len=8, micro_batch=1, device="cpu")  # little activation: the state dominates
    result = fake_plan("qwen3_moe", short)
    parts = result.parts
    assert set(parts) == set(PARTS) and sum(parts.values()) <= result.peak_bytes
    assert result.step == 2 and result.phase in ("backward", "optimizer step")
    assert parts["weights"] > 0 and parts["activations"] > 0
    assert parts["trainable_copies"] > 0 and parts["gradients"] == parts["trainable_copies"]
    assert parts["optimizer_state"] >= 2 * parts["trainable_copies"]  # AdamW's two moments, fp32


def test_a_validator_holds_weights_and_activations_only() -> None:
    result = fake_plan("olmoe", SETTINGS["validator"])
    assert sum(result.parts.values()) <= result.peak_bytes
    assert result.parts["weights"] > 0 and result.parts["activations"] > 0
    assert result.parts["trainable_copies"] == result.parts["gradients"] == result.parts["optimizer_state"] == 0


def test_compressed_holds_fewer_weights_than_full_and_checkpointing_fewer_activations() -> None:
    full, cut, recomputed = (fake_plan("olmoe", SETTINGS[name], steps=1) for name in  # what a step holds
                             ("full miner", "compressed miner", "checkpointed miner"))
    assert cut.parts["weights"] < full.parts["weights"]
    assert recomputed.peak_bytes < cut.peak_bytes


def test_a_cuda_plan_traces_the_same_fused_step_as_a_cpu_one_without_fp32_temporaries_of_the_experts() -> None:
    cpu = fake_plan("qwen3_moe", Setting(role="miner", seq_len=8, device="cpu"))
    cuda = fake_plan("qwen3_moe", Setting(role="miner", seq_len=8, device="cuda"))
    assert cuda.device == "cuda" and cuda.step == 2 and cuda.parts["optimizer_state"] > 0
    assert cuda.peak_bytes == cpu.peak_bytes and cuda.parts == cpu.parts
    assert cuda.parts["activations"] < cuda.parts["trainable_copies"]  # fused AdamW: no foreach temporaries


def test_8bit_adamw_lowers_the_peak_of_a_step_held_by_the_optimizer_state() -> None:
    short = Setting(role="miner", seq_len=8, micro_batch=1, device="cuda")
    fp32 = fake_plan("qwen3_moe", short, per_layer=4)
    eight = fake_plan("qwen3_moe", Setting(role="miner", seq_len=8, micro_batch=1, device="cuda",
                                           optimizer="adamw8bit"), per_layer=4)
    assert fp32.step == 2 and fp32.parts["optimizer_state"] > fp32.parts["activations"]
    assert eight.peak_bytes < fp32.peak_bytes - fp32.parts["optimizer_state"] / 2, (fp32, eight)
    assert eight.parts["optimizer_state"] < fp32.parts["optimizer_state"] / 3


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch"):
        Setting(role="miner", seq_len=8, micro_batch=0)
    with pytest.raises(ValueError, match="role"):
        Setting(role="trainer", seq_len=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer"):
        Setting(role="miner", seq_len=8, optimizer="sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights"):
        Setting(role="miner", seq_len=8, weights="int8")
    with pytest.raises(ValueError, match="experts per layer"):
        fake_plan("olmoe", SETTINGS["validator"], per_layer=9)


@pytest.mark.slow  # two traces
def test_a_validator_spread_over_gpus_is_planned_per_gpu() -> None:
    one = fake_plan("qwen3_moe", Setting(role="validator", seq_len=48, micro_batch=2, device="cuda"))
    two = fake_plan("qwen3_moe", Setting(role="validator", seq_len=48, micro_batch=2, device="cuda", gpus=2))
    assert one.device_peaks == () and len(two.device_peaks) == 2 and min(two.device_peaks) > 0
    assert two.peak_bytes == max(two.device_peaks) < one.peak_bytes <= sum(two.device_peaks)
    assert two.parts["weights"] < one.parts["weights"]
    with pytest.raises(ValueError, match="gpus"):
        Setting(role="miner", seq_len=8, gpus=2)
