"""Checkpoint loading benchmark: memory and time of loading a >= 1 GB hub-format MoE checkpoint.

The benchmark writes a Qwen3-MoE checkpoint of at least 1 GB (12 layers of 32 experts, hidden 768,
fp32, per-expert hub keys, written by `save_pretrained`) into a temporary directory, then measures, each in a
process of its own so peak memory is its own (`measure`; `--hidden-size` makes the checkpoint smaller, its experts' width following: a quick
check that every load works, whose ratios are not those of a 1 GB checkpoint):
- `tessera`: `training.model.load_checkpoint` (transformers' `from_pretrained`, sdpa);
- `hash`: `training.checkpoint.checkpoint_hash`, the streaming base hash;
- `plain`: bare `AutoModelForCausalLM.from_pretrained` of the same directory, for reference;
- `old`: the loader of commit 7069fea (reads every shard, converts hub keys by hand, builds a
  second model), taken from git history into a temporary package, for the record;
- `compressed_full_load` / `compressed_skip`: a compressed-mode miner's model Θ̃0 for GROUP (4 of the
  32 experts in every layer, the share of OLMoE-1B-7B's 8 of 64), built the old way (`compress` of
  the fully loaded model) and by `training.model.load_compressed`, which never reads unselected
  experts. `compressed_miner_*` keys: their peak RSS in GiB, its ratio, seconds, the bytes Θ̃0 holds.
`peak_rss_ratio` = peak RSS (VmHWM) above the process's RSS before it loads (once torch, transformers and
the node are imported), divided by the checkpoint's bytes; target <= 1.3. Seconds are wall-clock.
Each load is also checked for content, after its peak is read: the `tessera` and `plain` models must
hash (`training.model.state_hash`) as the model that was written, and the two compressed models alike;
`state_sha256` reports the hashes compared.
Usage: python bench/load.py [--hidden-size 768] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit, out_file  # noqa: E402

OLD_COMMIT = "7069fea"
OLD_FILES = ("training/__init__.py", "training/model.py", "training/adapters.py", "training/experts.py")
CONFIG = {"hidden_size": 768, "num_hidden_layers": 12, "num_experts": 32, "moe_intermediate_size": 384,
          "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 96,
          "vocab_size": 8192}
GROUP = {layer: list(range(layer % 8, 32, 8)) for layer in range(12)}


def config(hidden_size: int) -> dict[str, int]:
    """CONFIG at `hidden_size`, the experts' width scaled with it."""
    return {**CONFIG, "hidden_size": hidden_size,
            "moe_intermediate_size": CONFIG["moe_intermediate_size"] * hidden_size // CONFIG["hidden_size"]}


def write_checkpoint(directory: Path, hidden_size: int) -> dict[str, Any]:
    """Write the benchmark checkpoint; returns its weight bytes and the written model's state hash."""
    from training.model import state_hash
    from training.tiny import build_tiny_model, tiny_config

    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe", **config(hidden_size)), seed=0)
    model.save_pretrained(str(directory))
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert hidden_size != CONFIG["hidden_size"] or size >= 1 << 30, f"benchmark checkpoint is only {size} bytes; raise CONFIG"
    return {"bytes": size, "state_sha256": state_hash(model)}


def measure(mode: str, directory: Path, extra: str | None = None) -> dict[str, Any]:
    """Run one mode in a process of its own; returns its seconds and peak RSS above the RSS it started with.
    `extra`: the hidden size for `write`, the old loader's package directory for `old`.

    The old loader runs in a fresh interpreter, whose `training` package is the old one. Every other mode
    forks from the simulator's warm fork server (node.sim.warm), which has imported torch, transformers and
    the node: a fresh interpreter spends about 8 s of CPU on those, and a fork's peak RSS is read above what
    it started with all the same."""
    args = ["--child", mode, str(directory), *([extra] if extra else [])]
    if mode == "old":
        result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False,
                                cwd=ROOT)
        code, output, errors = result.returncode, result.stdout, result.stderr
    else:
        from node.sim.warm import WarmProcess

        with tempfile.TemporaryDirectory(prefix="tessera-load-child-") as tmp:
            log = Path(tmp) / "output.txt"
            code = WarmProcess(args, str(log), dict(os.environ), str(ROOT), program="bench.load").wait()
            output = errors = log.read_text(encoding="utf-8", errors="replace")
    if code != 0:
        raise RuntimeError(f"{mode} failed: {errors[-2000:]}")
    report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return report


