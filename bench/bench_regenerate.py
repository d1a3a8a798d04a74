"""Benchmark of the regenerate stage: each engine on the same prompts in the same run, against HF ``generate``.

The prompts are the first user turns of a curated parquet (``results/curated/train.parquet``), rendered with
the target's chat template exactly as the stage does (``draftsmith.regenerate.turns.Regenerator``, max_turns 1). Each
engine regenerates the same conversations; printed per engine: generated tokens/s, the ratio to the
``generate`` baseline (HF generate, left-padded batches of ``--batch-size``), and how many answers equal the
baseline's token for token (greedy). Run it in float32 for the equality figure (bf16 kernels that depend on the
batch composition can flip near-tied argmaxes) and in bfloat16 for the speed the stage runs at.

    python bench/bench_regenerate.py --target resources/targets/smollm2-135m-instruct \
        --curated results/curated/train.parquet --n 1024 --max-new-tokens 256 --dtypes bfloat16,float32
    python bench/bench_regenerate.py --tiny          # CPU smoke test: tiny random llama + tiny tokenizer

Measured on one H200 (see docs/gpu-proof/README.md for the figures and the exact command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

import torch

from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.regenerate.turns import Regenerator

PROMPTS = ["Hello! How are you today?", "Write a function that adds two numbers.",
           "Please explain speculative decoding.", "What is the answer?"]


def conversations(args) -> list[dict]:
    """First user turn (with a system message when present) of ``--n`` curated conversations."""
    if args.curated:
        import pyarrow.parquet as pq

        rows = pq.read_table(args.curated, columns=["id", "source", "messages", "tools"]).to_pylist()
        out = []
        for r in rows:
            msgs = r["messages"] or []
            first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
            if first is None or first == 0 or msgs[first].get("tool_calls"):
                continue
            out.append({**r, "messages": msgs[:first + 1]})
            if len(out) == args.n:
                break
        return out
    return [{"id": str(i), "source": "bench", "tools": None, "messages": [
        {"role": "user", "content": " ".join([PROMPTS[i % len(PROMPTS)]] * (1 + i % 7))},
        {"role": "assistant", "content": "original"}]} for i in range(args.n)]


@torch.no_grad()
def divergences(model, tok, convs, base: dict, other: dict, device: str, limit: int = 20) -> list[dict]:
    """For answers that differ from the baseline's: the index of the first differing token and the target's
    logit gap between its two best tokens there (prompt + common prefix, one unpadded forward). A gap near 0 is
    a near-tie that any change of kernel or batch shape may flip: not an engine error."""
    from draftsmith.chat import render_prompt

    out = []
    for conv in convs:
        a, b = base.get(conv["id"]), other.get(conv["id"])
        if a is None or b is None or a == b or len(out) >= limit:
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prompt = render_prompt(tok, conv["messages"][:-1], conv.get("tools"))
        ids = torch.tensor([prompt + a[:k]], device=device)
        top = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float().topk(2)
        out.append({"id": conv["id"], "first_difference": k, "top2_logit_gap": float(top.values[0] - top.values[1])})
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="HF target folder")
    ap.add_argument("--tiny", action="store_true", help="tiny random llama + tiny tokenizer (CPU smoke test)")
    ap.add_argument("--smollm2-shape", action="store_true",
                    help="with --tiny: a random target of SmolLM2-135M's shape (speed only: random weights never stop)")
    ap.add_argument("--curated", help="curated parquet whose first turns are the prompts")
    ap.add_argument("--n", type=int, default=1024, help="conversations")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=128, help="batch of the generate baseline")
    ap.add_argument("--engines", default="generate,static,continuous")
    ap.add_argument("--batch-size-engine", type=int, default=256, help="batch of the static engine")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                    help="prompts this long or longer are skipped, as the stage does with tokenize.max_length")
    ap.add_argument("--warmup", type=int, default=64,
                    help="prompts each engine generates 16 tokens for, untimed, before its timed run (0 = none)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench_regenerate.json")
    args = ap.parse_args()
    convs = conversations(args)
    results = {"n": len(convs), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "runs": {}}
    print(f"{len(convs)} prompts, max_new_tokens {args.max_new_tokens}, {results['device']}, "
          f"target {args.target or 'tiny llama'}", flush=True)
    for dtype in args.dtypes.split(","):
        if args.tiny or not args.target:
            from tiny import tiny_target, tiny_tokenizer

            shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152) if args.smollm2_shape else {}
            tok, stops = tiny_tokenizer(), [2]
            model = tiny_target("llama", **shape).to(args.device, getattr(torch, dtype))
        else:
            from draftsmith.chat import load_tokenizer, stop_token_ids
            from draftsmith.target import load_target

            tok = load_tokenizer(args.target)
            model = load_target(args.target, dtype=dtype, device=args.device)
            stops = stop_token_ids(tok, args.target)
        base = None
        for engine in args.engines.split(","):
            batch = args.batch_size_engine if engine == "static" else args.batch_size
            settings = RegenerateShardSettings.from_config(  # the prompt limit is tokenize.max_length
                regenerate={"max_new_tokens": args.max_new_tokens, "max_turns": 1, "engine": engine,
                            "batch_size": batch},
                tokenize={"max_length": args.max_prompt_tokens})
            regen = Regenerator(model, tok, settings, stops)
            if args.warmup:  # one-time costs (kernel loading, allocator growth) out of the timed run
                warm = dataclasses.replace(settings, regenerate=settings.regenerate.replace(
                    max_new_tokens=min(16, args.max_new_tokens)))
                Regenerator(model, tok, warm, stops).regenerate([dict(c) for c in convs[:args.warmup]])
            sync(args.device)
            t0 = time.perf_counter()
            out, stats = regen.regenerate([dict(c) for c in convs])
            sync(args.device)
            sec = time.perf_counter() - t0
            answers = {r["id"]: tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"] for r in out}
            tps = stats["tokens_generated"] / sec
            row = {"seconds": sec, "tokens": stats["tokens_generated"], "tokens_per_s": tps,
                   "answers": len(answers), "cut": {k: v for k, v in stats.items() if k.startswith("cut.")}}
            if base is None:
                base = (tps, answers)
            else:
                same = sum(answers.get(k) == v for k, v in base[1].items())
                row.update(vs_baseline=tps / base[0], same_answers=same, compared=len(base[1]),
                           divergences=divergences(model, tok, convs, base[1], answers, args.device))
            results["runs"][f"{dtype}/{engine}"] = row
            print(f"{dtype:9s} {engine:11s} {sec:8.1f} s {stats['tokens_generated']:9d} tokens {tps:10.0f} tok/s"
                  + (f"  {row['vs_baseline']:6.2f}x generate, {row['same_answers']}/{row['compared']} answers "
                     "identical" if "vs_baseline" in row else "  (baseline)"), flush=True)
            if row.get("divergences"):
                gaps = sorted(d["top2_logit_gap"] for d in row["divergences"])
                print(f"    first differences of {len(gaps)} answers: top-2 logit gap there "
                      f"median {gaps[len(gaps) // 2]:.4f}, max {gaps[-1]:.4f}", flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "bench_regenerate.json").write_text(json.dumps(results, indent=1))
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
