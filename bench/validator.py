"""Validator benchmark: the cost of scoring one submission over a bare forward pass.

`overhead_ratio` = time(check_submission on the blob's bytes + insert its experts + held-out loss +
restore) / time(held-out loss of the unchanged model over the same tokens); target <= 1.25.
The model is the miner benchmark's (Qwen3-MoE, hidden 256, 4 MoE layers of 32 experts, 4 of them
per layer in the group); the held-out subset is `--sequences` sequences of 128 tokens picked by a
round seed, scored in batches of 16. Both timings are the median of `--repeats` alternating runs.
Usage: python bench/validator.py [--repeats N] [--sequences N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.miner import FAMILY, OVERRIDES, SELECTED_PER_LAYER, SEQ_LEN  # noqa: E402  (the same model)
from bench.report import emit, out_file  # noqa: E402

EVAL_BATCH = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--out", type=out_file)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.sequences < 1:
        parser.error(f"--repeats and --sequences must be at least 1, got {args.repeats} and {args.sequences}")

    import torch

    from training.adapters import adapter_for
    from training.blob import BlobMeta, blob_hash, encode_blob
    from training.corpus import generate
    from training.data import heldout_subset, pack
    from training.evaluate import heldout_loss, loss_with_experts
    from training.experts import expected_shapes, extract
    from training.tiny import build_tiny_model, tiny_config
    from training.tokenizer import ByteTokenizer
    from validator.checks import Expectation, check_submission

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = build_tiny_model(FAMILY, tiny_config(FAMILY, **OVERRIDES), seed=0)
    adapter = adapter_for(FAMILY)
    group = {layer: list(range(0, 32, 32 // SELECTED_PER_LAYER)) for layer in adapter.moe_layers(model)}
    heldout = heldout_subset(pack(generate("arithmetic", 1500, seed=1), ByteTokenizer(), SEQ_LEN), "ab" * 32,
                             args.sequences)

    generator = torch.Generator().manual_seed(0)
    submitted = {name: t + 1e-3 * torch.randn(t.shape, generator=generator)
                 for name, t in extract(model, adapter, group).items()}
    meta = BlobMeta(network="0" * 64, round=3, miner="1" * 64, base="2" * 64, group=group)
    data = encode_blob(submitted, meta)
    expect = Expectation(network=meta.network, round=meta.round, miner=meta.miner, base=meta.base, group=group,
                         shapes=expected_shapes(model, adapter, group), dtype="float32",
                         commitment=blob_hash(data), max_header_bytes=1 << 20)

    def bare() -> float:
        return heldout_loss(model, heldout, batch_size=EVAL_BATCH).loss

    def submission() -> tuple[float, float]:
        started = time.perf_counter()
        verdict = check_submission(data, expect)
        assert verdict.ok and verdict.tensors is not None, verdict.reason
        verified = time.perf_counter() - started
        return loss_with_experts(model, adapter, verdict.tensors, heldout, batch_size=EVAL_BATCH).loss, verified

    bare()
    bare_s, sub_s, verify_s = [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        base_loss = bare()
        bare_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        sub_loss, verified = submission()
        sub_s.append(time.perf_counter() - started)
        verify_s.append(verified)

    report = {
        "model": {"family": FAMILY, **OVERRIDES, "selected_per_layer": SELECTED_PER_LAYER},
        "heldout_sequences": args.sequences, "seq_len": SEQ_LEN, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "blob_bytes": len(data),
        "overhead_ratio": statistics.median(sub_s) / statistics.median(bare_s),
        "bare_forward_s": statistics.median(bare_s),
        "submission_s": statistics.median(sub_s),
        "verify_s": statistics.median(verify_s),
        "base_loss": base_loss, "submission_loss": sub_loss,
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
