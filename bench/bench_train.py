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
    python bench/bench_train.py --ddp 2 --shape qwen3.5-27b --config config/gpu-node.yaml --out $OUT   # 2 x H200
    python bench/bench_train.py --tiny --ddp 2 --out /tmp/ddpbench   # the same on the CPU (gloo), tiny shape
    python bench/bench_train.py --ddp 1 --ddp-overhead --shape qwen3.5-27b --config config/gpu-node.yaml  # 1 GPU
    python bench/bench_train.py --ddp 1 --storage bfloat16,float8_e4m3fn --shape qwen3.5-27b \
        --config config/gpu-node.yaml

``--ddp N``: DDP scaling of the real trainer. Writes a target folder (the shape's config.json, e.g. Qwen3.5-27B's
hybrid one; model.safetensors with only the random bf16 embedding and LM head) and ``--ddp-tokens`` tokens of
random bf16 features in the trainer's format (safetensors chunks of ~256 MB + index.json; 51,200 bytes per token
at qwen3.5-27b, 180,000 tokens = 9.2 GB by default) whose documents have the ShareGPT lengths, cut at the
config's ``tokenize.max_length`` (prompt 30% unsupervised, answer supervised); then runs ``python -m
torch.distributed.run --standalone --nproc-per-node N -m draftsmith.train`` and the same with 1 process, with the
config's train / drafter sections (sizes, compile, loader) and the shape's drafter, ``--ddp-steps`` steps, no
held-out evaluation, no checkpoint before the last step. Prints (and writes to ``<out>/ddp.json``, trainer output
to ``<out>/ddp-train-N.log``) per process count: context tokens/s of all ranks over the last ``--ddp-log-every``
steps (after the compile warm-up), per GPU, model TFLOP/s per GPU and MFU against the bf16 matmul peak measured
first, peak memory per rank; and the scaling ratio tokens/s(N) / tokens/s(1). Time on 2 H200s (an estimate):
~25 s for the matmul peak, the 5 GB target folder and the features; then per run ~15-30 s of start-up (torchrun,
imports, 5 GB of embedding / LM head, the 1.7 B-parameter drafter initialised on the CPU), 30-90 s of compile
warm-up (the second run finds the first one's inductor cache), 30 steps of ~1 s, 20-50 s for the trainer's final
checkpoint (fp32 weights + AdamW moments, 21 GB, hashed and fsynced; on /dev/shm when it has room) and trained/:
about 4.5-5.5 minutes in all.

``--ddp-overhead`` (with ``--ddp 1``): DDP's own cost on one GPU. Three one-process runs on the same features:
the trainer as one process runs it (no DDP), then wrapped in DDP over a one-process NCCL group (gradients kept in
DDP's buckets between steps, its hooks, compiled layers as the product compiles them under DDP: one graph each),
then the same with dynamo's DDPOptimizer splitting each compiled layer at DDP's bucket boundaries (torch's default,
the trainer's behaviour before it turned that off). Peak memory and tokens/s per run; a world of one GPU pays
DDP's memory and its bucketing, not the all-reduce over NVLink.

Figures measured on an H200: docs/gpu-proof/README.md (with the exact commands).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config

from draftsmith.drafter_config import build_drafter_config, default_loss_gamma
from draftsmith.modeling import DFlashDraftModel, block_targets, dflash_mask_mod, dflash_visible_intervals
from draftsmith.train import pack_documents

try:  # the FLOPs formula lives in draftsmith.flops (draftsmith.modeling before)
    from draftsmith.flops import training_flops
except ImportError:
    from draftsmith.modeling import training_flops

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


def merged_sections(config: str | None, architecture: str | None = None) -> dict:
    """The train / drafter / tokenize sections of a config file merged over config.yaml's over the schema's
    defaults (as the workflow sees them: ``--configfile`` keys replace config.yaml's, validation fills the rest, the
    keys whose default is the drafter architecture's taking the config's architecture's: a DFlash config's train
    section, which the throughput bench's DFlash2 trainers reuse, keeps hard labels, as its random features have no
    top-k). ``architecture`` (``dflash2``): the train and extract keys a config of that architecture would get
    instead (the drafter section itself stays the config's)."""
    from draftsmith.config import fill_architecture_defaults, schema_defaults

    base = yaml.safe_load((REPO / "config.yaml").read_text())
    over = (yaml.safe_load(Path(config).read_text()) if config else None) or {}
    sections = {k: {**schema_defaults(k), **(base.get(k) or {}), **(over.get(k) or {})}
                for k in ("train", "drafter", "tokenize", "extract")}
    fill_architecture_defaults(sections, architecture)
    return sections


def load_sizes(config: str | None, tiny: bool) -> dict:
    """train / drafter sizes of a config file merged over config.yaml (as ``--configfile`` does)."""
    sections = merged_sections(config)
    train, drafter = sections["train"], sections["drafter"]
    sizes = {"tokens_per_batch": train.get("tokens_per_batch", 8192), "num_anchors": train.get("num_anchors", 512),
             "max_anchors_per_row": train.get("max_anchors_per_row"),
             "activation_checkpointing": bool(train.get("activation_checkpointing", False)),
             "compile": bool(train.get("compile", False)), "block": drafter.get("block_size", 16),
             "layers": drafter.get("num_layers")}
    if tiny:
        sizes.update(tokens_per_batch=512, num_anchors=32, max_anchors_per_row=48, block=8)
    return sizes


def drafter_config(shape: dict, sizes: dict):
    """The drafter's config at the shape (its target's sizes) and the config's sizes (``block``, ``layers``)."""
    target_cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                             intermediate_size=shape["intermediate"], num_hidden_layers=shape["target_layers"],
                             num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                             head_dim=shape["head_dim"], max_position_embeddings=262144)
    n = shape["layers"] if shape["sliding"] else (sizes["layers"] or shape["layers"])
    return build_drafter_config(target_cfg, num_layers=n, block_size=sizes["block"],
                                target_layer_ids=shape["layer_ids"], mask_token_id=shape["vocab"] - 1,
                                layer_types=(["sliding_attention"] * (n - 1) + ["full_attention"])
                                if shape["sliding"] else None,
                                sliding_window=shape["window"] if shape["sliding"] else None)


def build_model(shape: dict, sizes: dict, device: torch.device, seed: int = 0):
    """Drafter (fp32 master weights) and frozen bf16 embedding / LM head of the shape."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(drafter_config(shape, sizes)).to(device).train()
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

    from draftsmith.features import index_document, write_chunk, write_index

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
        digest = write_chunk(fdir / name, features=feats, lengths=lens, sample_index=range(c * 8, c * 8 + 8),
                             input_ids=ids, loss_mask=torch.cat(masks), target_token=torch.roll(ids, -1),
                             storage_dtype="bfloat16")
        chunks.append({"path": name, "shard": 0, "sha256": digest, "num_samples": 8, "num_tokens": offs[-1],
                       "rows": list(range(c * 8, c * 8 + 8))})
    write_index(fdir / "index.json", index_document({
        "num_samples": 24, "num_tokens": sum(c["num_tokens"] for c in chunks),
        "layer_ids": ids_, "hidden_size": H, "num_target_layers": L, "storage_dtype": "bfloat16",
        "has_target_token": True, "target_fingerprint": "synthetic", "tokenizer_fingerprint": "synthetic",
        "chunks": chunks}))
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
    from draftsmith.train import TrainSettings, train

    index, tdir = write_synthetic(workdir)
    cfg = synthetic_cfg(steps, compile_layers)
    t = time.perf_counter()
    state = train(index, tdir, workdir / "out", TrainSettings.from_config(cfg))
    first = state["history"][0]["loss"] if state["history"] else None
    return {"wall_s": time.perf_counter() - t, "steps": state["steps"], "heldout_first": first,
            "heldout_final": state["heldout"], "last_train": state["last_train"],
            "checkpoints": sorted(p.name for p in (workdir / "out" / "checkpoints").iterdir()),
            "trained": sorted(p.name for p in (workdir / "out" / "trained").iterdir())}


# ---------------------------------------------------------------------------------------------------------------
# --ddp N: DDP scaling of the real trainer (python -m draftsmith.train under torchrun), N processes vs 1
# ---------------------------------------------------------------------------------------------------------------

DDP_CHUNK_BYTES = 256 << 20  # hidden_states bytes per feature chunk file


def target_config(shape_name: str, shape: dict):
    """The target's HF config at the shape (the drafter takes width, vocabulary, norm eps, activation, positions
    and RoPE from it): Qwen3.5-27B's hybrid text config for ``qwen3.5-27b`` (bench_extract.QWEN35_27B, the dims
    bench/make_random_target.py builds: 3 Gated DeltaNet : 1 full-attention layer), the same layout at the tiny
    sizes for ``tiny``, a Qwen3 config of the shape's sizes for ``smollm2-135m``."""
    if shape_name not in ("qwen3.5-27b", "tiny"):
        return Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                           intermediate_size=shape["intermediate"], num_hidden_layers=shape["target_layers"],
                           num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                           head_dim=shape["head_dim"], max_position_embeddings=262144)
    sys.path.insert(0, str(REPO / "bench"))
    from bench_extract import QWEN35_27B, TINY, qwen35_config

    dims = dict(QWEN35_27B) if shape_name == "qwen3.5-27b" else dict(
        TINY, vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["target_layers"])
    assert (dims["hidden_size"], dims["num_hidden_layers"], dims["vocab_size"]) == (
        shape["hidden"], shape["target_layers"], shape["vocab"]), (shape_name, dims)
    return qwen35_config(dims)


