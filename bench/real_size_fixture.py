"""A checkpoint of OLMoE-1B-7B's shape with random bf16 weights, written one shard at a time, with a tokenizer and data.

The checkpoint has OLMoE-1B-7B's layout (16 layers of 64 experts, expert intermediate 1024, hidden
2048, top-8, vocabulary 50304; 6.9 B parameters, 13.8 GB in bf16) in the hub's form: per-expert keys
(`model.layers.{l}.mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), one safetensors shard
for the embeddings and one per layer, and `model.safetensors.index.json`. Each shard's tensors are
drawn (normal, std 0.02; norms 1) from a generator seeded by the shard's number, written and dropped
before the next is drawn, so the script holds one shard (under 1 GB at full size) and never the model.
Beside the weights: a byte-level BPE tokenizer trained on generated arithmetic text, and under
`data/` disjoint `train.jsonl` and `heldout.jsonl` files of that text. Nothing is downloaded.
`--layers N` writes a cut of the first N layers; `--hidden-size` a narrower model of the same layout
(expert intermediate half of it), for quick runs. The same arguments write the same bytes.
Usage: python bench/real_size_fixture.py --out DIR [--layers 16] [--hidden-size 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = 16
EXPERTS = 64
HIDDEN = 2048
VOCAB = 50304
TOP_K = 8
TOKENIZER_VOCAB = 512
TRAIN_DOCS = 2000
HELDOUT_DOCS = 400
STD = 0.02


def olmoe_config(layers: int, hidden_size: int) -> dict[str, Any]:
    """The config.json of the fixture: OLMoE-1B-7B's, cut to `layers` and scaled to `hidden_size`."""
    from transformers import OlmoeConfig

    config = OlmoeConfig(
        num_hidden_layers=layers, hidden_size=hidden_size, intermediate_size=hidden_size // 2,
        num_attention_heads=16, num_key_value_heads=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        vocab_size=VOCAB, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    body: dict[str, Any] = config.to_dict()
    body["architectures"] = ["OlmoeForCausalLM"]
    body["dtype"] = "bfloat16"
    body.pop("transformers_version", None)
    return body


def shard_shapes(config: dict[str, Any]) -> list[dict[str, tuple[int, ...]]]:
    """The hub keys and shapes of each shard: the embeddings, head and final norm, then one shard per layer."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    ]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shard: dict[str, tuple[int, ...]] = {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,),
            p + "mlp.gate.weight": (config["num_experts"], h),
        }
        shard.update({f"{p}self_attn.{proj}.weight": (h, h) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")})
        for expert in range(config["num_experts"]):
            e = f"{p}mlp.experts.{expert}."
            shard.update({e + "gate_proj.weight": (i, h), e + "up_proj.weight": (i, h), e + "down_proj.weight": (h, i)})
        shards.append(dict(sorted(shard.items())))
    return shards


def write_shards(out: Path, config: dict[str, Any]) -> int:
    """Draw and write every shard in turn, then the index; returns the weights' total bytes."""
    import torch
    from safetensors.torch import save_file

    shards = shard_shapes(config)
    names = [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for number, (name, shapes) in enumerate(zip(names, shards, strict=True)):
        generator = torch.Generator().manual_seed(number)
        tensors = {}
        for key, shape in shapes.items():
            if key.endswith("norm.weight"):
                tensors[key] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[key] = (torch.randn(shape, generator=generator) * STD).to(torch.bfloat16)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(shapes, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return total


def write_tokenizer(directory: Path, documents: list[str]) -> None:
    """A byte-level BPE tokenizer with <pad> (id 0) and <eos> (id 1), trained on `documents`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer)
    # transformers leaves the fast tokenizer's constructor unannotated.
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")  # type: ignore[no-untyped-call]
    fast.save_pretrained(str(directory))


def write_fixture(out: Path, layers: int = LAYERS, hidden_size: int = HIDDEN) -> dict[str, Any]:
    """Write the checkpoint, tokenizer and data under `out` (a new or empty directory); what was written."""
    from training.corpus import generate, write_documents

    out.mkdir(parents=True, exist_ok=True)
    config = olmoe_config(layers, hidden_size)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    weights = write_shards(out, config)
    train = generate("arithmetic", TRAIN_DOCS, seed=1)
    seen = set(train)
    heldout = [d for d in generate("arithmetic", HELDOUT_DOCS, seed=2) if d not in seen]
    write_tokenizer(out, train)
    write_documents(out / "data" / "train.jsonl", train)
    write_documents(out / "data" / "heldout.jsonl", heldout)
    return {"checkpoint": str(out), "layers": layers, "hidden_size": hidden_size, "weight_bytes": weights,
            "train": str(out / "data" / "train.jsonl"), "heldout": str(out / "data" / "heldout.jsonl")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; refuses a bad size or an --out that holds files, before torch is imported."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="new (or empty) directory to write")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"decoder layers, 1 to {LAYERS} (default {LAYERS})")
    parser.add_argument("--hidden-size", type=int, default=HIDDEN,
                        help=f"hidden size, a multiple of 32 from 32 to {HIDDEN} (default {HIDDEN})")
    args = parser.parse_args(argv)
    if not 1 <= args.layers <= LAYERS:
        parser.error(f"--layers must be 1 to {LAYERS}, got {args.layers}")
    if not 32 <= args.hidden_size <= HIDDEN or args.hidden_size % 32:
        parser.error(f"--hidden-size must be a multiple of 32 from 32 to {HIDDEN}, got {args.hidden_size}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out}: exists and is not an empty directory")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(json.dumps(write_fixture(args.out, args.layers, args.hidden_size), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
