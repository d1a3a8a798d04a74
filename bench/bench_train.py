"""Benchmark: DFlash drafter training at the batch sizes the shipped configs use: step time, peak memory, MFU.

Real multi-document batches: documents with the committed ShareGPT length distribution
(bench/data/sharegpt-lengths.json, SmolLM2-tokenized), each a prompt (the first 30% of its tokens) and a
supervised answer, packed into rows of ``train.tokens_per_batch`` tokens by the trainer's own
``draftsmith.train.pack_documents`` (``num_anchors`` per document, ``max_anchors_per_row``, power-of-two anchor
buckets, rows padded to 128), random bf16 features. A step is exactly what ``draftsmith.train`` runs:
``DFlashDraftModel.training_forward`` (flex_attention with the BlockMask built from the block structure, the
chunked LM-head loss), backward, grad clip, fused AdamW, bf16 autocast.

Shapes (``--shape``): ``qwen3.5-27b`` (target hidden 5120, 64 layers, vocab 248,320; drafter 5 layers
[sliding x 4 (window 2048), full], heads 32 / kv 8 / head_dim 128, intermediate 17,408, taps [1, 16, 31, 46,
61]) and ``smollm2-135m`` (hidden 576, 30 layers, vocab 49,152; drafter heads 9 / kv 3 / head_dim 64,
intermediate 1536, taps [1, 14, 27]); sizes from ``--config`` (train.tokens_per_batch, num_anchors,
max_anchors_per_row, activation_checkpointing, compile; drafter.block_size, num_layers for smollm2).

Variants, each printed with step ms, context tokens/s, block tokens per step, TFLOP/s, MFU (model FLOPs /
step time / the bf16 peak of an 8192^3 matmul measured in the same run) and peak GPU memory:
* ``before``: the previous implementation's memory pattern (``create_block_mask`` over the dense grid, all
  supervised slots' logits at once) as the baseline: at gpu-node sizes it runs out of memory;
* ``eager`` / ``compiled``: the trainer's path as configured (compiled = ``train.compile``);
* ``no-cap+ckpt``: every sampled anchor (no ``max_anchors_per_row``) with activation checkpointing.

    python bench/bench_train.py --shape qwen3.5-27b --config config/gpu-node.yaml --out $OUT
    python bench/bench_train.py --shape smollm2-135m --config config/gpu-proof.yaml
    python bench/bench_train.py --tiny                 # CPU debug, tiny shapes
    python bench/bench_train.py --e2e-only [--compile-loop]   # draftsmith.train.train on synthetic features
    python bench/bench_train.py --ddp 2                # scripts/train.py under torchrun, 2 processes vs 1

Figures measured on an H200: docs/gpu-proof/README.md (with the exact commands).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config

from draftsmith.modeling import (
    DFlashDraftModel,
    block_targets,
    build_drafter_config,
    default_loss_gamma,
    dflash_mask_mod,
    dflash_visible_intervals,
    training_flops,
)
from draftsmith.train import pack_documents

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "qwen3.5-27b": dict(hidden=5120, target_layers=64, vocab=248320, layers=5, heads=32, kv_heads=8, head_dim=128,
                        intermediate=17408, window=2048, layer_ids=[1, 16, 31, 46, 61], sliding=True),
    "smollm2-135m": dict(hidden=576, target_layers=30, vocab=49152, layers=3, heads=9, kv_heads=3, head_dim=64,
                         intermediate=1536, window=None, layer_ids=[1, 14, 27], sliding=False),
    "tiny": dict(hidden=128, target_layers=8, vocab=2048, layers=2, heads=4, kv_heads=2, head_dim=32,
                 intermediate=256, window=64, layer_ids=[1, 5], sliding=True),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, n: int, iters: int) -> float:
    """bf16 (fp32 on CPU) n^3 matmul rate in FLOP/s: median of ``iters`` timed products after 3 warm-ups."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2]


def load_sizes(config: str | None, tiny: bool) -> dict:
    """train / drafter sizes of a config file merged over config.yaml (as ``--configfile`` does)."""
    base = yaml.safe_load((REPO / "config.yaml").read_text())
    over = yaml.safe_load(Path(config).read_text()) if config else {}
    train = {**base.get("train", {}), **over.get("train", {})}
    drafter = {**base.get("drafter", {}), **over.get("drafter", {})}
    sizes = {"tokens_per_batch": train.get("tokens_per_batch", 8192), "num_anchors": train.get("num_anchors", 512),
             "max_anchors_per_row": train.get("max_anchors_per_row"),
             "activation_checkpointing": bool(train.get("activation_checkpointing", False)),
             "compile": bool(train.get("compile", False)), "block": drafter.get("block_size", 16),
             "layers": drafter.get("num_layers")}
    if tiny:
        sizes.update(tokens_per_batch=512, num_anchors=32, max_anchors_per_row=48, block=8)
    return sizes


