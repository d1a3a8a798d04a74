"""Where the regenerate stage's static engine spends a batch, by rows, at a target's real shape.

For each row count the engine (``draftsmith.regenerate.static.StaticBatchEngine``, the stage's own) generates
``--new-tokens`` tokens for that many random prompts of ``--prompt-tokens`` tokens, twice: the first run captures the
decode step's CUDA graph, compiles and autotunes the kernels, the second is timed. Paths (``--paths``): ``graph`` (the
decode step replayed as a CUDA graph: the baseline), ``fused`` (the same with the target fused as regenerate.fuse
does it, ``draftsmith.fused.fused_target``) and ``eager``. Printed from the engine's phase report
(``phase_report``): prefill tokens/s, decode ms per step and decoded tokens/s, each path's ratio to ``graph`` in the
same run (``batches`` > 1: the engine's memory budget cut the rows), and the memory floor of a step: the bytes it
must move (every weight but the input embedding; each row's static cache, which attention reads at its full length;
each row's conv and recurrent states once more, written back) at the device-to-device copy bandwidth measured here.
``--profile R`` adds a torch.profiler table of R-row decode steps by CUDA kernel time for each of
``--profile-paths``, to name what a step above its floor spends the time on.

    python bench/bench_regenerate_step.py --shape qwen3.5-27b --rows 1,16,64,128 --paths graph,eager --profile 64 \\
        --profile-paths eager,graph --json OUT/step.json
    python bench/bench_regenerate_step.py --shape qwen3.5-27b --rows 1,64,256 --paths graph,fused --json OUT/fused.json
    python bench/bench_regenerate_step.py --shape tiny-hybrid --rows 1,4 --new-tokens 8   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_extract import QWEN35_27B, TINY, build_target, sync

from draftsmith import fused
from draftsmith.regenerate.static import StaticBatchEngine, cache_bytes_per_row

SHAPES = {"qwen3.5-27b": QWEN35_27B, "tiny-hybrid": TINY}
PATHS = ("graph", "fused", "eager")


def copy_bandwidth(device: torch.device, gib: float = 2.0, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written), mean of ``iters`` after 2 warm-ups."""
    n = int(gib * 2 ** 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    sync(device.type)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device.type)
    return 2 * src.numel() * src.element_size() * iters / (time.perf_counter() - t0)


def engine_on(model, rows: int, new_tokens: int, path: str) -> StaticBatchEngine:
    return StaticBatchEngine(model, pad_id=0, stop_ids=[], batch_size=rows, max_new_tokens=new_tokens,
                             cuda_graphs=path != "eager")


def run_engine(model, prompts, new_tokens: int, path: str, device) -> tuple[dict, StaticBatchEngine]:
    """The timed second run's phase report on ``path``; the first run warms up (capture, compilation, autotuning,
    allocator growth)."""
    engine = engine_on(model, len(prompts), new_tokens, path)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with fused.fused_target(model, enabled=path == "fused"):
        engine.generate(prompts)
        engine.phases.clear()
        sync(device.type)
        engine.generate(prompts)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {**engine.phase_report(), "allocated_before_gib": before / 2 ** 30, "peak_gib": peak / 2 ** 30}, engine


