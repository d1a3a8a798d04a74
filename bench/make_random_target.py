"""Write a random-weight checkpoint of a real target's shape to a local folder, for scale rehearsals.

The workflow then treats the folder as any local target (``target.model: /path``): draftsmith has no
random-target code path. Weights are drawn on the GPU when there is one (bf16, normal(0, 0.02) as HF
initialises), saved as sharded safetensors with ``save_pretrained``; the tokenizer and chat template are copied
from ``--tokenizer`` (any local HF folder: an embedded target's is fine, its ids lie inside the vocabulary).
Eos / pad / bos ids follow that tokenizer so generation stops where the template ends a turn.

    python bench/make_random_target.py --shape qwen3.5-27b --tokenizer resources/targets/smollm2-135m-instruct \
        --out /data/random-qwen3.5-27b

Shapes: ``qwen3.5-27b`` (hybrid: 64 layers, 3 Gated DeltaNet : 1 full attention, hidden 5120, vocab 248,320,
54 GB in bf16), ``tiny-hybrid`` (the same layout, 8 layers of width 256, vocabulary grown to the tokenizer's:
CPU checks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_extract import QWEN35_27B, TINY, build_target

SHAPES = {"qwen3.5-27b": QWEN35_27B, "tiny-hybrid": TINY}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", required=True, type=Path, help="local HF folder whose tokenizer is copied")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shard-size", default="5GB")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    dims = dict(SHAPES[args.shape])
    if args.shape.startswith("tiny"):
        dims["vocab_size"] = max(dims["vocab_size"], len(tok))
    if len(tok) > dims["vocab_size"]:
        raise SystemExit(f"{args.tokenizer}: tokenizer of {len(tok)} tokens does not fit vocab {dims['vocab_size']}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model, cfg = build_target(dims, device, getattr(torch, args.dtype))
    eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else 2
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.pad_token_id = eos, pad
        c.bos_token_id = tok.bos_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size=args.shard_size)
    tok.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f} B parameters, {size / 1e9:.1f} GB of safetensors in {args.out} "
          f"({time.perf_counter() - t0:.0f} s; tokenizer of {len(tok)} tokens from {args.tokenizer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
