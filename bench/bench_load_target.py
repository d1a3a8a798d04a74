"""Loading a target: ``draftsmith.target.load_target`` (``from_pretrained`` into host memory, then ``.to(device)``)
against ``device_map={"": device}`` (weights placed on the device as they are read).

Every GPU job (regenerate and extraction shards, evaluate workers) loads the whole target, and on an 8-GPU node
eight of them start together: the host memory each load peaks at, times eight, is what the node needs. Each way
runs in its own process (peak resident set size from ``getrusage``, wall time, the device's peak memory), after
one read of the weight files so both find them in the page cache; the ratio is printed. On an H200 at the
Qwen3.5-27B shape (2026-12-01): load_target 19.4 s, 5.7 GiB host peak; device_map 20.1 s, 51.1 GiB.

    python bench/bench_load_target.py --target /tmp/random-qwen3.5-27b            # on a GPU
    python bench/bench_load_target.py --target resources/targets/smollm2-135m-instruct --device cpu
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(way: str, target: str, device: str, dtype: str) -> dict:
    """One load in this process: ``{"way", "seconds", "peak_host_gib", "peak_device_gib"}``."""
    sys.path.insert(0, str(REPO))
    import torch

    from draftsmith.target import load_target, resolve_dtype

    t0 = time.perf_counter()
    if way == "host_first":  # the product's way
        model = load_target(target, dtype=dtype, device=device)
    else:  # every weight placed on the device as it is read
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=resolve_dtype(dtype, torch.device(device)),
                                                     attn_implementation="sdpa", device_map={"": device}).eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return {"way": way, "seconds": seconds, "params": params,
            "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["device_map", "host_first"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.target, args.device, args.dtype)))
        return 0
    for f in sorted(Path(args.target).glob("*.safetensors")):  # both ways read from the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    rows = []
    for way in ("host_first", "device_map"):
        out = subprocess.run([sys.executable, __file__, "--target", args.target, "--device", args.device,
                              "--dtype", args.dtype, "--child", way], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{way:10s}: {r['params'] / 1e9:.2f} B parameters in {r['seconds']:.1f} s, peak host memory "
              f"{r['peak_host_gib']:.1f} GiB" + (f", device {r['peak_device_gib']:.1f} GiB"
                                                 if r["peak_device_gib"] is not None else ""))
    base, new = rows
    print(f"device_map vs host first: {base['seconds'] / new['seconds']:.2f}x the speed, "
          f"{new['peak_host_gib'] / base['peak_host_gib']:.2f}x the peak host memory")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
