"""Benchmark of one drafting step on the static path (fixed K/V buffers, CUDA graphs): DFlash, DFlash2 and the target's
own MTP head, against the target's verify forward.

What evaluate pays per verify step to draft, at the shapes the DFlash / DFlash2 comparison uses
(docs/dflash2/README.md: config/gpu-proof.yaml's drafter, 4 layers, block size 16, three taps of SmolLM2-135M;
DFlash2 adds the convolutions and the candidate selector at the official sizes, rank 256, top-16), or at the 27B
hybrid shape (``--preset qwen3.5-27b``: Qwen3.5-27B's text shape, random weights, gpu-node's 5-layer drafter tapping
[1, 16, 31, 46, 61]; docs/mtp/README.md):
- ``dflash``: the DFlash step replayed as a CUDA graph, then the argmax of its logits;
- ``dflash2 eager selector``: the DFlash2 step replayed as a CUDA graph, then the candidate selector's greedy path run
  eagerly (``CandidateSelector.select``: ~6 short kernels per block slot);
- ``dflash2 graphed selector``: the step and the selector's greedy path in one graph (``StaticDrafter.greedy_path``,
  what evaluate drafts with since 2026-12-02).
- ``mtp k=<k>``: the target's MTP head (one full-attention layer of the target's own class, random weights, the
  checkpoint's shapes) drafting k tokens: the committed rows (padded to k + 1) and k - 1 recursive steps, each with
  the LM head's argmax, one CUDA graph (``MTPDrafter``, what evaluate drafts with); ``mtp k=<k> eager`` without it.
Each step feeds 3 newly committed context rows (the MTP head: min(3, k + 1)), as a decoding step at τ ≈ 3 does, and
ends with a synchronisation (as decoding's does: verification needs the drafts). Baselines measured in the same run:
the DFlash step, and the target's verify forwards on a ``StaticTarget`` (CUDA graphs) that each drafting step
accompanies: B tokens (what evaluate verifies every proposer's block with, so all share one lossless reference) and
k + 1 tokens (what an engine verifies k MTP drafts with). A hybrid target's forwards include the state snapshot
and the recording of the Gated DeltaNet inputs, not the rollback (all tokens kept).

From these figures it prints what decides the architecture (a verify step costs the verify forward plus the drafting
step; tokens/s = τ / that): the tokens/s DFlash2 reaches against DFlash at ``--dflash2-tau-gain`` (1.18x: measured on
SmolLM2-135M at equal data, docs/dflash2/README.md), and the τ each drafter needs, as a multiple of the MTP head's τ
at k, to decode as fast as the head does at k.

    python bench/bench_draft_step.py                               # on a GPU: SmolLM2-135M's shape, bf16
    python bench/bench_draft_step.py --preset llama-8b --steps 100 # a larger target: the drafter's share falls
    python bench/bench_draft_step.py --preset qwen3.5-27b --drafter-layers 5 --layer-ids 1,16,31,46,61 --steps 50
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
from draftsmith.evaluate.mtp import MTPDrafter, MTPHead
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
    ap.add_argument("--mtp-tokens", default="1,2,3", help="the MTP head's drafts per step to time ('' = none)")
    ap.add_argument("--dflash2-tau-gain", type=float, default=1.18,
                    help="DFlash2's τ over DFlash's at equal data (docs/dflash2/README.md: 1.18x over all prompts)")
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

    mtp_tokens = [int(k) for k in args.mtp_tokens.split(",") if k.strip()]
    last = target.config.num_hidden_layers - 1
    taps = layer_ids + ([last] if mtp_tokens and last not in layer_ids else [])
    static_target = StaticTarget(target, length, layer_ids=taps, cuda_graphs=graphs, verify_width=B)
    _, features = static_target.prefill(prompt)
    width = target.config.hidden_size
    hidden_last = features[..., taps.index(last) * width:(taps.index(last) + 1) * width] if mtp_tokens else None
    features = features[..., :len(layer_ids) * width]  # DFlash's taps come first
    start = args.prompt_tokens

    def verify_forward(width: int):  # one verify forward, all of it kept (hybrid targets: no rollback counted here)
        block = prompt[:, -width:].clone()

        def run():
            static_target.forward_block(block, start, width)
            static_target.commit(width)
        return run

    rows = {"target verify forward": per_call_ms(verify_forward(B), args.steps, device)}
    for k in mtp_tokens:
        if k + 1 != B:
            rows[f"target verify forward, {k + 1} tokens"] = per_call_ms(verify_forward(k + 1), args.steps, device)

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

    if mtp_tokens:  # the target's MTP head in the checkpoint's shapes, random weights (PyTorch's default init)
        torch.manual_seed(0)
        with torch.device(device):
            head = MTPHead(target, 1).to(dtype).eval()
        graphed, eager = MTPDrafter(head, target, cuda_graphs=graphs), MTPDrafter(head, target, cuda_graphs=False)
        graphed.cache.ensure(length + 2 * B)
        eager.cache.ensure(length + 2 * B)
        prompt_tokens = torch.cat([prompt[0, 1:], prompt[0, -1:]])  # the prompt's rows: each paired with the next
        for drafter in (graphed, eager):
            drafter.draft(hidden_last, prompt_tokens, 0, 1)  # the prompt's K/V, as decoding's first step
        for k in mtp_tokens:
            n = min(3, k + 1)  # rows committed since the last step
            rows_h, rows_t = hidden_last[:, -n:], prompt[0, -n:]
            rows[f"mtp k={k}"] = per_call_ms(lambda: graphed.draft(rows_h, rows_t, pos - n, k), args.steps, device)
            rows[f"mtp k={k} eager"] = per_call_ms(lambda: eager.draft(rows_h, rows_t, pos - n, k), args.steps,
                                                    device)
            same = same and torch.equal(graphed.draft(rows_h, rows_t, pos - n, k).clone(),
                                        eager.draft(rows_h, rows_t, pos - n, k))
        failures.update({f"mtp k={k}": v for k, v in graphed.graph_failures.items()})

    name = torch.cuda.get_device_name(device) if graphs else "cpu"
    print(f"target {args.preset} ({target.config.num_hidden_layers} layers), {name} {dtype}, drafter "
          f"{args.drafter_layers} layers, block {B}, taps {layer_ids}; median of {args.steps} steps each")
    verify, base = rows["target verify forward"], rows["dflash"]
    for label, ms in rows.items():
        print(f"{label:36s} {ms:8.3f} ms   x{ms / base:6.2f} of the DFlash step   "
              f"x{ms / verify:5.2f} of a {B}-token verify forward")
    print(f"graphed path == eager path: {same}; CUDA graph failures: {failures or 'none'}")
    decision = decision_figures(rows, B, mtp_tokens, args.dflash2_tau_gain)
    for line in decision["lines"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "preset": args.preset, "steps": args.steps, "block_size": B,
                       "drafter_layers": args.drafter_layers, "layer_ids": layer_ids, "ms": rows,
                       "decision": {k: v for k, v in decision.items() if k != "lines"}, "same_path": same,
                       "graph_failures": {str(k): v for k, v in failures.items()}}, f, indent=1)


def decision_figures(rows: dict[str, float], block: int, mtp_tokens: list[int], dflash2_tau_gain: float) -> dict:
    """What the step costs decide, from :func:`main`'s timings ``rows`` (ms): a verify step costs the verify forward
    plus the drafting step, and tokens/s = τ / that cost (batch 1, no other overhead).

    Returns:
        ``{"step_ms": {method: verify + draft ms}, "dflash2_over_dflash_tokens_per_s": DFlash2's tokens/s over
        DFlash's at ``dflash2_tau_gain`` x DFlash's τ (graphed selector), "tau_to_match_mtp": {drafter: {k: the τ
        that drafter needs, as a multiple of the MTP head's τ at k, to decode as fast}}, "lines": printable}``.
        The MTP head's step uses the B-token verify forward (what evaluate runs) and, as ``mtp k=<k> (engine
        verify)``, the k + 1-token one (what an engine runs).
    """
    verify = rows["target verify forward"]
    step = {"dflash": verify + rows["dflash"], "dflash2": verify + rows["dflash2 graphed selector"]}
    for k in mtp_tokens:
        step[f"mtp k={k}"] = verify + rows[f"mtp k={k}"]
        step[f"mtp k={k} (engine verify)"] = rows.get(f"target verify forward, {k + 1} tokens", verify) + rows[
            f"mtp k={k}"]
    gain = dflash2_tau_gain * step["dflash"] / step["dflash2"]
    need = {d: {k: step[d] / step[f"mtp k={k} (engine verify)"] for k in mtp_tokens} for d in ("dflash", "dflash2")}
    lines = ["a verify step (verify forward + drafting step): " + ", ".join(f"{m} {ms:.2f} ms"
                                                                            for m, ms in step.items()),
             f"DFlash2 at {dflash2_tau_gain:.2f}x DFlash's τ decodes {gain:.3f}x DFlash's tokens/s "
             f"({'DFlash2' if gain > 1 else 'DFlash'} is faster at this shape)"]
    for d, by_k in need.items():
        if by_k:
            lines.append(f"{d} matches the MTP head's tokens/s (engine verify) at τ = "
                         + ", ".join(f"{x:.2f}x MTP's τ at k={k}" for k, x in by_k.items()))
    return {"step_ms": step, "dflash2_over_dflash_tokens_per_s": gain, "tau_to_match_mtp": need, "lines": lines}


if __name__ == "__main__":
    main()
