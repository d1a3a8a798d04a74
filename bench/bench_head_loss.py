"""Benchmark: the drafter's LM-head loss, eager chunks against fused ones (``train.compile``), at the shipped shapes.

The loss runs the target's frozen LM head over every supervised slot (``[N, H] x [H, V]``) in chunks of
``train.logits_chunk_mib`` of float32 logits (:func:`draftsmith.drafter_loss.head_cross_entropy`). The eager chunk
makes a float32 copy of its logits and walks it about eight times (log-sum-exp, label gather, argmax, softmax in
place, the one-hot, the cast for the gradient's matmul); ``fused=True`` computes the same statistics by
:func:`draftsmith.drafter_loss.logit_statistics` compiled with ``torch.compile``, reading the chunk's bf16 logits
a few times. Both do the same two matmuls (logits, and the gradient ``softmax - onehot`` times the head).

Shapes (the configs' step: slots = anchors x (block - 1)):
* ``smollm2-135m`` (config/gpu-proof.yaml): 4,096 anchors -> N = 61,440 slots, H 576, V 49,152;
* ``qwen3.5-27b`` (config/gpu-node.yaml): 2,048 anchors -> N = 30,720, H 5,120, V 248,320;
* ``tiny`` (CPU smoke): N 2,000, H 64, V 4,096.

Prints per shape and path the forward + backward time (median of ``--iters`` after ``--warmup``, GPU-synchronised),
the matmul FLOPs' rate, peak memory, the ratio fused / eager measured in the same run, and the largest differences
of CE, gradient and argmax agreement between the two paths. Writes ``OUT/bench_head_loss.json`` after each shape
(a run cut short keeps the shapes it finished).

    python bench/bench_head_loss.py --out $OUT                 # both GPU shapes (DFlash)
    python bench/bench_head_loss.py --top-k 16 --out $OUT      # the DFlash2 path (the selector's candidates)
    python bench/bench_head_loss.py --shapes tiny --out /tmp/hl # CPU smoke (off a GPU both paths are eager)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftsmith.drafter_loss import head_cross_entropy_topk  # noqa: E402

SHAPES = {"smollm2-135m": dict(n=4096 * 15, hidden=576, vocab=49152),
          "qwen3.5-27b": dict(n=2048 * 15, hidden=5120, vocab=248320),
          "tiny": dict(n=2000, hidden=64, vocab=4096)}


def run(shape: dict, fused: bool, device: torch.device, chunk_mib: int, warmup: int, iters: int, *,
        softcap: float | None, top_k: int) -> dict:
    """Time ``iters`` forward + backward passes of the loss (after ``warmup``); return times and the outputs
    (CE, argmax and the gradient, kept on the CPU so that the next run's peak memory is its own)."""
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    n, h, v = shape["n"], shape["hidden"], shape["vocab"]
    hidden = (torch.randn(n, h, generator=g) * 2.0).to(device=device, dtype=dt).requires_grad_(True)
    head = (torch.randn(v, h, generator=g) * h ** -0.5).to(device=device, dtype=dt)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    weight = torch.rand(n, generator=g).to(device)

    def step():
        hidden.grad = None
        ce, pred, _, _ = head_cross_entropy_topk(hidden, head, labels, top_k, softcap=softcap,
                                                 chunk_bytes=chunk_mib << 20, fused=fused)
        (ce * weight).sum().backward()
        return ce, pred

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        ce, pred = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(times)
    flops = 2 * 2 * n * h * v  # logits and the gradient's matmul
    return {"ms": ms, "tflops": flops / (ms / 1e3) / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None,
            "ce": ce.detach().float().cpu(), "pred": pred.cpu(), "grad": hidden.grad.detach().float().cpu()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,qwen3.5-27b")
    ap.add_argument("--chunk-mib", type=int, default=1024, help="train.logits_chunk_mib (the configs': 1024)")
    ap.add_argument("--softcap", type=float, default=None, help="final_logit_softcapping (Gemma-style targets)")
    ap.add_argument("--top-k", type=int, default=0, help="the DFlash2 path: selector_top_k candidates too (16)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "chunk_mib": args.chunk_mib, "softcap": args.softcap, "top_k": args.top_k, "shapes": {}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"{out['device']}, torch {out['torch']}, chunks of {args.chunk_mib} MiB of float32 logits")
    print("shape          N      H       V     eager ms  fused ms  fused/eager  TFLOP/s e/f   peak GiB e/f   "
          "max |dCE|  max |dgrad|/max|grad|  argmax equal")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        opts = {"softcap": args.softcap, "top_k": args.top_k}
        eager = run(shape, False, device, args.chunk_mib, args.warmup, args.iters, **opts)
        torch._dynamo.reset()  # each shape compiles its own kernels (the vocabulary is static)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        fused = run(shape, True, device, args.chunk_mib, args.warmup, args.iters, **opts)
        d_ce = float((eager["ce"] - fused["ce"]).abs().max())
        d_grad = float((eager["grad"] - fused["grad"]).abs().max() / eager["grad"].abs().max().clamp_min(1e-30))
        agree = float((eager["pred"] == fused["pred"]).float().mean())
        row = {"shape": shape, "eager_ms": eager["ms"], "fused_ms": fused["ms"], "speedup": eager["ms"] / fused["ms"],
               "eager_tflops": eager["tflops"], "fused_tflops": fused["tflops"], "eager_peak_gib": eager["peak_gib"],
               "fused_peak_gib": fused["peak_gib"], "max_abs_ce_diff": d_ce, "max_rel_grad_diff": d_grad,
               "argmax_agreement": agree}
        out["shapes"][name] = row
        peak = (f"{eager['peak_gib']:.1f} / {fused['peak_gib']:.1f}" if eager["peak_gib"] is not None else "n/a")
        print(f"{name:12s} {shape['n']:6d} {shape['hidden']:6d} {shape['vocab']:7d} {eager['ms']:10.1f} "
              f"{fused['ms']:9.1f} {fused['ms'] / eager['ms']:10.2f}x   "
              f"{eager['tflops']:5.0f} / {fused['tflops']:<5.0f}  {peak:>13s}   {d_ce:9.2e}  {d_grad:12.2e}"
              f"           {agree:.4f}", flush=True)
        (Path(args.out) / "bench_head_loss.json").write_text(json.dumps(out, indent=1))  # each shape as it ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
