"""Benchmark of the merge stage: time to verify and index 10,000 chunks.

Writes a synthetic extraction (tokenized train parquet, plan.json, shard manifests and tiny but real
safetensors chunk files, to the extraction contract) and times, in the same run:

* baseline -- a naive merge that opens every chunk and reads all its tensors
  (:func:`draftsmith.features.read_chunk`) to count samples and tokens;
* ``merge_features`` header-only (the default), on 1 thread and on ``--threads``;
* ``merge_features`` with ``merge.verify_sha256`` (hashes every byte).

Ratios are printed against the baseline. The chunk files have just been written, so they are in the
page cache: this measures the CPU cost of merge, not the disk (on a cold network file system the
header-only path wins by more, since it reads ~1 KB per chunk instead of the whole file).

    python bench/bench_merge.py                # 10,000 chunks, 8 shards
    python bench/bench_merge.py --chunks 2000 --tokens-per-chunk 256 --hidden 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from draftsmith.features import read_chunk, write_chunk
from draftsmith.io import read_json, write_json
from draftsmith.merge import MergeSettings, merge_features

SEMANTICS = ("id i = output of decoder layer i = HF output_hidden_states[i + 1]; "
             "the last layer includes the final norm")


def build(root: Path, *, chunks: int, shards: int, samples_per_chunk: int, tokens_per_chunk: int,
          layer_ids: list[int], hidden: int) -> tuple[Path, list[Path], Path]:
    """Write a consistent synthetic extraction under ``root``; returns (plan, manifests, tokenized)."""
    rng = np.random.default_rng(0)
    rows_total = chunks * samples_per_chunk
    per = tokens_per_chunk // samples_per_chunk
    lengths = rng.integers(max(2, per // 2), per + per // 2 + 1, rows_total).astype(np.int32)
    ids = [f"{r:016x}" for r in range(rows_total)]
    tokenized = root / "tokenized" / "train.parquet"
    tokenized.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": ids, "source": ["bench"] * rows_total,
                             "num_tokens": pa.array(lengths, pa.int32())}).replace_schema_metadata(
        {b"draftsmith.tokenizer_fingerprint": b'"tok"', b"draftsmith.chat_template_kwargs": b"{}"}), tokenized)

    plan_shards = [list(range(s, rows_total, shards)) for s in range(shards)]
    features = root / "features"
    write_json(features / "plan.json", {
        "format": "draftsmith.plan/1", "num_shards": shards, "layer_ids": layer_ids, "hidden_size": hidden,
        "num_target_layers": max(layer_ids) + 1, "tokenized_rows": rows_total,
        "tokenized_tokens": int(lengths.sum()),
        "shards": [{"shard": s, "rows": r, "num_tokens": int(lengths[r].sum())} for s, r in enumerate(plan_shards)]})
    n = len(layer_ids)
    manifests = []
    for s, rows in enumerate(plan_shards):
        folder = features / f"shard-{s}"
        folder.mkdir(parents=True)
        entries = []
        for j in range(0, len(rows), samples_per_chunk):
            part = rows[j:j + samples_per_chunk]
            lens = lengths[part]
            t = int(lens.sum())
            states = torch.randn(t, n * hidden)
            name = f"chunk-{j // samples_per_chunk:05d}.safetensors"
            digest = write_chunk(folder / name, features=states, lengths=lens, sample_index=part,
                                 input_ids=torch.randint(0, 1000, (t,), dtype=torch.int32),
                                 loss_mask=torch.ones(t, dtype=torch.int8), storage_dtype="bfloat16",
                                 target_token=torch.randint(0, 1000, (t,), dtype=torch.int32))
            rms = states.reshape(t, n, hidden).pow(2).mean(dim=(0, 2)).sqrt().tolist()
            entries.append({"file": name, "sha256": digest, "bytes": (folder / name).stat().st_size,
                            "num_samples": len(part), "num_tokens": t, "rows": part, "ids": [ids[r] for r in part],
                            "stats": {"rms": rms, "nonfinite": 0, "zero_rows": 0}})
        manifest = {"format": "draftsmith.features/1", "shard": s, "num_shards": shards, "layer_ids": layer_ids,
                    "layer_semantics": SEMANTICS, "hidden_size": hidden, "num_target_layers": max(layer_ids) + 1,
                    "storage_dtype": "bfloat16", "has_target_token": True, "target_fingerprint": "target",
                    "tokenizer_fingerprint": "tok", "chat_template_kwargs": {},
                    "num_samples": len(rows), "num_tokens": sum(e["num_tokens"] for e in entries),
                    "bytes": sum(e["bytes"] for e in entries), "chunks": entries,
                    "stats": {"rms": entries[0]["stats"]["rms"], "nonfinite": 0, "zero_rows": 0}}
        write_json(folder / "manifest.json", manifest)
        manifests.append(folder / "manifest.json")
    return features / "plan.json", manifests, tokenized


def naive_merge(manifests: list[Path]) -> tuple[int, int]:
    """Baseline: read every chunk's tensors to count samples and tokens."""
    samples = tokens = 0
    for mpath in manifests:
        for entry in read_json(mpath)["chunks"]:
            chunk = read_chunk(mpath.parent / entry["file"], dtype=torch.bfloat16)
            samples += len(chunk["sample_index"])
            tokens += int(chunk["offsets"][-1])
    return samples, tokens


def timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples-per-chunk", type=int, default=4)
    parser.add_argument("--tokens-per-chunk", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3, help="tapped target layers")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--repeat", type=int, default=2, help="best of this many runs per variant")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args()

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="draftsmith-bench-merge-"))
    try:
        start = time.perf_counter()
        plan, manifests, tokenized = build(root, chunks=args.chunks, shards=args.shards,
                                           samples_per_chunk=args.samples_per_chunk,
                                           tokens_per_chunk=args.tokens_per_chunk,
                                           layer_ids=list(range(1, 2 * args.layers, 2)), hidden=args.hidden)
        total_bytes = sum(p.stat().st_size for p in root.glob("features/shard-*/chunk-*"))
        print(f"synthetic extraction: {args.chunks} chunks in {args.shards} shards, "
              f"{args.chunks * args.samples_per_chunk} samples, {total_bytes / 1e6:.1f} MB of chunk files "
              f"(written in {time.perf_counter() - start:.1f} s; page cache warm)", flush=True)
        index_path = root / "features" / "index.json"

        t_base, (samples, tokens) = timed(lambda: naive_merge(manifests), args.repeat)
        def settings(verify_sha256: bool) -> MergeSettings:
            return MergeSettings.from_config({"merge": {"verify_sha256": verify_sha256}})

        variants = [
            ("merge, header-only, 1 thread", dict(threads=1, settings=settings(False))),
            (f"merge, header-only, {args.threads} threads", dict(threads=args.threads, settings=settings(False))),
            (f"merge, verify_sha256, {args.threads} threads", dict(threads=args.threads, settings=settings(True))),
        ]
        print(f"{'variant':<42} {'seconds':>8} {'chunks/s':>10} {'vs baseline':>12}")
        print(f"{'baseline: load every chunk (naive)':<42} {t_base:8.2f} {args.chunks / t_base:10.0f} {1.0:11.2f}x")
        for name, kw in variants:
            t, index = timed(lambda: merge_features(plan, manifests, tokenized, index_path, **kw), args.repeat)
            assert index["num_samples"] == samples and index["num_tokens"] == tokens
            print(f"{name:<42} {t:8.2f} {args.chunks / t:10.0f} {t_base / t:11.2f}x", flush=True)
        print(f"index.json: {index_path.stat().st_size / 1e6:.2f} MB; python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPUs visible")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
