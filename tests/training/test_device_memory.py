"""The scoring memory estimate covers what a held-out loss pass really takes (measured on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Runs in a fresh process: resets the peak-RSS mark, scores one batch of a model whose memory is all
# logits (large vocabulary, tiny everything else), and prints the peak growth and the estimate.
_MEASURE = """
import re, sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from training.evaluate import heldout_loss
from training.device import scoring_bytes
torch.set_num_threads(1)
vocab, batch, seq_len = 20000, 4, 256
config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=seq_len)
model = Qwen3MoeForCausalLM(config).to(getattr(torch, sys.argv[1])).eval()
sequences = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
def kib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
resident = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
heldout_loss(model, sequences, batch_size=batch)
print((kib("VmHWM") - resident) * 1024, scoring_bytes(model, batch, seq_len, "cpu"))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scoring_bytes_covers_a_measured_loss_pass(dtype: str) -> None:
    out = subprocess.run([sys.executable, "-c", _MEASURE, dtype], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    measured, estimate = map(int, out.stdout.split())
    assert measured <= estimate, f"{dtype}: a loss pass took {measured} bytes, the estimate is {estimate}"