def build_model(shape: dict, sizes: dict, device: torch.device, seed: int = 0):
    """Drafter (fp32 master weights) and frozen bf16 embedding / LM head of the shape."""
    torch.manual_seed(seed)
    target_cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                             intermediate_size=shape["intermediate"], num_hidden_layers=shape["target_layers"],
                             num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                             head_dim=shape["head_dim"], max_position_embeddings=262144)
    n = shape["layers"] if shape["sliding"] else (sizes["layers"] or shape["layers"])
    cfg = build_drafter_config(target_cfg, num_layers=n, block_size=sizes["block"],
                               target_layer_ids=shape["layer_ids"], mask_token_id=shape["vocab"] - 1,
                               layer_types=(["sliding_attention"] * (n - 1) + ["full_attention"]) if shape["sliding"]
                               else None, sliding_window=shape["window"] if shape["sliding"] else None)
    model = DFlashDraftModel(cfg).to(device).train()
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.randn(shape["vocab"], shape["hidden"], device=device, dtype=dt) * 0.02
    head = torch.randn(shape["vocab"], shape["hidden"], device=device, dtype=dt) * 0.02
    return model, embed, head


def document_lengths() -> list[int]:
    return json.loads((REPO / "bench/data/sharegpt-lengths.json").read_text())["num_tokens"]


