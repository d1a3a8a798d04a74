"""Benchmark of extract_shard on a random-weight Qwen3.5-27B-shaped target, against the naive approach.

Builds the target on one GPU (hidden 5120, 64 layers, Gated DeltaNet in 3 of every 4 layers, vocab 248,320,
24 heads / 4 KV heads of 256, MLP 17408, GDN 16 key / 48 value heads of 128, conv kernel 4; bf16, random
weights, 26.9B parameters), then, on the same length-sorted right-padded batches (token budget), measures
in one run:

* ``naive`` / ``naive2`` (first and last, to expose drift): ``model(input_ids, attention_mask,
  output_hidden_states=True, use_cache=False)``, the tapped layers gathered and unpadded, greedy target
  tokens from its logits, both copied to the host (no disk);
* ``tt``: the real ``draftsmith.extract.extract_shard`` end to end with the default config (tokenized
  parquet and plan read, hooks, target tokens through the chunked LM-head argmax, sanity checks, chunk
  files written to local disk atomically with fsync and sha256, progress records, manifest), which on
  CUDA fuses the target's elementwise work (``extract.fuse: auto``, draftsmith/fused.py: compiled norms
  and MLPs, flash-linear-attention's causal conv1d);
* ``tt-eager``: the same with ``extract.fuse: false`` (transformers' own forward);
* ``feat`` / ``feat-eager``: the same without target tokens (the forward stops after the deepest tapped layer);
* ``tt-nomask``: ``extract.padding_mask: false``; ``fp8``: ``extract.storage_dtype: float8_e4m3fn``.

Before timing, the kernels are compiled/autotuned once per batch size (flash-linear-attention autotunes
per batch size) and, unless ``--no-full-warmup``, each path makes one untimed pass over all batches, so
the allocators (device memory, pinned host buffers) are warm: the figures are the steady state of a
long shard job, whose one-time costs (model load, ~5 s of pinned buffers) are not counted.

It prints, per variant, end-to-end and compute-only tokens/s (real tokens), model TFLOP/s as a fraction
of the bf16 matmul peak measured in the same run (an 8192^3 bf16 matmul), bytes per token, and the ratio
to the naive runs. Model FLOPs = 2 x parameters used (decoder layers run, plus the LM head with target
tokens) x real tokens + causal full attention 2 * l^2 * heads * head_dim per sample of l tokens; the Gated
DeltaNet recurrence (~0.5 % at this shape) and padding are not counted, so the fraction is conservative.

Lengths: ``--lengths`` (a JSON ``{"num_tokens": [...]}`` or a tokenized parquet), scaled to a mean of
``--mean-length`` and cut at ``--max-length``. Default: results/tokenized/train.parquet when present, else
bench/data/sharegpt-lengths.json (committed; ShareGPT, 4000 conversations of resources/bench-tokenize tokenized
by draftsmith.tokenize with the SmolLM2 tokenizer, max_length 32768: mean 1426 tokens), else a fixed
log-normal.

Usage::

    python bench/bench_extract.py                     # one GPU (needs flash-linear-attention for the GDN layers)
    python bench/bench_extract.py --tiny              # a tiny target on the CPU, to debug the script
    python bench/bench_extract.py --tokens 262144 --token-budget 32768 --variants naive,tt,feat,naive2 --profile 3

Measured on one H200 (2026-11-29, torch 2.11, transformers 5.17, fla 0.6) with
``--tokens 196608 --token-budget 32768 --variants naive,tt,tt-eager,feat --profile 1`` (lengths from
bench/data/sharegpt-lengths.json: 60 samples, 197,398 real tokens, 12.1% padding; bf16 matmul peak
783 TFLOP/s):

=========  ========  ==========  =============  ========
variant    tok/s     % of peak   compute tok/s  vs naive
=========  ========  ==========  =============  ========
naive      5,714     38.0%       5,714          1.00x
tt         8,533     **56.8%**   9,030 (60.1%)  **1.49x**
tt-eager   6,809     45.3%       7,148 (47.5%)  1.19x
feat       9,117     55.9%       9,708 (59.5%)  1.60x
=========  ========  ==========  =============  ========

51,209 bytes per token (5 taps x 5120 x bf16 + target token). Fusion costs ~30 s of compilation at the start
of a job (the fused warm-up pass took 52.8 s vs ~23 s of steady state). GPU time of one 6 x 5,422-token
decoder forward: eager 3,927 ms (GEMMs 51.3%, norms / activations / copies 29.7% of which the depthwise
conv1d fallback 202 ms, SDPA 9.8%, GDN 9.2%); fused 3,095 ms (GEMMs 69.7%, SDPA 12.8%, elementwise
11.4%: mostly transformers' repeat_interleave / layout copies, 123 ms; GDN 6.2%, fla's conv1d 28 ms).

Accuracy: ``tt-eager`` equals ``naive`` exactly; ``tt`` differs from it by bf16 rounding (different
kernels), which a 64-layer *random-weight* target amplifies (max abs diff 18 of max |x| 157 on batch 0,
greedy tokens agree 77%: random logits are near-ties). Against a float32 reference the fused bf16
forward is as accurate as eager bf16 (tests/test_fused.py on the H200, 8-layer hybrid target: relative RMS
error of the last hidden state 2.91e-2 fused vs 2.98e-2 eager; greedy tokens equal to float32's 92.5% vs
92.3%).

Before fusion (same day, log-normal lengths, 262K tokens): naive 5,545 tok/s, eager ``tt`` 6,884 (1.25x, 45.8%).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith import extract as ex
from draftsmith.features import read_chunk
from draftsmith.fused import fused_target
from draftsmith.io import write_json
from draftsmith.target import decoder_layers, fla_available, text_config

REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.extract")

QWEN35_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=False)
TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
            max_position_embeddings=32768, tie_word_embeddings=False)


def qwen35_config(dims: dict):
    """The Qwen3.5 text config of ``dims`` (3 linear-attention layers then 1 full-attention layer)."""
    from transformers import Qwen3_5TextConfig

    n = dims["num_hidden_layers"]
    return Qwen3_5TextConfig(**dims, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                          for i in range(n)])


def build_target(dims: dict, device: str, dtype: torch.dtype):
    """A random-weight Qwen3.5 text target of :func:`qwen35_config`."""
    from transformers import AutoModelForCausalLM

    cfg = qwen35_config(dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), cfg


def matmul_peak(device: str, dtype: torch.dtype, n: int = 8192, iters: int = 10) -> float:
    """Measured FLOP/s of an n^3 matmul (mean of ``iters`` after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sample_lengths(args, rng: np.random.Generator) -> list[int]:
    """Lengths whose sum reaches ``args.tokens``, from the real distribution (scaled) or a log-normal."""
    pool = None
    src = args.lengths
    if src and os.path.exists(src):
        if src.endswith(".parquet"):
            pool = pq.read_table(src, columns=["num_tokens"]).column(0).to_numpy()
        else:
            with open(src) as fh:
                pool = np.asarray(json.load(fh)["num_tokens"])
        pool = pool.astype(np.float64) * args.mean_length / pool.mean()
        origin = f"{src} scaled x{args.mean_length / np.mean(pool) * pool.mean() / pool.mean():.2f}"
    else:
        pool = rng.lognormal(mean=np.log(args.mean_length) - 0.32, sigma=0.8, size=20000)
        origin = "log-normal(sigma 0.8)"
    out, total = [], 0
    while total < args.tokens:
        n = int(min(max(round(rng.choice(pool)), 8), args.max_length))
        out.append(n)
        total += n
    log.info("lengths: %d samples, %d tokens, mean %.0f, p50 %.0f, p95 %.0f, max %d (%s)", len(out), total,
             np.mean(out), np.percentile(out, 50), np.percentile(out, 95), max(out), origin)
    return out


def write_inputs(work: Path, lengths: list[int], vocab: int, layer_ids: list[int], cfg, rng) -> list[np.ndarray]:
    """tokenized parquet + plan.json + a target folder holding the config (the model is passed in memory)."""
    from safetensors.torch import save_file

    ids = [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]
    table = pa.table({"id": [f"bench{r:05d}" for r in range(len(lengths))], "source": ["bench"] * len(lengths),
                      "input_ids": pa.array(ids, pa.list_(pa.int32())),
                      "loss_mask": pa.array([np.ones(n, np.int8) for n in lengths], pa.list_(pa.int8())),
                      "num_tokens": pa.array(lengths, pa.int32())})
    table = table.replace_schema_metadata({b"draftsmith.tokenizer_fingerprint": b'"bench"',
                                           b"draftsmith.chat_template_kwargs": b"{}",
                                           b"draftsmith.max_length": str(max(lengths)).encode()})
    pq.write_table(table, work / "train.parquet")
    cfg.save_pretrained(work / "target")
    save_file({"placeholder": torch.zeros(1)}, str(work / "target" / "model.safetensors"))
    plan = ex.build_plan(work / "train.parquet", work / "target",
                         ex.ExtractPlanSettings.from_config({"drafter": {"target_layer_ids": layer_ids}}))
    write_json(work / "plan.json", plan)
    return ids


def model_flops(model, cfg, lengths: list[int], deepest: int, lm_head: bool) -> float:
    """2 x params used x tokens + causal full-attention FLOPs (see the module docstring)."""
    tc = text_config(cfg)
    layers = decoder_layers(model)
    last = len(layers) - 1 if lm_head else deepest
    params = sum(p.numel() for layer in layers[:last + 1] for p in layer.parameters())
    if lm_head:
        params += model.get_output_embeddings().weight.numel()
    tokens = sum(lengths)
    full = sum(1 for i in range(last + 1) if tc.layer_types[i] == "full_attention")
    attn = full * sum(2.0 * n * n * tc.num_attention_heads * tc.head_dim for n in lengths)
    return 2.0 * params * tokens + attn


@torch.inference_mode()
def run_naive(model, batches, ids, layer_ids, device, keep_first: bool = False):
    """The naive approach on the given batches; returns (seconds, features and tokens of batch 0)."""
    first = None
    sync(device)
    t0 = time.perf_counter()
    for k, b in enumerate(batches):
        seq = max(b.lengths)
        x = torch.zeros(len(b.rows), seq, dtype=torch.long)
        for j, r in enumerate(b.rows):
            x[j, :b.lengths[j]] = torch.from_numpy(ids[r].astype(np.int64))
        mask = None
        if len(b.rows) > 1:
            mask = (torch.arange(seq)[None] < torch.tensor(b.lengths)[:, None]).long().to(device)
        out = model(input_ids=x.to(device), attention_mask=mask, output_hidden_states=True, use_cache=False)
        idx = torch.from_numpy(np.concatenate([j * seq + np.arange(n) for j, n in enumerate(b.lengths)])).to(device)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
        feats = feats.reshape(len(b.rows) * seq, -1).index_select(0, idx).cpu()
        tt = out.logits.reshape(len(b.rows) * seq, -1).index_select(0, idx).argmax(-1).int().cpu()
        if keep_first and k == 0:
            first = (feats, tt)
        del out, feats, tt
    sync(device)
    return time.perf_counter() - t0, first


def warm_up(model, batches, vocab: int, device: str) -> None:
    """Compile/autotune the kernels once per batch size (flash-linear-attention autotunes per batch size)."""
    dec = model.get_decoder()
    with torch.inference_mode():
        for bsz in sorted({len(b.rows) for b in batches}):
            x = torch.randint(3, vocab, (bsz, 96), device=device)
            mask = torch.ones_like(x)
            mask[-1, 80:] = 0
            dec(input_ids=x, attention_mask=mask if bsz > 1 else None, use_cache=False)
            if bsz > 1:
                dec(input_ids=x, attention_mask=None, use_cache=False)
    sync(device)


KERNEL_CLASSES = (  # first match wins; lower-case substrings of CUDA kernel names
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")),
    ("attention (full layers)", ("flash", "fmha", "attention", "sdpa")),
    ("gated deltanet (fla triton)", ("chunk", "recurrent", "delta", "l2norm", "solve", "fwd_kernel", "bwd_kernel",
                                     "conv")),
    ("norms / activations / elementwise", ("norm", "elementwise", "vectorized", "silu", "sigmoid", "softplus",
                                           "reduce", "cat", "copy", "index", "fill", "exp", "mul", "add")),
)


@torch.inference_mode()
def profile_kernels(model, batch, ids, repeats: int) -> dict:
    """GPU time of ``repeats`` decoder forwards on one padded batch, grouped by kernel class.

    Returns ``{"total_ms", "classes": {class: ms}, "top": [(kernel, ms, calls)]}``; printed as a table.
    """
    from torch.profiler import ProfilerActivity, profile

    seq = max(batch.lengths)
    x = torch.zeros(len(batch.rows), seq, dtype=torch.long)
    for j, r in enumerate(batch.rows):
        x[j, :batch.lengths[j]] = torch.from_numpy(ids[r].astype(np.int64))
    x = x.cuda()
    mask = ((torch.arange(seq)[None] < torch.tensor(batch.lengths)[:, None]).long().cuda() if len(batch.rows) > 1
            else None)
    dec = model.get_decoder()
    dec(input_ids=x, attention_mask=mask, use_cache=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            dec(input_ids=x, attention_mask=mask, use_cache=False)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.key and not e.key.startswith(("ProfilerStep", "cuda")):
            rows.append((e.key, t / 1e3 / repeats, e.count // repeats))
    rows.sort(key=lambda r: -r[1])
    classes: dict[str, float] = {}
    for name, ms, _ in rows:
        low = name.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")
        classes[cls] = classes.get(cls, 0.0) + ms
    total = sum(classes.values())
    print(f"\n=== GPU time of one decoder forward ({len(batch.rows)} x {seq} tokens, "
          f"{sum(batch.lengths)} real): {total:.1f} ms ===")
    for c, ms in sorted(classes.items(), key=lambda kv: -kv[1]):
        print(f"  {c:<36} {ms:8.1f} ms  {100 * ms / total:5.1f} %")
    print("  top kernels:")
    for name, ms, n in rows[:25]:
        print(f"    {ms:8.2f} ms  x{n:<4d} {name[:110]}")
    return {"total_ms": total, "classes": classes, "top": rows[:40]}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny target on the CPU (debug the script)")
    p.add_argument("--tokens", type=int, default=None, help="real tokens per variant")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--chunk-tokens", type=int, default=32768)
    p.add_argument("--lengths", default=None, help="JSON {num_tokens: [...]} or a tokenized parquet")
    p.add_argument("--mean-length", type=float, default=3072)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--layer-ids", default=None, help="comma-separated (default 1,16,31,46,61)")
    p.add_argument("--variants", default="naive,tt,tt-eager,feat,feat-eager,naive2")
    p.add_argument("--workdir", default="/tmp/draftsmith-bench-extract")
    p.add_argument("--no-full-warmup", dest="full_warmup", action="store_false",
                   help="skip the untimed pass of each path over all batches")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="also profile K decoder forwards (the first batch) and print GPU time per kernel class")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dims = TINY if args.tiny else QWEN35_27B
    args.tokens = args.tokens or (3000 if args.tiny else 98304)
    args.token_budget = args.token_budget or (1024 if args.tiny else 16384)
    args.max_length = args.max_length or (2048 if args.tiny else 16384)
    if args.tiny:
        args.mean_length = min(args.mean_length, 300)
        args.chunk_tokens = min(args.chunk_tokens, 1000)
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids else
                 ([1, 2, 4, 5, 6] if args.tiny else [1, 16, 31, 46, 61]))
    if args.lengths is None:
        for cand in (REPO / "results/tokenized/train.parquet", REPO / "bench/data/sharegpt-lengths.json"):
            if cand.exists():
                args.lengths = str(cand)
                break
    variants = args.variants.split(",")
    rng = np.random.default_rng(0)
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "fla": fla_available(), "token_budget": args.token_budget,
                     "chunk_tokens": args.chunk_tokens, "layer_ids": layer_ids}
    import transformers
    results["transformers"] = transformers.__version__

    peak = matmul_peak(device, dtype, 8192 if device == "cuda" else 512, 10 if device == "cuda" else 3)
    results["matmul_peak_tflops"] = peak / 1e12
    log.info("measured %s matmul peak: %.1f TFLOP/s", dtype, peak / 1e12)

    t0 = time.perf_counter()
    model, cfg = build_target(dims, device, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    results["params"] = nparams
    log.info("built a random %s target: %.2fB parameters, %.1f GiB, in %.0f s (fla %s)", cfg.model_type,
             nparams / 1e9, nparams * torch.tensor([], dtype=dtype).element_size() / 2 ** 30,
             time.perf_counter() - t0, fla_available())

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lengths = sample_lengths(args, rng)
    ids = write_inputs(work, lengths, dims["vocab_size"], layer_ids, cfg, rng)
    rows = list(range(len(lengths)))
    batches = ex.make_batches(rows, lengths, args.token_budget)
    real = sum(lengths)
    padded = sum(b.padded_tokens for b in batches)
    results.update(samples=len(lengths), real_tokens=real, padded_tokens=padded, batches=len(batches))
    log.info("%d batches, %d real / %d padded tokens (%.1f %% padding)", len(batches), real, padded,
             100 * (1 - real / padded))
    t0 = time.perf_counter()
    warm_up(model, batches, dims["vocab_size"], device)
    log.info("kernel warm-up (compile, autotune per batch size) %.1f s", time.perf_counter() - t0)

    flops_tt = model_flops(model, cfg, lengths, max(layer_ids), lm_head=True)
    flops_feat = model_flops(model, cfg, lengths, max(layer_ids), lm_head=False)
    base_cfg = {"token_budget": args.token_budget, "chunk_tokens": args.chunk_tokens,
                "storage_dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
                "store_target_tokens": True, "padding_mask": True, "disk_headroom": 1.05}
    configs = {"tt": {}, "tt-eager": {"fuse": False}, "feat": {"store_target_tokens": False},
               "feat-eager": {"store_target_tokens": False, "fuse": False},
               "tt-nomask": {"padding_mask": False}, "fp8": {"storage_dtype": "float8_e4m3fn"}}
    if args.full_warmup:
        # one untimed pass of each path over all batches: the caching allocators (device memory for the
        # naive path's ~75 GiB peak, pinned host buffers for ours) and every kernel shape are warm, so
        # the timed runs measure the steady state of a long shard job
        t0 = time.perf_counter()
        run_naive(model, batches, ids, layer_ids, device)
        log.info("full warm-up pass, naive: %.1f s", time.perf_counter() - t0)
        for name in dict.fromkeys(("tt" if v.endswith("-eager") else v) for v in variants
                                  if not v.startswith("naive")):
            # fused paths compile here (torch.compile of the norm / MLP classes, once per process); an
            # -eager variant needs no pass of its own: its kernels ran in the naive pass, its pinned host
            # buffers are the ones the fused pass allocated
            settings = ex.ExtractShardSettings.from_config({"extract": {**base_cfg, **configs[name]}})
            t0 = time.perf_counter()
            ex.extract_shard(plan_path=work / "plan.json", tokenized_path=work / "train.parquet",
                             target_dir=work / "target", manifest_path=work / "warmup" / "shard-0" / "manifest.json",
                             shard=0, model=model, settings=settings)
            shutil.rmtree(work / "warmup")
            results.setdefault("warmup_s", {})[name] = time.perf_counter() - t0
            log.info("full warm-up pass, %s (includes compilation when fused): %.1f s", name,
                     time.perf_counter() - t0)
    naive_first = None
    rows_out = []
    for v in variants:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if v.startswith("naive"):
            dt, first = run_naive(model, batches, ids, layer_ids, device, keep_first=naive_first is None)
            naive_first = naive_first or first
            flops, nbytes, stats = flops_tt, None, {"compute_s": dt}
        else:
            out = work / v / "shard-0" / "manifest.json"
            settings = ex.ExtractShardSettings.from_config({"extract": {**base_cfg, **configs[v]}})
            sync(device)
            t0 = time.perf_counter()
            stats = {}
            man = ex.extract_shard(plan_path=work / "plan.json", tokenized_path=work / "train.parquet",
                                   target_dir=work / "target", manifest_path=out, shard=0, model=model,
                                   settings=settings, run_stats=stats)
            sync(device)
            dt = time.perf_counter() - t0
            flops = flops_tt if man["has_target_token"] else flops_feat
            nbytes = man["bytes"]
            if naive_first is not None and v in ("tt", "tt-eager", "tt-nomask", "fp8"):
                chunk = read_chunk(out.parent / man["chunks"][0]["file"])
                n0 = naive_first[0].shape[0]
                got = chunk["features"][:n0]
                ref = naive_first[0].float()
                diff = (got - ref).abs().max().item()
                same_tt = (chunk["target_token"][:n0] == naive_first[1]).float().mean().item()
                results[f"{v}_vs_naive_first_batch"] = {"max_abs_diff": diff, "ref_max_abs": ref.abs().max().item(),
                                                        "target_token_agreement": same_tt}
                log.info("%s vs naive on batch 0 (%d tokens): max abs diff %.3g (max |x| %.3g), target tokens "
                         "agree %.4f", v, n0, diff, ref.abs().max().item(), same_tt)
            shutil.rmtree(work / v)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else float("nan")
        row = {"variant": v, "seconds": dt, "tokens_per_s": real / dt, "model_tflops": flops / dt / 1e12,
               "fraction_of_peak": flops / dt / peak, "bytes_per_token": nbytes / real if nbytes else None,
               "compute_s": stats["compute_s"], "compute_tokens_per_s": real / stats["compute_s"],
               "compute_fraction_of_peak": flops / stats["compute_s"] / peak,
               "write_s": stats.get("write_s"), "wait_s": stats.get("wait_s"),
               "host_alloc_s": stats.get("host_alloc_s"), "peak_gpu_gib": mem}
        rows_out.append(row)
        if args.json:  # after every variant, so a run cut short still leaves its figures
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**results, "variants": rows_out}, indent=2))
        log.info("%-10s %7.1f s  %8.0f tok/s  %6.1f TFLOP/s  %5.1f %% of peak  %s  (compute %.1f s; writer "
                 "%s s, waited %s s, pinned alloc %s s)  peak mem %.1f GiB", v, dt, row["tokens_per_s"],
                 row["model_tflops"], 100 * row["fraction_of_peak"],
                 f"{row['bytes_per_token']:.0f} B/token" if nbytes else "(no disk)", row["compute_s"],
                 _fmt(row["write_s"]), _fmt(row["wait_s"]), _fmt(row["host_alloc_s"]), mem)
    if args.profile and device == "cuda":
        big = max(batches, key=lambda b: b.padded_tokens)
        print("\n--- eager (extract.fuse: false)")
        results["profile_eager"] = profile_kernels(model, big, ids, args.profile)
        with fused_target(model) as report:
            print(f"\n--- fused (extract.fuse: auto on CUDA): {report}")
            results["profile_fused"] = profile_kernels(model, big, ids, args.profile)
    naive = [r["tokens_per_s"] for r in rows_out if r["variant"].startswith("naive")]
    base = float(np.mean(naive)) if naive else None
    print("\n=== extract benchmark: %s, %s, fla=%s, %.2fB params, %d samples / %d real tokens (%.1f %% padding), "
          "budget %d, chunk %d tokens, layer ids %s; bf16 matmul peak %.0f TFLOP/s ===" % (
              results["device"], f"torch {torch.__version__} transformers {transformers.__version__}",
              fla_available(), nparams / 1e9, len(lengths), real, 100 * (1 - real / padded), args.token_budget,
              args.chunk_tokens, layer_ids, peak / 1e12))
    print("end to end = the whole extract_shard call (chunks written, fsync'd, hashed; manifest); compute = its "
          "forwards, checks and copies only. Ratios: tokens/s over the mean of the naive runs [their range].")
    print(f"{'variant':<10} {'s':>6} {'tok/s':>7} {'%peak':>6} {'compute tok/s':>13} {'%peak':>6} {'B/token':>8} "
          f"{'vs naive':>9} {'[range]':>13}")
    for r in rows_out:
        r["vs_naive"] = r["tokens_per_s"] / base if base else None
        rng_txt = (f"[{r['tokens_per_s'] / max(naive):.2f}-{r['tokens_per_s'] / min(naive):.2f}]" if base else "")
        print(f"{r['variant']:<10} {r['seconds']:6.1f} {r['tokens_per_s']:7.0f} {100 * r['fraction_of_peak']:5.1f}% "
              f"{r['compute_tokens_per_s']:13.0f} {100 * r['compute_fraction_of_peak']:5.1f}% "
              f"{r['bytes_per_token'] or 0:8.0f} {(r['vs_naive'] or 0):8.2f}x {rng_txt:>13}")
    results["variants"] = rows_out
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
