"""Benchmark of one drafting step on the static path (fixed K/V buffers, CUDA graphs), DFlash against DFlash2.

What evaluate pays per verify step to draft, at the shapes the DFlash / DFlash2 comparison uses
(docs/dflash2/README.md: config/gpu-proof.yaml's drafter, 4 layers, block size 16, three taps of SmolLM2-135M;
DFlash2 adds the convolutions and the candidate selector at the official sizes, rank 256, top-16):
- ``dflash``: the DFlash step replayed as a CUDA graph, then the argmax of its logits;
- ``dflash2 eager selector``: the DFlash2 step replayed as a CUDA graph, then the candidate selector's greedy path run
  eagerly (``CandidateSelector.select``: ~6 short kernels per block slot);
- ``dflash2 graphed selector``: the step and the selector's greedy path in one graph (``StaticDrafter.greedy_path``,
  what evaluate drafts with since 2026-12-02).
Each step feeds 3 newly committed context rows, as a decoding step at τ ≈ 3 does, and ends with a synchronisation
(as decoding's does: verification needs the drafts). Baselines measured in the same run: the DFlash step, and the
target's 16-token verify forward on a ``StaticTarget`` (CUDA graph) that each drafting step accompanies.

    python bench/bench_draft_step.py                               # on a GPU: SmolLM2-135M's shape, bf16
    python bench/bench_draft_step.py --preset llama-8b --steps 100 # a larger target: the drafter's share falls
    python bench/bench_draft_step.py --preset tiny --steps 5       # CPU smoke test (eager, float32)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_evaluate import PRESETS, build_target

from draftsmith.drafter_config import build_drafter_config
from draftsmith.evaluate.static import StaticDrafter, StaticTarget
from draftsmith.modeling import DFlashDraftModel
from draftsmith.modeling_dflash2 import DFlash2DraftModel


def per_call_ms(fn, steps: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` followed by a device synchronisation, in ms (3 warm-up calls first)."""
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--drafter-layers", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layer-ids", default="1,14,27", help="target layer ids (gpu-proof's three taps)")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant (median)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    graphs = device.type == "cuda"
    B, layer_ids = args.block_size, [int(i) for i in args.layer_ids.split(",")]
    target = build_target(args.preset, None, device, dtype)
    layer_ids = [i for i in layer_ids if i < target.config.num_hidden_layers] or [0]
    embed, head = target.get_input_embeddings().weight.detach(), target.lm_head
    length = args.prompt_tokens + 8 * B
    prompt = torch.randint(5, target.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0)).to(device)

    static_target = StaticTarget(target, length, layer_ids=layer_ids, cuda_graphs=graphs, verify_width=B)
    _, features = static_target.prefill(prompt)
    block = prompt[:, -B:].clone()
    start = args.prompt_tokens

    def verify_forward():  # one verify forward, all of it kept (hybrid targets: no rollback counted here)
        static_target.forward_block(block, start, B)
        static_target.commit(B)

    rows = {"target verify forward": per_call_ms(verify_forward, args.steps, device)}

    drafters = {}
    for arch, cls in (("dflash", DFlashDraftModel), ("dflash2", DFlash2DraftModel)):
        cfg = build_drafter_config(target.config, num_layers=args.drafter_layers, block_size=B,
                                   target_layer_ids=layer_ids, mask_token_id=1, architecture=arch)
        torch.manual_seed(0)
        drafters[arch] = cls(cfg).to(device=device, dtype=dtype).eval()
    context = features[:, -3:]  # 3 committed rows, as after a step at τ ≈ 3 (positions pos - 3 .. pos - 1)
    anchor = prompt[0, -1:]  # the block's anchor at position pos (any token: timing only)
    pos = args.prompt_tokens

    sd = StaticDrafter(drafters["dflash"], embed, head, length, cuda_graphs=graphs)
    sd.step(features, anchor, pos, B)  # the prompt's context, as decoding's first step
    rows["dflash"] = per_call_ms(lambda: torch.argmax(sd.logits(context, anchor, pos, B), dim=-1), args.steps,
                                 device)

    s2 = StaticDrafter(drafters["dflash2"], embed, head, length, cuda_graphs=graphs)
    s2.step(features, anchor, pos, B)
    selector = drafters["dflash2"].candidate_selector

    def eager_selector():
        hidden, logits = s2.step(context, anchor, pos, B)
        with torch.inference_mode():
            return selector.select(hidden, logits[None], anchor, 0.0)[0]

    rows["dflash2 eager selector"] = per_call_ms(eager_selector, args.steps, device)
    rows["dflash2 graphed selector"] = per_call_ms(lambda: s2.greedy_path(context, anchor, pos, B), args.steps,
                                                   device)
    same = torch.equal(eager_selector(), s2.greedy_path(context, anchor, pos, B).clone())
    failures = {**sd.graph_failures, **s2.graph_failures}

    name = torch.cuda.get_device_name(device) if graphs else "cpu"
    print(f"target {args.preset} ({target.config.num_hidden_layers} layers), {name} {dtype}, drafter "
          f"{args.drafter_layers} layers, block {B}, taps {layer_ids}; median of {args.steps} steps each")
    verify, base = rows["target verify forward"], rows["dflash"]
    for label, ms in rows.items():
        print(f"{label:28s} {ms:7.3f} ms   x{ms / base:5.2f} of the DFlash step   "
              f"x{ms / verify:5.2f} of a verify forward")
    print(f"graphed path == eager path: {same}; CUDA graph failures: {failures or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "preset": args.preset, "steps": args.steps, "ms": rows,
                       "same_path": same, "graph_failures": {str(k): v for k, v in failures.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
