"""Benchmark of the evaluate stage's decoding loop: speedup as a function of the acceptance length τ,
and the cost of rolling back Gated DeltaNet state exactly.

Target: a random Hugging Face model of a given shape (``--preset``), bf16 on CUDA, fp32 on CPU.
Drafter: a real draftsmith ``DFlashDraftModel`` (``--drafter-layers``; its forward, K/V cache and logits run every
step) whose drafts are then replaced by the target's own greedy continuation, with draft slot ``k`` always wrong, so
every verify step accepts exactly ``k - 1`` drafts: τ = k exactly (k = B: every draft right, τ = B).
This isolates the loop's cost from drafter quality: the speedup printed for a given τ is what a drafter
reaching that τ gets from this implementation on this machine.

Baseline, measured in the same run on the same prompt: target-only greedy decoding
(``draftsmith.evaluate.target_generate``). Printed per τ: tokens/s, speedup = baseline time / time,
and whether the output equals the baseline token for token. For hybrid targets each τ runs with
``rollback=mixer`` (re-run the accepted tokens through the GDN mixers only) and ``rollback=forward``
(through the whole target); ``τ = B`` never rolls back, so it shows the loop without that cost.

Paths (``--paths``), each measured in the same run against the same dynamic-cache target-only baseline:
``dynamic`` (``DynamicCache``, exact rollback, eager forwards: any target), ``static`` (a ``StaticTarget``: static
KV cache, each forward width captured once as a CUDA graph and replayed, hybrid targets rolled back by state
snapshot and mixer replay; the drafter on its dynamic cache) and ``static-drafter`` (the same, and the drafter on
a ``StaticDrafter``: fixed K/V buffers, one CUDA graph per step width), so the ratio of the two target-only rows is
the speed of the fast path itself.

    python bench/bench_evaluate.py                          # tiny hybrid target on CPU (seconds)
    python bench/bench_evaluate.py --preset qwen3.5-27b --layers 16 --new-tokens 128     # on a GPU
    python bench/bench_evaluate.py --target resources/targets/smollm2-135m-instruct --paths dynamic,static \
        --prompt-tokens 192 --new-tokens 256                 # the gpu-proof target, on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draftsmith.drafter_config import build_drafter_config
from draftsmith.evaluate import DFlashProposer, speculative_generate, target_generate
from draftsmith.modeling import DFlashDraftModel

PRESETS = {
    # tests/tiny.py-sized hybrid
    "tiny": dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4),
    # Qwen3.5-27B text shape (layer_types: 3 x linear_attention, 1 x full_attention, repeated)
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=48),
    # SmolLM2-135M shape (attention only; --target loads the real weights)
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
    # Llama-3.1-8B shape (attention only)
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}


def build_target(preset: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(PRESETS[preset])
    model_type = kw.pop("model_type")
    if layers:
        kw["num_hidden_layers"] = layers
    if model_type.startswith("qwen3_5"):
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                             for i in range(kw["num_hidden_layers"])]
    config = AutoConfig.for_model(model_type, max_position_embeddings=8192, initializer_range=0.1,
                                  tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class ForcedProposer(DFlashProposer):
    """The real drafter's step (its forward, K/V cache and LM-head logits are paid, on whichever path), then the
    drafts replaced by ``reference`` (the target's own continuation) with slot ``wrong`` corrupted."""

    reference: torch.Tensor
    wrong: int | None = None

    def propose(self, tokens, start, num_drafts, sampling, generator):
        drafts, probs = super().propose(tokens, start, num_drafts, sampling, generator)
        idx = torch.arange(start + 1, start + 1 + drafts.shape[0], device=drafts.device)
        ref = self.reference[idx.clamp(max=self.reference.shape[0] - 1)].clone()
        if self.wrong is not None and self.wrong <= ref.shape[0]:
            ref[self.wrong - 1] = (ref[self.wrong - 1] + 1) % self.embed_weight.shape[0]
        return ref, probs


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override the number of target layers")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--taus", default="1,2,4,8,16", help="τ values to force (<= block size)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto = bfloat16 on CUDA, float32 on CPU; float32 on CUDA runs with TF32 off, so that "
                         "differently shaped forwards agree and the forced τ holds on a random-weight target")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--target", default=None, help="a local HF target folder instead of a random preset")
    ap.add_argument("--paths", default="dynamic", help="dynamic and/or static (static cache + CUDA graphs)")
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one DFlash generation per path (top operators by CPU and CUDA time)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cpu":
        torch.set_num_threads(1)
    if args.target:
        from draftsmith.target import load_target

        target = load_target(args.target, dtype=str(dtype).replace("torch.", ""), device=device)
        args.preset = args.target
    else:
        target = build_target(args.preset, args.layers, device, dtype)
    L = target.config.num_hidden_layers
    hybrid = "linear_attention" in (getattr(target.config, "layer_types", None) or [])
    B = args.block_size
    cfg = build_drafter_config(target.config, num_layers=args.drafter_layers, block_size=B,
                               target_layer_ids=sorted({1, L // 2, L - 2}) if L >= 4 else [0], mask_token_id=0)
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlashDraftModel(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, target.config.vocab_size, (1, args.prompt_tokens), generator=g).to(device)
    params = sum(p.numel() for p in target.parameters())
    print(f"target {args.preset} ({L} layers, {params / 1e9:.2f} B params, {'hybrid GDN' if hybrid else 'attention'}"
          f"), {device} {dtype}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new, block {B}")

    target_generate(target, prompt, max_new_tokens=args.new_tokens)  # warm-up
    base_s, base = timed(lambda: target_generate(target, prompt, max_new_tokens=args.new_tokens), args.repeats)
    base_tps = len(base.tokens) / base_s
    print(f"baseline target-only (dynamic cache): {base_tps:.1f} tok/s ({base_s * 1e3 / len(base.tokens):.2f} "
          "ms/token)")
    reference = torch.cat([prompt[0], torch.tensor(base.tokens, device=device)])

    def forced(wrong, static=None):
        proposer = ForcedProposer(drafter, target)
        proposer.reference, proposer.wrong = reference, wrong
        if static is not None and path == "static-drafter" and not proposer.use_static(static.max_length,
                                                                                        static.cuda_graphs):
            raise SystemExit("this drafter cannot draft on static buffers")
        return proposer

    rows = []
    hybrid_modes = ["mixer", "forward"] if hybrid else ["auto"]
    for path in args.paths.split(","):
        static = None
        if path not in ("dynamic", "static", "static-drafter"):
            raise SystemExit(f"unknown path {path!r}: dynamic, static or static-drafter")
        if path != "dynamic":
            from draftsmith.evaluate.static import StaticTarget

            static = StaticTarget(target, args.prompt_tokens + args.new_tokens + B + 1,
                                  layer_ids=drafter.target_layer_ids, cuda_graphs=device.type == "cuda",
                                  verify_width=B)
            target_generate(target, prompt, max_new_tokens=args.new_tokens, static=static)  # warm-up + capture
            s, out = timed(lambda: target_generate(target, prompt, max_new_tokens=args.new_tokens, static=static),
                           args.repeats)
            # the drafts are forced to what verification computes: target-only decoding at the verify width (in
            # bf16, 1-token forwards round differently and part from it at a near-tie, and τ falls to ~1)
            verify_ref = target_generate(target, prompt, max_new_tokens=args.new_tokens, static=static, width=None)
            reference = torch.cat([prompt[0], torch.tensor(verify_ref.tokens, device=device)])
            row = {"path": path, "tau_forced": 1, "method": "target-only", "tokens_per_s": len(out.tokens) / s,
                   "speedup": base_s / s, "lossless": out.tokens == base.tokens}
            rows.append(row)
            print(f"[{path}] target-only {row['tokens_per_s']:8.1f} tok/s  speedup {row['speedup']:5.2f}x  "
                  f"lossless {row['lossless']}")
        for tau in [int(t) for t in args.taus.split(",") if int(t) <= B]:
            for mode in (hybrid_modes if static is None else ["static"]):
                proposer = forced(tau if tau < B else None, static)
                speculative_generate(target, proposer, prompt, max_new_tokens=args.new_tokens, rollback=mode
                                     if static is None else "auto", static=static)  # warm-up
                s, out = timed(lambda: speculative_generate(
                    target, proposer, prompt, max_new_tokens=args.new_tokens,
                    rollback=mode if static is None else "auto", static=static), args.repeats)
                row = {"path": path, "tau_forced": tau, "tau_measured": out.tau,
                       "rollback": mode if tau < B else "none needed", "tokens_per_s": len(out.tokens) / s,
                       "speedup": base_s / s, "lossless": out.tokens == base.tokens,
                       "first_difference": next((i for i, (a, b) in enumerate(zip(out.tokens, base.tokens))
                                                 if a != b), None)}
                rows.append(row)
                print(f"[{path}] τ {tau:>2} (measured {out.tau:5.2f}) rollback {row['rollback']:<11} "
                      f"{row['tokens_per_s']:8.1f} tok/s  speedup {row['speedup']:5.2f}x  lossless {row['lossless']}"
                      + ("" if row["lossless"] else f" (first difference at token {row['first_difference']})"),
                      flush=True)
                if tau == B:
                    break
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            proposer = forced(2, static)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                out = speculative_generate(target, proposer, prompt, max_new_tokens=args.new_tokens, static=static)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            step_ms = wall * 1e3 / len(out.committed)
            print(f"[{path}] profiled DFlash generation: {len(out.committed)} steps, {step_ms:.2f}"
                  f" ms per step (profiler on)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
            if device.type == "cuda":
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60))
        if static is not None and static.graph_failures:
            print(f"[{path}] CUDA graph capture failed: {static.graph_failures}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "device": str(device), "baseline_tokens_per_s": base_tps,
                       "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
