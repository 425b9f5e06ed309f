"""Selection benchmark: held-out loss of the pruned model against the fraction of experts kept, rule vs random.

The base is the pretrained tiny model of `training.pretrain` (qwen3_moe, 8 experts per MoE layer,
top-2, trained on prose and code; cached under `--cache`), or the simulation's random-init tiny model
with `--sim`. For each domain, experts are selected by gate mass from `--examples` documents (pooled
per document) in global and layerwise mode; then `training.subset_eval` prunes the model to the rule's
top experts and to random ones (`--seeds` draws) at keep fractions 6.25..100% and measures held-out
loss on other documents of the domain. A stability report (Jaccard overlap across seeds at 1, 5, 10
and 100 examples drawn from `--documents` documents) closes each domain. Everything is seeded.
Usage: python bench/selection.py [--sim] [--domains code prose arithmetic] [--documents 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit, out_file  # noqa: E402

FAMILY = "qwen3_moe"
SEQ_LEN = 64
DOCUMENTS = 200  # of a domain's 400 generated texts: the first ones are for selection, the rest held out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim", action="store_true", help="use the random-init simulation model")
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench" / "pretrained", help="pretrained base cache")
    parser.add_argument("--domains", nargs="+", default=["code", "prose", "arithmetic"])
    parser.add_argument("--examples", type=int, default=5, help="documents the selection sees")
    parser.add_argument("--documents", type=int, default=DOCUMENTS,
                        help=f"documents the stability report draws from (default and most {DOCUMENTS})")
    parser.add_argument("--top-d", type=int, default=2, help="experts per layer in the selected group")
    parser.add_argument("--heldout", type=int, default=48, help="held-out sequences of SEQ_LEN tokens")
    parser.add_argument("--seeds", type=int, default=3, help="random selections per keep fraction")
    parser.add_argument("--out", type=out_file)
    args = parser.parse_args(argv)
    if not 1 <= args.examples <= args.documents <= DOCUMENTS:
        parser.error(f"need 1 <= --examples <= --documents <= {DOCUMENTS}, got {args.examples} and {args.documents}")

    import torch

    from training.adapters import adapter_for
    from training.corpus import generate
    from training.data import pack
    from training.selection import select_experts
    from training.stability import stability_report
    from training.subset_eval import subset_report
    from training.tiny import build_tiny_model, tiny_config
    from training.tokenizer import ByteTokenizer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    started = time.perf_counter()
    if args.sim:
        model, base = build_tiny_model(FAMILY, tiny_config(FAMILY), seed=0), "simulation (random init, seed 0)"
    else:
        from training.pretrain import PretrainConfig, load_pretrained

        cfg = PretrainConfig(family=FAMILY)
        model, base = load_pretrained(args.cache, cfg), f"training.pretrain ({cfg.steps} steps on prose+code)"
    adapter = adapter_for(FAMILY)
    tokenizer = ByteTokenizer()
    domains = {}
    for domain in args.domains:
        # Seed 7 is not the pretraining corpus's seed (0), so selection and held-out texts are unseen.
        texts = generate(domain, 400, seed=7)
        documents = [pack([text], tokenizer, SEQ_LEN) for text in texts[: args.documents]]
        heldout = pack(texts[DOCUMENTS:], tokenizer, SEQ_LEN)[: args.heldout]
        result = {}
        for mode in ("global", "layerwise"):
            selection = select_experts(model, adapter, documents[: args.examples], "gate-mass", top_d=args.top_d,
                                       mode=mode)
            report = subset_report(model, adapter, selection, heldout, seeds=range(args.seeds))
            result[mode] = {"group": selection["group"], "full": report["full"], "group_loss": report["group"]["loss"],
                            "without_group": report["without_group"], "curve": report["curve"]}
        stability = stability_report(model, adapter, documents, "gate-mass", top_d=args.top_d)
        result["stability"] = {n: {k: c[k] for k in ("pairwise_jaccard", "reference_jaccard")}
                               for n, c in stability["counts"].items()}
        domains[domain] = result
    emit({
        "benchmark": "selection",
        "base": base,
        "model": {"family": FAMILY, "experts": adapter.num_experts(model), "moe_layers": adapter.moe_layers(model)},
        "rule": "gate-mass",
        "examples": args.examples,
        "documents": args.documents,
        "top_d": args.top_d,
        "heldout_sequences": args.heldout,
        "random_seeds": args.seeds,
        "domains": domains,
        "seconds": round(time.perf_counter() - started, 1),
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
