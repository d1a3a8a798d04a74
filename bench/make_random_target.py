"""Write a random-weight checkpoint of a real target's shape to a local folder, for scale rehearsals.

The workflow then treats the folder as any local target (``target.model: /path``): draftsmith has no
random-target code path. Weights are drawn on the GPU when there is one (bf16, normal(0, 0.02) as HF
initialises), saved as sharded safetensors with ``save_pretrained``; the tokenizer and chat template are copied
from ``--tokenizer`` (any local HF folder: an embedded target's is fine, its ids lie inside the vocabulary).
Eos / pad / bos ids follow that tokenizer so generation stops where the template ends a turn.

    python bench/make_random_target.py --shape qwen3.5-27b --tokenizer resources/targets/smollm2-135m-instruct \
        --out /data/random-qwen3.5-27b [--mtp]

``--mtp`` adds a random MTP head as Qwen3.5 / 3.6 checkpoints ship it (``mtp.*`` tensors in their own shard,
``model-mtp.safetensors``, named in ``model.safetensors.index.json``; ``mtp_num_hidden_layers: 1`` in config.json):
the shapes of :func:`draftsmith.evaluate.mtp.checkpoint_shapes` (27B: ``mtp.fc.weight [5120, 10240]``, 15 tensors,
0.85 GB in bf16), values N(0, 0.02) (norm weights N(0, 0.02) around Qwen3.5's ``1 + w``).

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
    ap.add_argument("--mtp", action="store_true", help="add a random MTP head (mtp.* tensors) in its own shard")
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
    if args.mtp:
        add_random_mtp(args.out, model)
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f} B parameters, {size / 1e9:.1f} GB of safetensors in {args.out} "
          f"({time.perf_counter() - t0:.0f} s; tokenizer of {len(tok)} tokens from {args.tokenizer})")
    return 0


def add_random_mtp(folder: Path, model, seed: int = 0, std: float = 0.02) -> int:
    """Write a random MTP head for ``model`` into ``folder`` as a sharded checkpoint holds it: the tensors of
    :func:`draftsmith.evaluate.mtp.checkpoint_shapes` (MoE experts fused, as transformers holds them) in
    ``model-mtp.safetensors``, every tensor named in ``model.safetensors.index.json`` (written when
    ``save_pretrained`` left a single file), ``mtp_num_hidden_layers: 1`` in config.json. Returns the bytes written."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from draftsmith.evaluate.mtp import MTPHead, checkpoint_shapes

    weight = model.get_input_embeddings().weight
    with torch.device("meta"):
        shapes = checkpoint_shapes(MTPHead(model, 1))
    g = torch.Generator(device=weight.device).manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=g, device=weight.device, dtype=torch.float32) * std).to(
        weight.dtype).cpu().contiguous() for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
    else:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
            data = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in fh.keys()}}
    data["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
    index.write_text(json.dumps(data, indent=2))
    config = json.loads((folder / "config.json").read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in tensors.values())


if __name__ == "__main__":
    sys.exit(main())