def child(mode: str, directory: str, extra: str | None) -> None:
    if mode == "old":
        assert extra is not None, "the old loader's package directory"
        sys.path.insert(0, extra)
    import torch
    import transformers  # noqa: F401

    runtime_kb = _rss_kb()
    started = time.perf_counter()
    if mode == "write":
        assert extra is not None, "the hidden size"
        print(json.dumps(write_checkpoint(Path(directory), int(extra))))
        return
    loaded: torch.nn.Module | None = None
    if mode == "tessera":
        from training.model import load_checkpoint

        loaded = load_checkpoint(directory)
    elif mode == "hash":
        from training.checkpoint import checkpoint_hash

        checkpoint_hash(directory)
    elif mode == "plain":
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    elif mode in ("compressed_full_load", "compressed_skip"):
        from training.adapters import adapter_for
        from training.compressed import compress
        from training.model import load_checkpoint, load_compressed

        if mode == "compressed_skip":
            cut = load_compressed(directory, GROUP)
        else:
            cut = compress(load_checkpoint(directory), adapter_for("qwen3_moe"), GROUP)
        loaded = cut.model
        held = sum(t.nbytes for t in (*cut.model.parameters(), *cut.model.buffers()))
    else:
        old_model = importlib.import_module("training.model")  # the 7069fea module, first on sys.path
        old_model.load_checkpoint("qwen3_moe", directory)
    seconds = time.perf_counter() - started
    report: dict[str, Any] = {"seconds": seconds, "peak_above_runtime_bytes": (_status_kb("VmHWM") - runtime_kb) * 1024}
    if mode.startswith("compressed"):
        report["held_bytes"] = held
    if loaded is not None:  # after the peak is read: hashing is no part of the load
        from training.model import state_hash

        report["state_sha256"] = state_hash(loaded)
    print(json.dumps(report))


def check_loads(written: str, runs: Mapping[str, Mapping[str, Any]]) -> None:
    """Each load holds the weights it should, not only as many bytes: `tessera` and `plain` the model
    whose state hash was `written`, and both compressed modes the same compressed model."""
    for mode in ("tessera", "plain"):
        assert runs[mode]["state_sha256"] == written, f"{mode} loaded other weights than were written"
    full_load, skip = runs["compressed_full_load"]["state_sha256"], runs["compressed_skip"]["state_sha256"]
    assert full_load == skip, "the two ways built different compressed models"


def _gib(nbytes: int) -> float:
    return round(nbytes / (1 << 30), 3)


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB.

    VmHWM (peak RSS) belongs to the process image, so unlike getrusage's ru_maxrss it does not
    carry over the parent's peak across fork + exec.
    """
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def old_package(root: Path) -> Path:
    """The 7069fea training modules the old loader needs, from git history, under `root`."""
    for name in OLD_FILES:
        text = subprocess.run(["git", "show", f"{OLD_COMMIT}:{name}"], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 and argv[0] == "--child":
        child(argv[1], argv[2], argv[3] if len(argv) > 3 else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=CONFIG["hidden_size"],
                        help=f"the checkpoint's hidden size, even (default {CONFIG['hidden_size']}: over 1 GB; "
                             "16 for a quick run)")
    parser.add_argument("--out", type=out_file, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.hidden_size < 2 or args.hidden_size % 2:  # the experts' width is half of it
        parser.error(f"--hidden-size must be an even number of at least 2, got {args.hidden_size}")
    with tempfile.TemporaryDirectory(prefix="tessera-load-") as tmp:
        directory = Path(tmp) / "checkpoint"
        started = time.perf_counter()
        written = measure("write", directory, str(args.hidden_size))
        size = written["bytes"]
        write_seconds = time.perf_counter() - started
        runs = {mode: measure(mode, directory)
                for mode in ("tessera", "hash", "plain", "compressed_full_load", "compressed_skip")}
        runs["old"] = measure("old", directory, str(old_package(Path(tmp) / "old")))
    check_loads(written["state_sha256"], runs)
    full_load, skip = runs["compressed_full_load"], runs["compressed_skip"]
    report: dict[str, Any] = {
        "hidden_size": args.hidden_size,
        "checkpoint_bytes": size,
        "write_seconds": round(write_seconds, 2),
        "peak_rss_ratio": round(runs["tessera"]["peak_above_runtime_bytes"] / size, 3),
        "load_seconds": round(runs["tessera"]["seconds"], 2),
        "base_hash_seconds": round(runs["hash"]["seconds"], 2),
        "base_hash_peak_rss_ratio": round(runs["hash"]["peak_above_runtime_bytes"] / size, 3),
        "plain_from_pretrained": {"peak_rss_ratio": round(runs["plain"]["peak_above_runtime_bytes"] / size, 3),
                                  "load_seconds": round(runs["plain"]["seconds"], 2)},
        "old_loader_7069fea": {"peak_rss_ratio": round(runs["old"]["peak_above_runtime_bytes"] / size, 3),
                               "load_seconds": round(runs["old"]["seconds"], 2)},
        "target_peak_rss_ratio": 1.3,
        "compressed_miner_group": "4 of 32 experts in each of 12 MoE layers",
        "compressed_miner_peak_rss_gib_full_load": _gib(full_load["peak_above_runtime_bytes"]),
        "compressed_miner_peak_rss_gib_skip_unselected": _gib(skip["peak_above_runtime_bytes"]),
        "compressed_miner_skip_vs_full_load_peak_ratio": round(
            skip["peak_above_runtime_bytes"] / full_load["peak_above_runtime_bytes"], 3),
        "compressed_miner_seconds_full_load": round(full_load["seconds"], 2),
        "compressed_miner_seconds_skip_unselected": round(skip["seconds"], 2),
        "compressed_miner_held_gib": _gib(skip["held_bytes"]),
        "state_sha256": {"written": written["state_sha256"],
                         **{mode: runs[mode]["state_sha256"]
                            for mode in ("tessera", "plain", "compressed_full_load", "compressed_skip")}},
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
