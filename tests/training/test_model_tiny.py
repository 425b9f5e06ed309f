"""Tiny models: every family builds by the init rule, per seed, on any thread, touching no library function."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from training.adapters import ADAPTERS
from training.model import state_hash
from training.tiny import build_tiny_model, meta_tiny_model, tiny_config

FAMILIES = tuple(ADAPTERS)
ROOT = Path(__file__).resolve().parents[2]
# Seed 0's qwen3_moe bytes under training.tiny.INIT_RULE "tessera-init/2": a change here needs a new INIT_RULE.
QWEN3_SEED0 = "71e6769f3a715913c396c0074822c07f5169126d3f25cf9abdb868e563a02003"
STD = 0.02  # initializer_range: transformers' default, which the tiny configs keep


@pytest.mark.parametrize("family", FAMILIES)
def test_each_seed_gives_its_own_bytes_and_the_global_rng_is_left_alone(family: str) -> None:
    config = tiny_config(family)
    rng = torch.random.get_rng_state()
    first = state_hash(build_tiny_model(family, config, 9))
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert state_hash(build_tiny_model(family, config, 9)) == first
    assert state_hash(build_tiny_model(family, config, generator=torch.Generator().manual_seed(9))) == first
    assert state_hash(build_tiny_model(family, config, 10)) != first


def test_the_bytes_of_a_seed_are_pinned() -> None:
    assert state_hash(build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0)) == QWEN3_SEED0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_init_rule_and_buffers_match_transformers(family: str) -> None:
    config = tiny_config(family)
    model = build_tiny_model(family, config, 0)
    with torch.random.fork_rng(devices=[]):  # transformers' own init, for the buffers and the parameter set
        reference = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # unannotated in transformers
            AutoConfig.for_model(family, **config), dtype=torch.float32, attn_implementation="eager"
        )
    assert [(n, b.shape) for n, b in model.named_parameters()] == [(n, b.shape) for n, b in reference.named_parameters()]
    for (name, buffer), (ref_name, ref_buffer) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert name == ref_name and torch.equal(buffer, ref_buffer), name  # rotary inv_freq, DeepSeek's correction bias
    pad = config["pad_token_id"]
    for name, tensor in model.state_dict().items():
        if name.endswith("bias"):
            assert not tensor.any(), name
        elif "norm" in name:
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            drawn = torch.cat([tensor[:pad], tensor[pad + 1:]]) if name.endswith("embed_tokens.weight") else tensor
            error = STD / drawn.numel() ** 0.5  # of the sample mean
            assert abs(float(drawn.mean())) < 5 * error and abs(float(drawn.std()) - STD) < 5 * error, name
    assert not model.get_parameter("model.embed_tokens.weight")[pad].any()
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits) and torch.isfinite(model(ids).logits).all()


def test_a_non_default_rope_and_tied_embeddings_are_built_right() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    config = tiny_config("deepseek_v3", rope_parameters=rope, tie_word_embeddings=True)
    model = build_tiny_model("deepseek_v3", config, 0)
    with torch.random.fork_rng(devices=[]):
        reference = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # unannotated in transformers
            AutoConfig.for_model("deepseek_v3", **config), dtype=torch.float32
        )
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert state_hash(build_tiny_model("deepseek_v3", config, 0)) == state_hash(model)


def test_builds_on_other_threads_get_their_own_seeds_bytes() -> None:
    jobs = [("qwen3_moe", 1), ("deepseek_v3", 2), ("mixtral", 3), ("qwen3_moe", 4)]
    expected = {job: state_hash(build_tiny_model(job[0], tiny_config(job[0]), job[1])) for job in jobs}
    got: dict[tuple[str, int], list[str]] = {job: [] for job in jobs}
    start = threading.Barrier(len(jobs))

    def build(family: str, seed: int) -> None:
        start.wait()
        for _ in range(3):
            got[family, seed].append(state_hash(build_tiny_model(family, tiny_config(family), seed)))
            torch.rand(1000)

    threads = [threading.Thread(target=build, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == {job: [digest] * 3 for job, digest in expected.items()}


@pytest.mark.slow
def test_importing_and_building_leave_torch_and_transformers_init_functions_alone() -> None:
    script = """
import torch.nn.init, transformers.initialization as hf_init
names = [n for n in hf_init.TORCH_INIT_FUNCTIONS if hasattr(torch.nn.init, n)]
before = {n: (getattr(torch.nn.init, n), getattr(hf_init, n)) for n in names}
import training.model, training.pretrain
from training.tiny import build_tiny_model, meta_tiny_model, tiny_config
build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0)
changed = [n for n in names if (getattr(torch.nn.init, n), getattr(hf_init, n)) != before[n]]
assert not changed, changed
assert all(torch.nn.init.__dict__[n] is hf_init.TORCH_INIT_FUNCTIONS[n] for n in names)
"""
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=300)


def test_the_meta_model_has_the_built_models_layout_and_no_weights() -> None:
    config = tiny_config("deepseek_v3")
    meta = meta_tiny_model("deepseek_v3", config)
    with torch.device("meta"):  # a caller's device context does not leave the build half on it
        built = build_tiny_model("deepseek_v3", config, 0)
    assert all(t.device.type == "meta" for t in meta.state_dict().values())
    assert all(t.device.type == "cpu" for t in [*built.parameters(), *built.buffers()])
    assert {n: t.shape for n, t in meta.state_dict().items()} == {n: t.shape for n, t in built.state_dict().items()}
    assert state_hash(built) == state_hash(build_tiny_model("deepseek_v3", config, 0))
