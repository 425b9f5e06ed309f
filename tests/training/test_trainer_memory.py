"""A CPU training step hands the heap pages its activations freed back to the system as the step grows the process
(training.trainer's `_pages_returned`), measured in a fresh process: the same three steps of the same model, with
those hooks and without them, each from a trimmed heap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")]

# Trained rows of 8 and 16 MiB (mapped on their own, as a real-size model's are) and activations of 2 MiB (from the
# heap): the shape in which freed activations, kept by the heap, sit beside the gradients backward maps.
PROBE = """
import torch
from contextlib import nullcontext
from training import allocator, trainer
from training.adapters import adapter_for
from training.compressed import compress
from training.tiny import build_tiny_model, tiny_config
allocator.set_policy()
returned = trainer._pages_returned
def kib(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
adapter = adapter_for('olmoe')
config = tiny_config('olmoe', hidden_size=1024, intermediate_size=1024, num_hidden_layers=4)
group = {layer: [0, 1] for layer in range(4)}
cut = compress(build_tiny_model('olmoe', config, seed=0), adapter, group)
batches = torch.randint(0, 256, (4, 8, 64), generator=torch.Generator().manual_seed(0))
cfg = trainer.TrainConfig(steps=3, batch_size=8, forward='compressed')
state = trainer.train_experts(cut, adapter, group, iter(batches[:1]), cfg, hand_on=True).optimizer_state
for mode in ('returned', 'kept'):
    trainer._pages_returned = returned if mode == 'returned' else (lambda *_: nullcontext())
    allocator.trim()
    resident = kib('VmRSS')
    open('/proc/self/clear_refs', 'w').write('5')
    trainer.train_experts(cut, adapter, group, iter(batches[1:]), cfg, state)
    print(kib('VmHWM') - resident)
"""


def test_a_step_hands_back_the_activation_pages_it_freed() -> None:
    """Measured here: a peak 267-277 MB over the start with the pages handed back (the resumed moments and the
    gradients, 288 MB), 356-378 MB without them, in either order."""
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    returned, kept = map(int, run.stdout.split()[-2:])
    assert kept - returned > 48 << 20, f"peak growth {returned} bytes with the pages handed back, {kept} without"
