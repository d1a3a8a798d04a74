"""Benchmark of the regenerate stage: batched, left-padded greedy generation against unbatched generation
(``batch_size: 1``, the baseline), measured in the same run on a tiny random target (or ``--target``).

Prints generated tokens/s, the ratio to the baseline, and the fraction of answers identical to the
baseline's (left padding is exact to ~1e-6 in float32; in bfloat16 a few answers differ).

    python bench/regenerate.py --device cuda --dtype bfloat16 --batch-sizes 4,16,64
    python bench/regenerate.py --target resources/targets/smollm2-135m-instruct --n 32
"""

from __future__ import annotations

import os
import sys


import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests"))

import torch  # noqa: E402

from draftsmith import regenerate as rg  # noqa: E402
from draftsmith.tokenize import load_tokenizer, stop_token_ids  # noqa: E402

PROMPTS = ["Hello! How are you today?", "Write a function that adds two numbers.",
           "Please explain speculative decoding.", "What is the answer?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="HF target folder (default: tiny random llama + tiny tokenizer)")
    ap.add_argument("--kind", default="llama", help="tiny target kind (llama, qwen3, qwen3_5, qwen3_next)")
    ap.add_argument("--n", type=int, default=48, help="conversations")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.target:
        from draftsmith.target import load_target

        tok = load_tokenizer(args.target)
        model = load_target(args.target, dtype=args.dtype, device=args.device)
        stops = stop_token_ids(tok, args.target)
    else:
        from tiny import tiny_target, tiny_tokenizer

        tok, model, stops = tiny_tokenizer(), tiny_target(args.kind).to(args.device, dtype), [2]
    convs = [{"id": str(i), "source": "bench", "tools": None, "messages": [
        {"role": "user", "content": " ".join([PROMPTS[i % len(PROMPTS)]] * (1 + i % 7))},
        {"role": "assistant", "content": "original"}]} for i in range(args.n)]
    print(f"{args.n} prompts, max_new_tokens {args.max_new_tokens}, {args.device} {args.dtype}, "
          f"target {args.target or 'tiny ' + args.kind}")
    rows, base = [], None
    for bs in [1] + [int(b) for b in args.batch_sizes.split(",")]:
        regen = rg.Regenerator(model, tok, rg.GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=bs),
                               stops)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, stats = regen.regenerate([dict(c) for c in convs])
        if args.device == "cuda":
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        answers = [r["messages"][1]["content"] for r in out]
        if base is None:
            base = (stats["tokens_generated"] / sec, answers)
        same = sum(a == b for a, b in zip(answers, base[1])) / len(answers)
        rows.append((bs, sec, stats["tokens_generated"] / sec, same))
    print(f"{'batch':>6s} {'seconds':>8s} {'tokens/s':>9s} {'vs batch 1':>10s} {'same answer':>11s}")
    for bs, sec, tps, same in rows:
        print(f"{bs:6d} {sec:8.2f} {tps:9.1f} {tps / base[0]:9.2f}x {100 * same:10.0f}%")


if __name__ == "__main__":
    main()