def ddp_document_lengths(sizes: dict, max_length: int, tiny: bool) -> list[int]:
    """ShareGPT document lengths (bench/data/sharegpt-lengths.json) as the pipeline would store them: cut at
    ``tokenize.max_length`` (its ``overflow: truncate``), at least 16 tokens; with ``tiny`` scaled by
    tokens_per_batch / 16384 first, so tiny rows still pack several documents."""
    scale = sizes["tokens_per_batch"] / 16384 if tiny else 1.0
    return [min(max(int(n * scale), 16), max_length) for n in document_lengths()]


def random_rows(n: int, width: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """``[n, width]`` bf16 CPU tensor of N(0, 1) values: drawn on the GPU when there is one (GBs of CPU randn are
    slow); on the CPU a random block of 256 rows repeated."""
    if device.type == "cuda":
        return torch.randn(n, width, device=device, dtype=torch.bfloat16, generator=gen).cpu()
    block = torch.randn(min(n, 256), width, generator=gen).to(torch.bfloat16)
    return block.repeat(-(-n // block.shape[0]), 1)[:n].contiguous()


def random_topk(target: torch.Tensor, vocab: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random soft labels of the shape extraction stores: ``target_topk_ids`` ``[T, k]`` int32, column 0 the target
    token (the argmax), the rest random ids, and ``target_topk_logprobs`` ``[T, k]`` float16, descending, holding
    0.97 of the mass (about what the top 32 of SmolLM2-135M hold). Only the shapes and dtypes matter to a step's
    cost (the fused loss compares each logit with the k ids whatever they are)."""
    T = target.numel()
    ids = torch.randint(0, vocab, (T, k), generator=gen, dtype=torch.int32)
    ids[:, 0] = target
    logits = torch.sort(torch.randn(T, k, generator=gen) * 2.0, dim=1, descending=True).values
    logprobs = torch.log_softmax(logits, dim=1) + math.log(0.97)
    return {"target_topk_ids": ids, "target_topk_logprobs": logprobs.to(torch.float16)}


def write_ddp_features(workdir: Path, shape_name: str, shape: dict, lengths: list[int], num_tokens: int, seed: int,
                       device: torch.device, storage: str = "bfloat16",
                       target_topk: int = 0) -> tuple[Path, Path, dict]:
    """The trainer's inputs at the real shape: a target folder and features in the format of draftsmith.features.

    * ``target/``: ``config.json`` (:func:`target_config`) and ``model.safetensors`` holding only
      ``model.embed_tokens.weight`` and ``lm_head.weight`` ``[V, H]`` bf16 ~ N(0, 0.02) (drawn on ``device``); no
      tokenizer (the drafter section sets ``mask_token_id``).
    * ``features/``: ``index.json`` (:func:`draftsmith.features.write_index`, as
      :class:`draftsmith.features.FeatureIndex` reads it) and ``shard-0/chunk-XXXXX.safetensors``
      (:func:`draftsmith.features.write_chunk`) of ~256 MB of features each: features ``[T, n_taps * H]`` random
      bf16 values stored as ``storage`` (``float8_e4m3fn``: quantised on ``device`` with one scale per token and
      tap, :func:`draftsmith.features.quantize_fp8`, ~128 MB per chunk), input ids ``[T]``, loss mask ``[T]``
      (the first 30% of each document 0 = prompt, the rest 1 = supervised answer), target tokens ``[T]`` (the
      input ids shifted by one within the document); with ``target_topk`` k > 0 also the soft labels of
      ``train.labels: target_topk`` (:func:`random_topk`), as extraction's ``extract.store_target_topk`` stores them.

    Documents take consecutive entries of ``lengths`` from a seeded start (cycled) until ``num_tokens`` tokens
    (the last document may overshoot). Chunks are written by 4 threads while the next ones are drawn.

    Returns:
        ``(index.json, target folder, summary)``: summary has documents, tokens, bytes, seconds.
    """
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file

    from draftsmith.features import LAYER_SEMANTICS, index_document, quantize_fp8, write_chunk, write_index

    t0 = time.perf_counter()
    H, V, taps = shape["hidden"], shape["vocab"], shape["layer_ids"]
    value_bytes = 1 if storage == "float8_e4m3fn" else 2  # (float8 adds a float32 scale per token and tap)
    width = len(taps) * H
    gen = torch.Generator(device=device).manual_seed(seed)
    tdir, fdir = workdir / "target", workdir / "features"
    (fdir / "shard-0").mkdir(parents=True, exist_ok=True)
    tdir.mkdir(parents=True, exist_ok=True)
    target_config(shape_name, shape).to_json_file(str(tdir / "config.json"))

    def matrix() -> torch.Tensor:
        if device.type == "cuda":
            return (torch.randn(V, H, device=device, dtype=torch.bfloat16, generator=gen) * 0.02).cpu()
        return (torch.randn(V, H, generator=gen) * 0.02).to(torch.bfloat16)

    save_file({"model.embed_tokens.weight": matrix(), "lm_head.weight": matrix()}, str(tdir / "model.safetensors"))
    t_target = time.perf_counter() - t0

    g = torch.Generator().manual_seed(seed)
    i = int(torch.randint(0, len(lengths), (1,), generator=g))
    docs: list[int] = []
    while sum(docs) < num_tokens:
        docs.append(lengths[i % len(lengths)])
        i += 1
    per_chunk = max(1, DDP_CHUNK_BYTES // (2 * width))  # tokens of hidden_states per chunk, about
    groups, cur = [], []
    for n in docs:
        cur.append(n)
        if sum(cur) >= per_chunk:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)

    chunks, pending, row = [], [], 0
    with ThreadPoolExecutor(max_workers=4) as pool:
        for c, lens in enumerate(groups):
            T = sum(lens)
            ids = torch.randint(0, V - 1, (T,), generator=g, dtype=torch.int32)
            mask = torch.ones(T, dtype=torch.int8)
            target = torch.empty_like(ids)
            offsets = [0]
            for n in lens:
                o = offsets[-1]
                mask[o:o + int(0.3 * n)] = 0
                target[o:o + n] = torch.roll(ids[o:o + n], -1)
                offsets.append(o + n)
            name = f"shard-0/chunk-{c:05d}.safetensors"
            topk = random_topk(target, V, target_topk, g) if target_topk else {}
            feats, scales = random_rows(T, width, device, gen), None
            if storage == "float8_e4m3fn":  # encoded where the values were drawn (on a GPU: fast)
                q, scales = quantize_fp8(feats.to(device), len(taps))
                feats, scales = q.cpu(), scales.cpu()
            pending.append((c, pool.submit(write_chunk, fdir / name, features=feats, scales=scales,
                                           lengths=lens, sample_index=range(row, row + len(lens)), input_ids=ids,
                                           loss_mask=mask, target_token=target, storage_dtype=storage, **topk)))
            chunks.append({"path": name, "shard": 0, "num_samples": len(lens), "num_tokens": T,
                           "rows": list(range(row, row + len(lens)))})
            row += len(lens)
            while len(pending) >= 8 or (pending and c == len(groups) - 1):  # bounds the chunks held in memory
                done, fut = pending.pop(0)
                chunks[done]["sha256"] = fut.result()
                chunks[done]["bytes"] = (fdir / chunks[done]["path"]).stat().st_size
    write_index(fdir / "index.json", index_document({
        "num_shards": 1, "num_samples": row, "num_tokens": sum(docs),
        "bytes": sum(c["bytes"] for c in chunks), "layer_ids": taps, "layer_semantics": LAYER_SEMANTICS,
        "hidden_size": H, "num_target_layers": shape["target_layers"], "storage_dtype": storage,
        "has_target_token": True, "target_fingerprint": f"bench-random-{shape_name}",
        "tokenizer_fingerprint": "bench-random", "chunks": chunks,
        **({"target_top_k": int(target_topk)} if target_topk else {})}))
    per_token = value_bytes * width + (4 * len(taps) if storage == "float8_e4m3fn" else 0) + 6 * target_topk
    summary = {"documents": row, "tokens": sum(docs), "mean_document_tokens": sum(docs) / row,
               "max_document_tokens": max(docs), "chunks": len(chunks), "storage_dtype": storage,
               "feature_bytes": per_token * sum(docs), "bytes_per_token": per_token, "target_s": t_target,
               "total_s": time.perf_counter() - t0}
    return fdir / "index.json", tdir, summary


def ddp_trainer_args(sections: dict, shape: dict, sizes: dict, steps: int, log_every: int) -> dict:
    """``--args`` of ``python -m draftsmith.train``: the config's train section (merged over config.yaml) with the
    sizes benchmarked, ``max_steps`` = ``steps``, ``log_every`` (the timing window: the trainer reports the rate
    of the last window, after the compile warm-up), no held-out samples (``eval_fraction`` 0: no evaluation, whose
    eval-mode forward would recompile the layers) and no checkpoint before the last step (the trainer always
    writes one at the end); the drafter section of :func:`build_model` (the shape's heads, MLP, layer types and
    taps, an explicit ``mask_token_id``: the target folder has no tokenizer)."""
    n = shape["layers"] if shape["sliding"] else (sizes["layers"] or shape["layers"])
    never = 10 * steps + 1000
    train = dict(sections["train"], max_steps=steps, log_every=log_every, eval_every=never, save_every=never,
                 eval_fraction=0.0, progress_interval=10, tokens_per_batch=sizes["tokens_per_batch"],
                 num_anchors=sizes["num_anchors"], max_anchors_per_row=sizes["max_anchors_per_row"],
                 activation_checkpointing=sizes["activation_checkpointing"], compile=sizes["compile"])
    drafter = dict(sections["drafter"], num_layers=n, block_size=sizes["block"], target_layer_ids=shape["layer_ids"],
                   num_target_features=len(shape["layer_ids"]), mask_token_id=shape["vocab"] - 1,
                   num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                   head_dim=shape["head_dim"], intermediate_size=shape["intermediate"],
                   layer_types=(["sliding_attention"] * (n - 1) + ["full_attention"]) if shape["sliding"] else None,
                   sliding_window=shape["window"] if shape["sliding"] else None)
    return {"train": train, "drafter": drafter}


def epoch_window(index_path: Path, train: dict, nproc: int, epochs: int) -> tuple[int, int]:
    """``(log_every, total steps)`` for a run of ``2 * epochs + 1`` epochs on ``nproc`` processes whose last log
    window is exactly its last ``epochs`` epochs (the first ``epochs + 1`` hold the compile warm-up).

    The trainer packs an epoch's rows independently of the process count (:class:`draftsmith.train.BatchPlan`:
    rows of epoch ``e`` depend on the seed and ``e`` only), so runs on 1 and N processes measured over the same
    epochs train on the same rows: their tokens/s compare the same work (a window of a few steps compared
    different rows: rows differ in documents and anchors)."""
    from draftsmith.features import FeatureIndex
    from draftsmith.train import BatchPlan, split_samples

    index = FeatureIndex(index_path)
    rows = [s.row for s in index.samples]
    train_ids, _ = split_samples(rows, float(train["eval_fraction"]), int(train["seed"]))
    plan = BatchPlan({s.row: s.num_tokens for s in index.samples}, [rows[i] for i in train_ids],
                     int(train["tokens_per_batch"]), seed=int(train["seed"]), world=nproc,
                     grad_accum=int(train["grad_accum"]), epochs=2 * epochs + 1)
    warm = sum(plan.steps_per_epoch[:epochs + 1])
    if plan.total_steps - warm > warm:
        raise ValueError(f"epochs of uneven length {plan.steps_per_epoch}: the last window would not be whole epochs")
    return warm, plan.total_steps


def bench_flops_per_token(index_path: Path, tdir: Path, cfg: dict, on_gpu: bool, rows: int = 2) -> dict:
    """Model FLOPs per context token by this script's formula (:func:`step_flops`) on ``rows`` packed rows of the
    written features, built as the trainer builds them (``make_batch``; on a GPU rows padded to a multiple of 128
    and power-of-two anchor buckets); the drafter is built on the meta device (no memory). A cross-check of the
    trainer's own ``model_tflops_per_gpu`` and the MFU fallback when the trainer does not report it."""
    from draftsmith.features import FeatureIndex
    from draftsmith.train import TrainSettings, build_model_config, make_batch, pack_rows

    settings = TrainSettings.from_config(cfg)
    train, drafter = settings.train, settings.drafter
    index = FeatureIndex(index_path)
    config = build_model_config(index, tdir, drafter, embedding_rows(tdir))
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    cap, block = int(train.tokens_per_batch), int(drafter.block_size)
    lengths = {s.row: s.num_tokens for s in index.samples}
    flops, ctx = 0.0, 0
    for r, row in enumerate(pack_rows(lengths, [s.row for s in index.samples], cap)[:rows]):
        batch = make_batch(index, row, num_anchors=train.num_anchors, seed=r, feature_dtype=torch.bfloat16,
                           pad_tokens_to=-(-cap // 128) * 128 if on_gpu else 1,
                           pad_anchors_to=max(1, 128 // block) if on_gpu else 1, bucket_anchors=on_gpu,
                           max_anchors_per_row=train.max_anchors_per_row)
        flops += step_flops(model, batch)
        ctx += int((batch.doc_ids >= 0).sum())
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"flops_per_ctx_token": flops / ctx, "rows": rows, "ctx_tokens_per_row": ctx / rows,
            "trainable_parameters": params}


def embedding_rows(tdir: Path) -> int:
    """Rows of the target folder's embedding (read from the safetensors header, not the tensor)."""
    from safetensors import safe_open

    with safe_open(str(tdir / "model.safetensors"), framework="pt") as fh:
        return int(fh.get_slice("model.embed_tokens.weight").get_shape()[0])


class GpuMemoryPoll:
    """The largest ``nvidia-smi`` memory.used (MiB) of each GPU while it runs, polled every ``interval`` s: a
    cross-check of the trainer's ``peak_memory_gib`` (it includes the CUDA contexts and the caching allocator's
    reserve, this process's context on GPU 0 too). Empty where nvidia-smi is absent."""

    def __init__(self, interval: float = 1.0):
        import shutil
        import threading

        self.peak: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = (threading.Thread(target=self._run, args=(interval,), daemon=True)
                       if shutil.which("nvidia-smi") else None)
        if self.thread:
            self.thread.start()

    def _run(self, interval: float) -> None:
        import subprocess

        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                for line in out.strip().splitlines():
                    gpu, used = (int(x) for x in line.split(","))
                    self.peak[gpu] = max(self.peak.get(gpu, 0), used)
            except Exception:  # a cross-check only
                return
            self.stop.wait(interval)

    def close(self) -> dict[int, int]:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=15)
        return dict(sorted(self.peak.items()))


def trainer_scratch(choice: str, workdir: Path, trainable_params: int | None) -> tuple[Path, bool]:
    """Where the trainer runs write their outputs: the trainer always ends with a checkpoint (fp32 weights and two
    AdamW moments, sha256-hashed and fsynced: 21 GB at qwen3.5-27b) and ``trained/`` (fp32 weights), ~16 bytes per
    trainable parameter, deleted after each run. ``auto``: a new folder in /dev/shm when it has room for 1.5
    times that (no disk flush: tens of seconds less per run at the 27B shape), else ``workdir``; else the folder
    given. Returns ``(folder, whether it is a new temporary folder)``."""
    import shutil

    if choice != "auto":
        return Path(choice), False
    shm = Path("/dev/shm")
    if (trainable_params and shm.is_dir() and os.access(shm, os.W_OK)
            and shutil.disk_usage(shm).free > 1.5 * 16 * trainable_params):
        return Path(tempfile.mkdtemp(prefix="bench-ddp-train-", dir=shm)), True
    return workdir, False


#: ``--ddp-overhead``'s runs: label -> the one-process DDP mode (None: the trainer's own one-process path)
OVERHEAD_RUNS = {"1": None, "1 ddp": "whole", "1 ddp split": "split"}


def ddp_one_process(mode: str, argv: list[str]) -> int:
    """Entry of ``--ddp-overhead``'s DDP runs (under torchrun, one process): a one-process group (NCCL on a GPU,
    gloo on the CPU), so that the trainer wraps its step in DDP; ``mode`` ``split`` leaves dynamo's DDPOptimizer on
    (each compiled layer cut at DDP's buckets), ``whole`` is the trainer's own choice. Runs
    ``python -m draftsmith.train`` with ``argv``; returns its exit status."""
    import torch.distributed as dist

    from draftsmith.train import distributed
    from draftsmith.train.__main__ import main

    if torch.cuda.is_available():
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    else:
        dist.init_process_group("gloo")
    if mode == "split":
        distributed.whole_layer_graphs_under_ddp = lambda: None
    try:
        return main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_trainer(nproc: int, index: Path, tdir: Path, out_dir: Path, cfg: dict, *, threads: int, log_path: Path,
                timeout: float, say, ddp_mode: str | None = None, label: str | None = None) -> dict:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc -m draftsmith.train`` (NCCL on CUDA,
    gloo on the CPU), its console output echoed (prefixed ``[label]``, default ``nproc``) and written to
    ``log_path``; killed (its process group) after ``timeout`` s. ``ddp_mode`` (one process only): the trainer in a
    one-process DDP group instead (:func:`ddp_one_process`). Returns returncode, wall_s, the trainer state (None
    on failure), the output tail and the nvidia-smi peaks."""
    import collections
    import signal
    import subprocess
    import threading

    label = label or str(nproc)
    entry = (["-m", "draftsmith.train"] if ddp_mode is None
             else [str(Path(__file__).resolve()), "--ddp-one-process", ddp_mode, "--"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry,
           "--index", str(index), "--target", str(tdir), "--out", str(out_dir),
           "--threads", str(threads), "--args", json.dumps(cfg)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    say(f"{label} process(es): " + " ".join(cmd[:len(cmd) - 2]) + " --args <json>")
    tail: collections.deque = collections.deque(maxlen=200)
    poll = GpuMemoryPoll()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)

    def pump() -> None:
        with open(log_path, "w", buffering=1) as log:
            for line in proc.stdout:
                log.write(line)
                tail.append(line)
                print(f"  [{label}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        say(f"{label} process(es): still running after {timeout:.0f} s; killing its process group {proc.pid}")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        rc = -9
    wall = time.perf_counter() - t
    reader.join(timeout=10)
    state_path = out_dir / "trained" / "trainer_state.json"
    state = json.loads(state_path.read_text()) if rc == 0 and state_path.is_file() else None
    return {"returncode": rc, "wall_s": wall, "state": state, "log_tail": "".join(tail)[-4000:],
            "nvidia_smi_peak_mib": poll.close()}


def median_step_rate(scratch: Path) -> float | None:
    """The median of the trainer's logged context tokens/s over the second half of its log points (TensorBoard's
    ``train/tokens_per_s``; with ``--ddp-log-every 1`` one point a step): a rate that a few slow steps (a recompile
    for a new anchor-bucket shape, a loader stall) do not decide, unlike one window's. None without events."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    folder = scratch / "tensorboard"
    if not folder.is_dir():
        return None
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    if "train/tokens_per_s" not in events.Tags().get("scalars", []):
        return None
    rates = [e.value for e in events.Scalars("train/tokens_per_s")]
    tail = sorted(rates[len(rates) // 2:])
    return tail[len(tail) // 2] if tail else None


def ddp_figures(run: dict, nproc: int, peak: float | None, flops_per_token: float | None) -> dict:
    """The figures of one trainer run from its trainer_state.json (fields read defensively: older trainers lack
    the window rate, the FLOPs rate and the peak memory)."""
    state = run["state"] or {}
    last = state.get("last_train") or {}
    rate = last.get("window_tokens_per_s")
    tflops = last.get("model_tflops_per_gpu")
    est = rate / nproc * flops_per_token / 1e12 if rate and flops_per_token else None
    loss = last.get("loss")
    fig = {"nproc": nproc, "returncode": run["returncode"], "wall_s": run["wall_s"],
           "trainer_wall_s": state.get("wall_s"), "steps": state.get("steps"), "world_size": state.get("world_size"),
           "rate_source": "window_tokens_per_s" if rate is not None else "tokens_per_s (whole run, incl. warm-up)",
           "ctx_tokens_per_s": rate if rate is not None else last.get("tokens_per_s"),
           "model_tflops_per_gpu": tflops, "tflops_per_gpu_bench_formula": est,
           "peak_memory_gib": state.get("peak_memory_gib"), "nvidia_smi_peak_mib": run["nvidia_smi_peak_mib"],
           "loss": loss, "loss_finite": loss is not None and math.isfinite(loss), "last_train": last}
    if fig["ctx_tokens_per_s"] is not None:
        fig["ctx_tokens_per_s_per_gpu"] = fig["ctx_tokens_per_s"] / nproc
    fig["mfu"] = tflops * 1e12 / peak if tflops is not None and peak else None
    fig["mfu_bench_formula"] = est * 1e12 / peak if est is not None and peak else None
    return fig


def run_ddp(args, say) -> int:
    """``--ddp N``: the real trainer at the shape, with the config's sizes, on N processes and then on 1, on the
    same features (:func:`write_ddp_features`); prints and writes ``<out>/ddp.json``: per process count steps,
    context tokens/s of all ranks over the last log window (after the compile warm-up), per GPU, model TFLOP/s per
    GPU and MFU (against the bf16 matmul peak measured here first), peak memory per rank; and the scaling ratio
    tokens/s(N) / tokens/s(1). Returns 0 when both runs finished with a finite loss."""
    import shutil

    import transformers

    out = Path(args.out)
    shape_name = "tiny" if args.tiny else args.shape
    shape, sizes = SHAPES[shape_name], load_sizes(args.config, args.tiny)
    sections = merged_sections(args.config)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    gpus = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and args.ddp > gpus:
        say(f"--ddp {args.ddp} needs {args.ddp} GPUs; this machine has {gpus}")
        return 2
    steps = args.ddp_steps
    tokens = args.ddp_tokens or (16_000 if args.tiny else 180_000)
    max_length = int(sizes["tokens_per_batch"] if args.tiny else sections["tokenize"].get("max_length", 32768))
    threads = os.cpu_count() or 1
    res: dict = {"info": {"device": f"{gpus} x {torch.cuda.get_device_name()}" if on_gpu else "cpu",
                          "torch": torch.__version__, "transformers": transformers.__version__, "shape": shape_name,
                          "config": args.config, "sizes": sizes, "nproc": args.ddp, "steps": steps,
                          "log_every": args.ddp_log_every, "threads": threads, "storage": args.storage},
           "runs": {}}

    def save() -> None:
        (out / "ddp.json").write_text(json.dumps(res, indent=1, default=str))

    say(json.dumps(res["info"]))
    if on_gpu:  # how the GPUs are linked decides the gradient all-reduce's cost
        import subprocess
        try:
            res["info"]["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                                     timeout=30).stdout
            say("nvidia-smi topo -m:\n" + res["info"]["topology"].rstrip())
        except (OSError, subprocess.SubprocessError) as exc:
            res["info"]["topology"] = f"n/a ({exc})"
    peak = None
    if on_gpu:
        peak = matmul_peak(device, 8192, 10)
        torch.cuda.empty_cache()
        say(f"matmul peak: {peak / 1e12:.1f} TFLOP/s (8192^3 bf16)")
    res["matmul_peak_flops"] = peak

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    scratch_root, scratch_tmp = workdir, False
    try:
        lengths = ddp_document_lengths(sizes, max_length, args.tiny)
        storages = args.storage.split(",")
        indexes = {}
        for storage in storages:  # the same documents and values (same seed) in each storage dtype
            say(f"writing the target folder and ~{tokens:,} tokens of features at the {shape_name} shape "
                f"({len(shape['layer_ids'])} x {shape['hidden']} {storage} per token) to {workdir / storage}")
            index, tdir, feats = write_ddp_features(workdir / storage, shape_name, shape, lengths, tokens, args.seed,
                                                    device, storage=storage)
            indexes[storage] = (index, tdir)
            res.setdefault("features", {})[storage] = dict(feats, max_length=max_length, workdir=str(workdir))
            if on_gpu:
                torch.cuda.empty_cache()
            say(f"features: {feats['documents']} documents, {feats['tokens']:,} tokens (mean "
                f"{feats['mean_document_tokens']:.0f}, max {feats['max_document_tokens']}, cut at "
                f"tokenize.max_length {max_length}), {feats['chunks']} chunks, {feats['feature_bytes'] / 1e9:.2f} GB "
                f"in {feats['total_s']:.1f} s (target folder {feats['target_s']:.1f} s)")
        index, tdir = indexes[storages[0]]
        cfg = ddp_trainer_args(sections, shape, sizes, steps, args.ddp_log_every)
        res["trainer_args"] = cfg
        try:
            est = bench_flops_per_token(index, tdir, cfg, on_gpu)
            say(f"bench formula: {est['flops_per_ctx_token']:.4g} FLOP per context token "
                f"({est['ctx_tokens_per_row']:.0f} context tokens per row; drafter "
                f"{est['trainable_parameters'] / 1e6:,.1f} M trainable parameters)")
        except Exception:  # a cross-check only
            est = {"error": traceback.format_exc()[-1500:]}
            say("bench FLOPs estimate failed: " + est["error"].strip().splitlines()[-1])
        res["bench_flops"] = est
        scratch_root, scratch_tmp = trainer_scratch(args.scratch, workdir, est.get("trainable_parameters"))
        res["info"]["trainer_outputs"] = str(scratch_root)
        save()
        ok = True
        # N processes, then 1 (once for --ddp 1); --ddp-overhead: 1 process without, with and with split DDP
        runs_to_do = OVERHEAD_RUNS if args.ddp_overhead else {str(n): None for n in dict.fromkeys((args.ddp, 1))}
        if len(storages) > 1:  # --storage a,b: one run of --ddp processes per storage dtype, on the same documents
            runs_to_do = {f"{args.ddp} {storage}": None for storage in storages}
        for label, ddp_mode in runs_to_do.items():
            n, tag = int(label.split()[0]), label.replace(" ", "-")
            if len(storages) > 1:
                index, tdir = indexes[label.split()[1]]
            scratch = scratch_root / f"train-{tag}"
            shutil.rmtree(scratch, ignore_errors=True)
            run_cfg = cfg
            if args.ddp_epochs:  # the same rows in both runs' windows: whole epochs
                log_every, total = epoch_window(index, cfg["train"], n, args.ddp_epochs)
                run_cfg = {**cfg, "train": {**cfg["train"], "max_steps": total, "log_every": log_every}}
                say(f"{n} process(es): {total} steps, rate over steps {log_every + 1}-{total} (the last "
                    f"{args.ddp_epochs} epoch(s))")
            run = run_trainer(n, index, tdir, scratch, run_cfg, threads=threads, log_path=out / f"ddp-train-{tag}.log",
                              timeout=args.ddp_timeout, say=say, ddp_mode=ddp_mode, label=label)
            fig = dict(ddp_figures(run, n, peak, est.get("flops_per_ctx_token")), label=label,
                       median_step_ctx_tokens_per_s=median_step_rate(scratch))
            res["runs"][label] = fig
            if run["state"] is not None:
                (out / f"ddp-trainer_state-{tag}.json").write_text(json.dumps(run["state"], indent=1))
            else:
                fig["log_tail"] = run["log_tail"]
            shutil.rmtree(scratch, ignore_errors=True)  # the final checkpoint: GBs at the 27B shape
            save()
            if run["state"] is None or not fig["loss_finite"]:
                ok = False
                say(f"{label} process(es) FAILED (exit {run['returncode']}, loss {fig['loss']}); output tail:\n"
                    + run["log_tail"][-3000:])
            else:
                say(f"{label} process(es): " + ddp_line(fig))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if scratch_tmp:
            shutil.rmtree(scratch_root, ignore_errors=True)
    runs = res["runs"]
    a, b = (runs.get(str(n), {}).get("ctx_tokens_per_s") for n in (args.ddp, 1))
    res["scaling"] = a / b if a and b and not args.ddp_overhead else None
    storages = args.storage.split(",")
    if len(storages) > 1:  # each storage against the first, same documents, same run of the script
        def rate(storage: str) -> float | None:  # the median step rate (robust to recompiles), else the window's
            fig = runs.get(f"{args.ddp} {storage}", {})
            return fig.get("median_step_ctx_tokens_per_s") or fig.get("ctx_tokens_per_s")

        base = rate(storages[0])
        res["storage_ratio"] = {s: (rate(s) or 0) / base if base else None for s in storages[1:]}
    save()
    say(f"summary: {shape_name}, {sizes['tokens_per_batch']} tokens per row, {sizes['num_anchors']} anchors per "
        f"document, max {sizes['max_anchors_per_row']} per row, block {sizes['block']}, compile {sizes['compile']}; "
        + (f"rate over the last {args.ddp_epochs} of {2 * args.ddp_epochs + 1} epochs per run" if args.ddp_epochs
           else f"{steps} steps per run, rate over the last {args.ddp_log_every}"))
    print("      procs steps  wall s   ctx tok/s  tok/s/GPU  TFLOP/s/GPU (bench)  MFU (bench)      loss  "
          "peak GiB per rank (nvidia-smi per GPU)")
    for fig in runs.values():
        print(ddp_line(fig, table=True))
    if args.ddp_overhead:
        base = runs.get("1", {})
        for label in list(OVERHEAD_RUNS)[1:]:
            fig = runs.get(label, {})
            rate = (fig.get("ctx_tokens_per_s") and base.get("ctx_tokens_per_s")
                    and fig["ctx_tokens_per_s"] / base["ctx_tokens_per_s"])
            mem = (fig.get("peak_memory_gib") and base.get("peak_memory_gib")
                   and fig["peak_memory_gib"][0] - base["peak_memory_gib"][0])
            res.setdefault("overhead", {})[label] = {"tokens_per_s_ratio": rate, "peak_memory_extra_gib": mem}
            print(f"{label!r} vs '1': " + (f"{rate:.3f}x tokens/s" if rate else "n/a") + ", "
                  + (f"{mem:+.1f} GiB peak" if mem is not None else "n/a"))
        save()
        print("matmul peak " + (f"{peak / 1e12:.1f} TFLOP/s" if peak else "n/a (CPU)")
              + f"; figures in {out / 'ddp.json'}", flush=True)
        return 0 if ok else 1
    for storage, r in (res.get("storage_ratio") or {}).items():
        print(f"{storage} vs {storages[0]} features: " + (f"{r:.3f}x" if r else "n/a") + " context tokens/s (median "
              "of the per-log-point rates over each run's second half; --ddp-log-every 1 for one a step; the "
              "data-scale issue asks >= 0.97x)", flush=True)
    if len(storages) > 1:
        return 0 if ok else 1
    ratio = f"{res['scaling']:.3f}x" if res["scaling"] else "n/a"
    print(f"scaling {args.ddp} vs 1 process(es): {ratio} tokens/s (issue 18: >= 1.8x at >= 40% MFU); matmul peak "
          + (f"{peak / 1e12:.1f} TFLOP/s" if peak else "n/a (CPU)") + f"; figures in {out / 'ddp.json'}", flush=True)
    return 0 if ok else 1


def ddp_line(fig: dict, table: bool = False) -> str:
    """One run's figures on one line (``table``: the columns of the summary table)."""
    def num(x, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    mem = fig["peak_memory_gib"]
    mem = "n/a" if not mem else "/".join(f"{m:.1f}" for m in mem)
    smi = "/".join(f"{v / 1024:.1f}" for v in fig["nvidia_smi_peak_mib"].values()) or "n/a"
    if table:
        tflops = f"{num(fig['model_tflops_per_gpu'], '.4g')} ({num(fig['tflops_per_gpu_bench_formula'], '.4g')})"
        mfu = f"{num(fig['mfu'], '.1%')} ({num(fig['mfu_bench_formula'], '.1%')})"
        return (f"{fig.get('label', fig['nproc']):>11} {num(fig['steps'], '5d'):>5s} {fig['wall_s']:7.1f} "
                f"{num(fig['ctx_tokens_per_s'], ',.0f'):>11s} {num(fig.get('ctx_tokens_per_s_per_gpu'), ',.0f'):>10s}  "
                f"{tflops:>19s}  {mfu:>15s} {num(fig['loss'], '.4f'):>9s}  {mem} ({smi})")
    return (f"{num(fig['steps'], 'd')} steps in {fig['wall_s']:.0f} s; {num(fig['ctx_tokens_per_s'], ',.0f')} ctx "
            f"tok/s ({fig['rate_source']}), {num(fig.get('ctx_tokens_per_s_per_gpu'), ',.0f')} per GPU; "
            f"{num(fig['model_tflops_per_gpu'], '.4g')} TFLOP/s per GPU (bench formula "
            f"{num(fig['tflops_per_gpu_bench_formula'], '.4g')}), MFU {num(fig['mfu'], '.1%')} (bench formula "
            f"{num(fig['mfu_bench_formula'], '.1%')}); loss {num(fig['loss'], '.4f')}; peak {mem} GiB per rank "
            f"(nvidia-smi {smi} GiB per GPU)")


def main() -> int:
    if sys.argv[1:2] == ["--ddp-one-process"]:  # torchrun's entry for --ddp-overhead's DDP runs
        mode, sep, *rest = sys.argv[2:]
        if sep != "--" or mode not in ("whole", "split"):
            raise SystemExit("usage: bench_train.py --ddp-one-process {whole,split} -- TRAINER ARGS")
        return ddp_one_process(mode, rest)
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
                    help="--e2e-only: train with train.compile (torch.compile of the drafter layers)")
    ap.add_argument("--e2e-only", action="store_true", help="only run draftsmith.train.train on synthetic features")
    ap.add_argument("--ddp", type=int, default=0, metavar="N",
                    help="only measure DDP scaling: python -m draftsmith.train under torchrun with N processes, "
                         "then 1, at the shape and the config's sizes on ShareGPT-length random features")
    ap.add_argument("--ddp-overhead", action="store_true",
                    help="with --ddp 1: one process without DDP, in a one-process DDP group, and the same with "
                         "dynamo's DDPOptimizer splitting the compiled layers (DDP's own memory and speed cost)")
    ap.add_argument("--ddp-epochs", type=int, default=1,
                    help="--ddp: rate over this many whole epochs after as many + 1 warm-up epochs, the same rows "
                         "for every process count (0: use --ddp-steps / --ddp-log-every instead)")
    ap.add_argument("--ddp-steps", type=int, default=30, help="--ddp: optimizer steps per trainer run")
    ap.add_argument("--ddp-log-every", type=int, default=5,
                    help="--ddp: train.log_every; tokens/s are those of the last window of this many steps")
    ap.add_argument("--ddp-tokens", type=int, default=None,
                    help="--ddp: feature tokens written (default 180,000: 9.2 GB at qwen3.5-27b; 16,000 with --tiny)")
    ap.add_argument("--ddp-timeout", type=float, default=300, help="--ddp: seconds before a trainer run is killed")
    ap.add_argument("--workdir", default=None,
                    help="--ddp: folder for the target folder, features and trainer outputs (kept); default a "
                         "temporary folder, deleted at the end")
    ap.add_argument("--scratch", default="auto",
                    help="--ddp: folder for the trainer outputs (deleted after each run); auto = /dev/shm when it "
                         "has room, else the workdir")
    ap.add_argument("--seed", type=int, default=0, help="--ddp: seed of the documents and feature values")
    ap.add_argument("--storage", default="bfloat16",
                    help="--ddp: the features' storage dtype, bfloat16 or float8_e4m3fn (the trainer copies fp8 "
                         "values and scales to the GPU and decodes them there); a comma list (bfloat16,float8_e4m3fn) "
                         "runs --ddp processes once per dtype on the same documents and prints each against the "
                         "first")
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

    if args.ddp_overhead and args.ddp != 1:
        ap.error("--ddp-overhead goes with --ddp 1 (three one-process runs)")
    if args.ddp:
        return run_ddp(args, say)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.e2e_only:
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
        except Exception:  # keep the figures measured so far
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
        model.fused_loss = True  # as the trainer's train.compile: the LM-head loss's chunks compiled too
        # (the layers and the loss stay compiled for the variants after this one)
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