def profile_steps(model, rows: int, path: str, device, out: Path | None) -> str:
    """Kernel table of ``rows``-row decode steps on ``path``: the engine on 8-token prompts and 17 new tokens (16
    steps; the tiny prefill runs once), warmed up first, then profiled."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(rows)]
    engine = engine_on(model, rows, 17, path)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with fused.fused_target(model, enabled=path == "fused"):
        engine.generate(prompts)
        sync(device.type)
        with profile(activities=activities) as prof:
            engine.generate(prompts)
            sync(device.type)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90)
    if out is not None:
        out.write_text(table)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-27b", choices=sorted(SHAPES), help="random target of this shape")
    ap.add_argument("--target", type=Path, help="a local HF target folder instead of --shape")
    ap.add_argument("--rows", default="1,16,64,128", help="batch rows to measure, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--paths", default="graph,fused,eager", help=f"of {', '.join(PATHS)}; graph is the baseline")
    ap.add_argument("--profile", type=int, default=0, help="rows of the profiled decode steps (0: no profile)")
    ap.add_argument("--profile-paths", default="graph,fused", help="paths profiled with --profile")
    ap.add_argument("--json", type=Path, help="write the results here (and the profile tables beside it)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    paths = args.paths.split(",") if device.type == "cuda" else ["eager"]  # no graphs on the CPU
    if set(paths) - set(PATHS):
        ap.error(f"--paths: unknown {sorted(set(paths) - set(PATHS))}")
    t0 = time.perf_counter()
    if args.target:
        from draftsmith.target import load_target

        model = load_target(str(args.target), dtype=args.dtype, device=device)
    else:
        model, _ = build_target(SHAPES[args.shape], str(device), dtype)
    cfg = model.config
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    length = -(-(args.prompt_tokens + args.new_tokens) // 128) * 128  # the engine's cache length for these prompts
    per_row = cache_bytes_per_row(cfg, length, dtype)
    states = cache_bytes_per_row(cfg, 0, dtype)  # conv + recurrent states alone: read and written every step
    name = str(args.target) if args.target else args.shape
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters ({time.perf_counter() - t0:.0f}"
          f" s to build); a step reads {weight_bytes / 2 ** 30:.2f} GiB of weights + {per_row / 2 ** 20:.1f} MiB of "
          f"cache per row ({length} positions; {states / 2 ** 20:.1f} MiB of it recurrent states, also written); "
          + (f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no GPU: no memory floor"), flush=True)
    results = {"target": name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "cache_length": length, "weight_bytes": weight_bytes, "cache_bytes_per_row": per_row,
               "state_bytes_per_row": states, "copy_bandwidth_bytes_per_s": bandwidth, "rows": {}}
    g = torch.Generator().manual_seed(0)
    print(f"{'rows':>5} {'path':>6} {'batches':>8} {'prefill tok/s':>14} {'ms/step':>9} {'floor ms':>9} {'x floor':>8} "
          f"{'decode tok/s':>13} {'peak GiB':>9} {'prefill vs graph':>17} {'decode vs graph':>16}", flush=True)
    for rows in [int(r) for r in args.rows.split(",")]:
        prompts = [torch.randint(3, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist() for _ in range(rows)]
        floor_ms = 1e3 * (weight_bytes + rows * (per_row + states)) / bandwidth if bandwidth else None
        entry = {"floor_ms": floor_ms}
        for path in paths:
            report, engine = run_engine(model, prompts, args.new_tokens, path, device)
            entry[path] = {**report, "graphs_captured": engine.graphs_captured, "graph_failures": engine.graph_failures}
            del engine  # the engine and its decode-step closure hold each other: collect them, or their caches and
            gc.collect()  # graph pools stay allocated and the next engine's memory budget cuts its rows
            if device.type == "cuda":
                torch.cuda.empty_cache()
            ms = report["decode_ms_per_step"]
            base = entry.get("graph")
            vs = (f"{report['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:16.2f}x "
                  f"{base['decode_ms_per_step'] / ms:15.2f}x" if base and path != "graph" else "")
            print(f"{rows:5d} {path:>6} {report['batches']:8d} {report['prefill_tokens_per_s']:14,.0f} {ms:9.2f} "
                  f"{floor_ms if floor_ms else float('nan'):9.2f} {ms / floor_ms if floor_ms else float('nan'):7.2f}x "
                  f"{report['decode_row_steps_per_s']:13,.0f} {report['peak_gib']:9.1f} {vs}", flush=True)
        results["rows"][rows] = entry
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1))
    if args.profile:
        for path in (args.profile_paths.split(",") if device.type == "cuda" else ["eager"]):
            out = args.json.with_name(f"{args.json.stem}-profile-{path}.txt") if args.json else None
            table = profile_steps(model, args.profile, path, device, out)
            print(f"\nprofile, {args.profile} rows, {path} (16 decode steps + an 8-token prefill):")
            print("\n".join(table.splitlines()[:20]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