def build_batches(shape: dict, sizes: dict, device: torch.device, count: int, *, cap: bool = True, seed: int = 0):
    """``count`` packed rows of ShareGPT-length documents (prompt 30%, supervised answer 70%), packed by the
    trainer's ``pack_documents`` with the config's anchor settings."""
    g = torch.Generator().manual_seed(seed)
    lengths = document_lengths()
    width = len(shape["layer_ids"]) * shape["hidden"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    capacity = sizes["tokens_per_batch"]
    batches, i = [], int(torch.randint(0, len(lengths), (1,), generator=g))
    for b in range(count):
        parts, used = [], 0
        while used < capacity:
            n = min(max(lengths[i % len(lengths)], 16), capacity - used)
            i += 1
            if n < 16:
                break
            mask = torch.zeros(n, dtype=torch.bool)
            mask[int(0.3 * n):] = True
            ids = torch.randint(0, shape["vocab"] - 1, (n,), generator=g)
            parts.append({"features": torch.randn(n, width, generator=g).to(dt), "input_ids": ids,
                          "loss_mask": mask, "target_token": torch.roll(ids, -1)})
            used += n
        batch = pack_documents(parts, width=width, num_anchors=sizes["num_anchors"], seed=seed * 1000 + b,
                               feature_dtype=dt, pad_tokens_to=128 if device.type == "cuda" else 1,
                               pad_anchors_to=max(1, 128 // sizes["block"]), bucket_anchors=device.type == "cuda",
                               max_anchors_per_row=sizes["max_anchors_per_row"] if cap else None)
        batches.append(batch.to(device))
    return batches


def visible_pairs(model: DFlashDraftModel, batch) -> float:
    """Visible (query, key) pairs summed over the layers (from the interval form of the mask: no grid)."""
    anchor_doc = torch.where(batch.anchor_valid, torch.gather(batch.doc_ids, 1, batch.anchors),
                             torch.full_like(batch.anchors, -2))
    total = 0.0
    for layer in model.layers:
        c, w = layer.self_attn.mask_key
        lo, hi, blo, bhi = dflash_visible_intervals(batch.doc_ids, batch.anchors, anchor_doc, model.block_size,
                                                    is_causal=c, sliding_window=w)
        total += float((hi - lo).clamp_min(0).sum() + (bhi - blo).clamp_min(0).sum())
    return total


def step_flops(model: DFlashDraftModel, batch) -> float:
    _, valid = block_targets(batch, model.block_size, True)
    return training_flops(model.config, ctx_tokens=int((batch.doc_ids >= 0).sum()),
                          block_tokens=batch.anchors.shape[1] * model.block_size, head_tokens=int(valid.sum()),
                          attended_pairs=visible_pairs(model, batch))["total"]


def before_masks(model: DFlashDraftModel, batch) -> dict:
    """The previous implementation's masks: ``create_block_mask`` evaluating mask_mod over the dense grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, S = batch.input_ids.shape
    A = batch.anchors.shape[1]
    anchor_doc = torch.where(batch.anchor_valid, torch.gather(batch.doc_ids, 1, batch.anchors),
                             torch.full_like(batch.anchors, -2))
    masks = {}
    for layer in model.layers:
        key = layer.self_attn.mask_key
        if key not in masks:
            mod = dflash_mask_mod(batch.doc_ids, batch.anchors, anchor_doc, model.block_size, is_causal=key[0],
                                  sliding_window=key[1])
            masks[key] = create_block_mask(mod, R, None, A * model.block_size, S + A * model.block_size,
                                           device=batch.input_ids.device, _compile=False)
    return masks


def run_variant(name, model, embed, head, batches, opt, device, *, warmup, iters, peak, before=False,
                checkpointing=False) -> dict:
    """Time ``iters`` steps over ``batches`` (cycled) after ``warmup`` steps; peak memory over all of them."""
    gamma = default_loss_gamma(model.block_size)
    params = [p for p in model.parameters() if p.requires_grad]
    model.activation_checkpointing = checkpointing
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    def step(batch):
        masks = before_masks(model, batch) if before else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model.training_forward(batch, embed, head, gamma=gamma, use_target_tokens=True, masks=masks,
                                         logits_chunk_bytes=(1 << 50) if before else 1 << 30)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    t0 = time.perf_counter()
    for k in range(warmup):
        step(batches[k % len(batches)])
    sync(device)
    warm = time.perf_counter() - t0
    times, flops, ctx, blocks = [], 0.0, 0, 0
    for k in range(iters):
        batch = batches[k % len(batches)]
        sync(device)
        t = time.perf_counter()
        step(batch)
        sync(device)
        times.append(time.perf_counter() - t)
        flops += step_flops(model, batch)
        ctx += int((batch.doc_ids >= 0).sum())
        blocks += int(batch.anchor_valid.sum()) * model.block_size
    sec = sum(times)
    return {"step_ms": 1e3 * sec / iters, "ctx_tokens_per_s": ctx / sec, "block_tokens_per_step": blocks / iters,
            "ctx_tokens_per_step": ctx / iters, "tflops": flops / sec / 1e12, "mfu": flops / sec / peak,
            "warmup_s": warm, "times_ms": [1e3 * t for t in times],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}


SYNTH = dict(hidden=256, vocab=4096, target_layers=8, layer_ids=[1, 5])


def write_synthetic(workdir: Path) -> tuple[Path, Path]:
    """Small synthetic features (arithmetic token sequences, so a drafter can learn them) and a target folder
    holding only the config, embedding and LM head. Returns (index.json, target folder)."""
    from safetensors.torch import save_file

    H, V, L, ids_ = SYNTH["hidden"], SYNTH["vocab"], SYNTH["target_layers"], SYNTH["layer_ids"]
    tdir = workdir / "target"
    tdir.mkdir(parents=True, exist_ok=True)
    Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=512, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64).to_json_file(str(tdir / "config.json"))
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.1,
               "lm_head.weight": torch.randn(V, H, generator=g) * 0.1}, str(tdir / "model.safetensors"))
    fdir = workdir / "features"
    (fdir / "shard-0").mkdir(parents=True, exist_ok=True)
    chunks = []
    for c in range(3):
        lens = torch.randint(100, 400, (8,), generator=g).tolist()
        toks, masks, offs = [], [], [0]
        for n in lens:
            start, stride = torch.randint(0, V, (2,), generator=g).tolist()
            t = (start + stride * torch.arange(n)) % (V - 1)
            m = torch.ones(n, dtype=torch.int8)
            m[:20] = 0
            toks.append(t.to(torch.int32))
            masks.append(m)
            offs.append(offs[-1] + n)
        ids = torch.cat(toks)
        feats = torch.randn(ids.numel(), len(ids_) * H, generator=g).to(torch.bfloat16)
        name = f"shard-0/chunk-{c:05d}.safetensors"
        save_file({"hidden_states": feats, "input_ids": ids, "loss_mask": torch.cat(masks),
                   "offsets": torch.tensor(offs), "sample_index": torch.arange(c * 8, c * 8 + 8),
                   "target_token": torch.roll(ids, -1)}, str(fdir / name))
        chunks.append({"path": name, "shard": 0, "num_samples": 8, "num_tokens": offs[-1],
                       "rows": list(range(c * 8, c * 8 + 8))})
    (fdir / "index.json").write_text(json.dumps({
        "format": "draftsmith.index/1", "chunks": chunks, "num_samples": 24,
        "num_tokens": sum(c["num_tokens"] for c in chunks),
        "layer_ids": ids_, "hidden_size": H, "num_target_layers": L, "storage_dtype": "bfloat16",
        "has_target_token": True, "target_fingerprint": "synthetic", "tokenizer_fingerprint": "synthetic"}))
    return fdir / "index.json", tdir


def synthetic_cfg(steps: int, compile_layers: bool = False) -> dict:
    return {"train": {"max_steps": steps, "tokens_per_batch": 1024, "num_anchors": 64, "lr": 3e-3,
                      "save_every": steps // 2, "eval_every": steps // 2, "eval_fraction": 0.1, "log_every": 5,
                      "labels": "data", "compile": compile_layers},
            "drafter": {"num_layers": 2, "block_size": 8, "mask_token_id": SYNTH["vocab"] - 1,
                        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128}}


def run_e2e(workdir: Path, steps: int = 40, compile_layers: bool = False) -> dict:
    """The real training loop (``draftsmith.train.train``: prefetch thread, pinned copies, flex, fused AdamW,
    checkpoints, held-out metrics) on :func:`write_synthetic` features. Checks that it runs on this device and
    that the loss falls; not a speed figure."""
    from draftsmith.train import train

    index, tdir = write_synthetic(workdir)
    cfg = synthetic_cfg(steps, compile_layers)
    t = time.perf_counter()
    state = train(index, tdir, workdir / "out", cfg["train"], cfg["drafter"])
    first = state["history"][0]["loss"] if state["history"] else None
    return {"wall_s": time.perf_counter() - t, "steps": state["steps"], "heldout_first": first,
            "heldout_final": state["heldout"], "last_train": state["last_train"],
            "checkpoints": sorted(p.name for p in (workdir / "out" / "checkpoints").iterdir()),
            "trained": sorted(p.name for p in (workdir / "out" / "trained").iterdir())}


def run_ddp(workdir: Path, nproc: int, steps: int = 40, compile_layers: bool = False) -> dict:
    """``torchrun --nproc-per-node nproc scripts/train.py`` (the train rule's command; NCCL on CUDA) on
    :func:`write_synthetic` features, then the same with one process; returns both trainer states' figures.
    Each rank takes its own rows, so a step of N processes sees N times the rows of a step of one."""
    import subprocess

    index, tdir = write_synthetic(workdir)
    cfg = synthetic_cfg(steps, compile_layers)
    res = {}
    for n in (nproc, 1):
        out = workdir / f"out-{n}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               str(Path(__file__).resolve().parents[1] / "scripts" / "train.py"), "--index", str(index),
               "--target", str(tdir), "--out", str(out), "--args", json.dumps(cfg)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            res[f"procs_{n}"] = {"returncode": proc.returncode, "log_tail": (proc.stdout + proc.stderr)[-3000:]}
            continue
        state = json.loads((out / "trained" / "trainer_state.json").read_text())
        res[f"procs_{n}"] = {"wall_s": wall, "steps": state["steps"], "world": state.get("world_size"),
                             "heldout_first": state["history"][0]["loss"] if state["history"] else None,
                             "heldout_final": state["heldout"]["loss"], "last_train": state["last_train"],
                             "log_tail": (proc.stdout + proc.stderr)[-800:]}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU debugging)")
    ap.add_argument("--shape", default="qwen3.5-27b", choices=[k for k in SHAPES if k != "tiny"])
    ap.add_argument("--config", default=str(REPO / "config/gpu-node.yaml"),
                    help="config whose train / drafter sizes are benchmarked (merged over config.yaml)")
    ap.add_argument("--variants", default="before,eager,compiled,no-cap+ckpt")
    ap.add_argument("--batches", type=int, default=4, help="distinct packed rows, cycled")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--compile-loop", action="store_true",
                    help="--e2e-only / --ddp: train with train.compile (torch.compile of the drafter layers)")
    ap.add_argument("--e2e-only", action="store_true", help="only run draftsmith.train.train on synthetic features")
    ap.add_argument("--ddp", type=int, default=0, metavar="N",
                    help="only run scripts/train.py under torchrun with N processes (and 1) on synthetic features")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench.json and progress.log")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = open(out / "progress.log", "a", buffering=1)  # line-buffered: survives a kill

    def say(msg: str) -> None:
        line = f"[{time.perf_counter() - t_start:7.1f} s] {msg}"
        print(line, flush=True)
        progress.write(line + "\n")

    def elapsed() -> float:
        return time.perf_counter() - t_start

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.ddp:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            res = run_ddp(Path(tmp), args.ddp, compile_layers=args.compile_loop)
        (out / "ddp.json").write_text(json.dumps(res, indent=1))
        for k, r in res.items():
            say(f"{k}: " + json.dumps({a: b for a, b in r.items() if a != "log_tail"}))
            say(f"{k} log tail:\n{r.get('log_tail', '')}")
        return 0
    if args.e2e_only:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            res = run_e2e(Path(tmp), compile_layers=args.compile_loop)
        (out / "e2e.json").write_text(json.dumps(res, indent=1))
        say("e2e train loop: " + json.dumps(res)[:1500])
        return 0
    shape = SHAPES["tiny" if args.tiny else args.shape]
    sizes = load_sizes(args.config, args.tiny)
    torch.backends.cuda.matmul.allow_tf32 = True
    import transformers
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "shape": args.shape,
            "config": args.config, "sizes": sizes}
    say(json.dumps(info))
    results = {"info": info, "variants": {}}

    def save() -> None:
        (out / f"bench_train-{args.shape}.json").write_text(json.dumps(results, indent=1))

    peak = matmul_peak(device, 8192 if device.type == "cuda" else 1024, 10)
    results["matmul_peak_flops"] = peak
    say(f"matmul peak: {peak / 1e12:.1f} TFLOP/s")
    model, embed, head = build_model(shape, sizes, device)
    batches = build_batches(shape, sizes, device, args.batches)
    params = sum(p.numel() for p in model.parameters())
    say(f"drafter {model.config.num_hidden_layers} layers, {params / 1e9:.3f} B params; rows of "
        f"{sizes['tokens_per_batch']} tokens: " + ", ".join(
            f"{int((b.doc_ids >= 0).sum())} ctx / {int(b.anchor_valid.sum())} anchors (A={b.anchors.shape[1]})"
            for b in batches))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda" or None)

    def record(name, **kw):
        say(f"{name}: {args.warmup} warm-up step(s), {args.iters} timed")
        try:
            r = run_variant(name, model, embed, head, kw.pop("batches", batches), opt, device, warmup=args.warmup,
                            iters=args.iters, peak=peak, **kw)
        except torch.OutOfMemoryError as exc:
            r = {"error": "out of memory", "detail": str(exc).splitlines()[0][:300],
                 "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None}
        except Exception:  # noqa: BLE001 - keep the figures measured so far
            r = {"error": traceback.format_exc()[-2000:]}
        results["variants"][name] = r
        if "error" in r:
            say(f"{name:12s} FAILED: {r['error'][:200]} (peak {r.get('peak_mem_gib') or 0:.1f} GiB)")
        else:
            say(f"{name:12s} step {r['step_ms']:8.1f} ms  {r['ctx_tokens_per_s']:9.0f} ctx tok/s  "
                f"{r['block_tokens_per_step']:7.0f} block tok  {r['tflops']:6.1f} TFLOP/s  MFU {100 * r['mfu']:5.1f}%  "
                f"peak {r['peak_mem_gib'] or 0:6.1f} GiB  (warm-up {r['warmup_s']:.0f} s)")
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if "before" in args.variants and device.type == "cuda":
        record("before", before=True)
    if "eager" in args.variants:
        record("eager", checkpointing=sizes["activation_checkpointing"])
    if "compiled" in args.variants and device.type == "cuda":
        for layer in model.layers:
            layer.compile()
        record("compiled", checkpointing=sizes["activation_checkpointing"])
    if "no-cap+ckpt" in args.variants:
        record("no-cap+ckpt", checkpointing=True, batches=build_batches(shape, sizes, device, args.batches, cap=False))
    say(f"summary ({args.shape}, {sizes['tokens_per_batch']} tokens per row, {sizes['num_anchors']} anchors per "
        f"document, max {sizes['max_anchors_per_row']} per row, block {sizes['block']})")
    print("variant        step ms   ctx tok/s   MFU    peak GiB   vs eager")
    base = results["variants"].get("eager", {}).get("step_ms")
    for name, r in results["variants"].items():
        if "error" in r:
            print(f"{name:12s}  {r['error'][:60]} (peak {r.get('peak_mem_gib') or 0:.1f} GiB)")
            continue
        ratio = f"{base / r['step_ms']:6.2f}x" if base else "   n/a"
        print(f"{name:12s} {r['step_ms']:9.1f} {r['ctx_tokens_per_s']:10.0f} {100 * r['mfu']:6.1f}% "
              f"{r['peak_mem_gib'] or 0:9.1f}   {ratio}")
    print(f"matmul peak {peak / 1e12:.1f} TFLOP/s (8192^3 bf16, same run); total {elapsed():.0f} s", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
