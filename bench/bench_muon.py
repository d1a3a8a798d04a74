"""Benchmark: Muon's optimizer step under DDP, ``torch.optim.Muon`` (every rank orthogonalises every matrix) against
draftsmith's ``ShardedMuon`` (each rank its share, then a broadcast), on the drafter's own weight matrices.

The matrices are those the trainer gives Muon (every trainable 2-D weight of the drafter: attention and MLP
projections, ``fc``) at a shape of bench/bench_train.py (``--shape``; drafter sizes from ``--config``), fp32 with
random gradients, the same on every rank (as after DDP's all-reduce). Each optimizer steps ``--warmup`` times, then
``--iters`` timed steps; the median step (the slowest rank's, synchronised) is printed for both, with their ratio,
the Newton-Schulz TFLOP of a step and the largest share of it one rank does. With one process the two run the same
code (``ShardedMuon`` is ``torch.optim.Muon`` without a process group): a check of the timer, ratio ~1.
``--ns-dtype float32`` gives ``ShardedMuon`` the CPU's float32 orthogonalisations (draftsmith's trainer off the GPU)
against ``torch.optim.Muon``'s bf16 ones: on a CPU without bf16 instructions the ratio is the emulation's cost.

    python bench/bench_muon.py --shape qwen3.5-27b --config config/gpu-node.yaml           # one GPU
    python -m torch.distributed.run --standalone --nproc-per-node 8 bench/bench_muon.py \\
        --shape qwen3.5-27b --config config/gpu-node.yaml --out $OUT                       # 8 GPUs (NCCL)
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/bench_muon.py --shape tiny   # CPU, gloo
    OMP_NUM_THREADS=1 python bench/bench_muon.py --shape smollm2-135m --config config.yaml --ns-dtype float32 \
        --warmup 1 --iters 3                                                               # the CPU default's step
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SHAPES, drafter_config, load_sizes

from draftsmith.modeling import DFlashDraftModel
from draftsmith.train.model import muon_matrices
from draftsmith.train.muon import ShardedMuon, newton_schulz_flops

MUON = dict(lr=1e-3, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def muon_shapes(shape: dict, sizes: dict) -> list[tuple[int, int]]:
    """The shapes of the drafter's Muon matrices (bench_train.drafter_config, built on the meta device)."""
    with torch.device("meta"):
        model = DFlashDraftModel(drafter_config(shape, sizes))
    return [tuple(p.shape) for p in muon_matrices([(n, p) for n, p in model.named_parameters() if p.requires_grad])]


def time_steps(opt: torch.optim.Optimizer, device: torch.device, warmup: int, iters: int) -> float:
    """Median ms of ``iters`` steps after ``warmup``; each step timed on every rank, the slowest rank's kept."""
    times = []
    for i in range(warmup + iters):
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = torch.tensor([1000 * (time.perf_counter() - t)])
        if dist.is_initialized():
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(ms))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES))
    ap.add_argument("--config", default=None, help="drafter sizes (config/gpu-node.yaml)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="writes muon-<world>.json there")
    ap.add_argument("--ns-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="ShardedMuon's orthogonalisation dtype (draftsmith's trainer: float32 off the GPU)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    shapes = muon_shapes(SHAPES[args.shape], load_sizes(args.config, args.shape == "tiny"))
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, device=device, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    plain = time_steps(torch.optim.Muon(params, **MUON), device, args.warmup, args.iters)
    sharded_opt = ShardedMuon(params, ns_dtype=getattr(torch, args.ns_dtype), **MUON)
    sharded = time_steps(sharded_opt, device, args.warmup, args.iters)
    result = {"shape": args.shape, "world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "matrices": len(shapes), "params": sum(a * b for a, b in shapes),
              "newton_schulz_tflop": sum(newton_schulz_flops(s) for s in shapes) / 1e12,
              "largest_share": sharded_opt.largest_share, "ns_dtype": args.ns_dtype, "torch_muon_ms": plain,
              "sharded_muon_ms": sharded,
              "speedup": plain / sharded}
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{args.shape}, {world} rank(s) on {result['device']}: {len(shapes)} matrices "
              f"({result['params'] / 1e9:.2f} B parameters), Newton-Schulz {result['newton_schulz_tflop']:.1f} TFLOP "
              f"a step; torch.optim.Muon {plain:.1f} ms, ShardedMuon ({args.ns_dtype}) {sharded:.1f} ms (largest share "
              f"{sharded_opt.largest_share:.1%}): {plain / sharded:.2f}x")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"muon-{world}.json").write_text(json.dumps(result, indent=1) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
