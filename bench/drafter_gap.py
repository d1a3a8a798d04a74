"""Where does training's held-out τ go at decode time? One diagnosis on the rows training held out.

On the first gpu-proof run, training's held-out rows gave a teacher-forced block τ of 5.21 (slot-1 accuracy 0.72)
while real speculative decoding of held-out prompts gave τ 2.18 (first draft accepted 53% of the time). This
script measures, on the *same* rows training held out (``split_samples`` with the train section's
``eval_fraction`` / ``seed``), each step between the two numbers, so the gap can be pinned on one of them:

1. ``features``: the stored features against the target's features recomputed now over the same tokens (cosine,
   relative error) and the stored ``target_token`` against the recomputed argmax (extraction is what training saw).
2. ``flex vs sdpa``: the drafter's teacher-forced metrics on each row with the GPU training path (compiled
   flex_attention ``BlockMask``) and with the dense SDPA mask (the CPU path). Equal masks give equal metrics; a
   higher flex accuracy means the training path lets blocks see what decoding cannot.
3. ``data vs greedy``: the regenerated answer in the row against the target's greedy decoding of the same prompt
   now (matching prefix, share of equal tokens): the drafter learns the data; decoding meets the target's greedy
   output.
4. ``decoded``: DFlash and prompt-lookup speculative decoding of the row's prompt (τ, first-draft acceptance), next
   to the teacher-forced block τ of the same rows -- the gap itself, on identical prompts.

Run after the DAG, from the repository root (paths are the workflow's)::

    python bench/drafter_gap.py --config config/gpu-proof.yaml --rows 24 --out gap.json

Prints one line per row and a summary; ``--out`` writes both as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from draftsmith.chat import load_tokenizer, stop_token_ids
from draftsmith.evaluate import (
    DFlashProposer,
    PromptLookupProposer,
    load_drafter,
    speculative_generate,
    target_generate,
)
from draftsmith.extract import FeatureExtractor
from draftsmith.features import FeatureIndex
from draftsmith.target import default_device, load_target, resolve_dtype
from draftsmith.train import TrainSettings, pack_documents, split_samples


def merged_config(paths: list[str]) -> dict:
    """config.yaml with each ``--config`` file merged over it, section by section (as Snakemake merges)."""
    cfg: dict = yaml.safe_load(Path("config.yaml").read_text()) or {}
    for p in paths:
        over = yaml.safe_load(Path(p).read_text()) or {}
        for key, value in over.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    return cfg


def teacher_forced(drafter, part: dict, embed, head, backend: str, device, dtype) -> dict:
    """Teacher-forced metrics of one row with every eligible anchor: slot accuracies, block τ."""
    on_gpu = device.type == "cuda"  # as train packs on a GPU: fixed row length, power-of-two anchor buckets
    batch = pack_documents([part], width=part["features"].shape[1], num_anchors=1 << 30, seed=0,
                           feature_dtype=dtype, pad_tokens_to=1024 if on_gpu else 1,
                           pad_anchors_to=max(1, 128 // drafter.block_size) if on_gpu else 1,
                           bucket_anchors=on_gpu).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        out = drafter.training_forward(batch, embed, head, gamma=7.0, use_target_tokens=True, backend=backend)
    count = out.count.clamp_min(1).float()
    return {"slot_accuracy": (out.correct.float() / count).tolist()[:4],
            "block_tau": (out.accept_sum.item() / max(1, out.full_blocks.item())) + 1.0,
            "full_blocks": int(out.full_blocks.item()), "correct": out.correct.tolist(), "count": out.count.tolist()}


def first_answer(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` of the row's first supervised span (the first assistant answer)."""
    on = torch.nonzero(loss_mask).flatten()
    if on.numel() == 0:
        return len(input_ids), len(input_ids)
    start = int(on[0])
    off = torch.nonzero(~loss_mask[start:]).flatten()
    return start, start + (int(off[0]) if off.numel() else len(input_ids) - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help="config files merged over config.yaml")
    ap.add_argument("--index", default="results/features/index.json")
    ap.add_argument("--drafter", default="results/drafter/final")
    ap.add_argument("--target", default=None, help="target folder (default: resources/targets/<name of target.model>)")
    ap.add_argument("--rows", type=int, default=24, help="held-out rows to diagnose")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg = merged_config(args.config)
    train_cfg = TrainSettings.from_config(cfg).train
    target_dir = args.target or str(Path("resources/targets") / str(cfg["target"]["model"]).split(":", 1)[-1])
    device = default_device()
    dtype = resolve_dtype(cfg["target"].get("dtype", "auto"), device)
    t0 = time.time()
    target = load_target(target_dir, dtype=cfg["target"].get("dtype", "auto"), device=device)
    tokenizer = load_tokenizer(target_dir)
    stops = stop_token_ids(tokenizer, target_dir, {})
    # fp32 weights under bf16 autocast, as train holds them; on a GPU the flex copy's layers are compiled as
    # train.compile does, the SDPA copy stays eager
    train_dtype = torch.float32 if device.type == "cuda" else dtype
    tf_drafters = {"sdpa": load_drafter(args.drafter, device=device, dtype=train_dtype)}
    if device.type == "cuda":
        import torch._dynamo.config as dynamo_config

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        tf_drafters["flex"] = load_drafter(args.drafter, device=device, dtype=train_dtype)
        for layer in tf_drafters["flex"].layers:
            layer.compile()
        tf_drafters["flex"].fused_loss = True  # as the trainer's train.compile
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    index = FeatureIndex(args.index)
    layer_ids = [int(i) for i in tf_drafters["sdpa"].target_layer_ids]
    if list(index.layer_ids) != layer_ids:
        raise SystemExit(f"{args.index}: layer ids {index.layer_ids} != the drafter's {layer_ids}")
    _, heldout = split_samples([s.row for s in index.samples], train_cfg.eval_fraction, train_cfg.seed)
    draft_model = load_drafter(args.drafter, device=device, dtype=dtype)
    dflash = DFlashProposer(draft_model, target)
    lookup = PromptLookupProposer(3, dflash.max_drafts)
    static = None
    if device.type == "cuda":  # the evaluate stage's fast path: static KV cache, CUDA graphs, static drafter
        from draftsmith.evaluate.static import StaticTarget

        length = 1024 + args.max_new_tokens + dflash.block_size + 1
        static = StaticTarget(target, length, layer_ids=dflash.layer_ids, cuda_graphs=True,
                              verify_width=dflash.block_size)
        dflash.use_static(length, cuda_graphs=True)
    print(f"target {target_dir} ({dtype}, {device}); {len(heldout)} held-out rows, diagnosing "
          f"{min(args.rows, len(heldout))}; loaded in {time.time() - t0:.1f} s", flush=True)

    rows = []
    extractor = FeatureExtractor(target, index.layer_ids, target_tokens=True)
    for n, sample in enumerate(heldout[:args.rows]):
        part = index.read(index.samples[sample], dtype=dtype)
        ids, mask = part["input_ids"], part["loss_mask"]
        start, end = first_answer(ids, mask)
        answer = ids[start:end].tolist()
        rec = {"sample": sample, "row": index.samples[sample].row, "tokens": len(ids), "prompt_tokens": start,
               "answer_tokens": len(answer)}
        # 1. stored features against features recomputed now
        with extractor:  # hooks only for this forward (the static target taps the same layers)
            feats, tt = extractor([ids.numpy()])
        a, b = part["features"].to(device).float(), feats.float()
        rec["feature_cosine"] = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
        rec["feature_rel_err"] = ((a - b).norm() / b.norm()).item()
        rec["target_token_equal"] = (part["target_token"].to(device) == tt.long()).float().mean().item()
        # 2. teacher-forced metrics: training's flex path and the dense SDPA path
        for backend, model in tf_drafters.items():
            rec[f"tf_{backend}"] = teacher_forced(model, part, embed, head, backend, device, dtype)
        # 3. the regenerated answer against the target's greedy decoding now
        budget = min(args.max_new_tokens, max(1, len(answer)))
        greedy = target_generate(target, ids[:start], max_new_tokens=budget, stop_token_ids=stops,
                                 static=static).tokens
        same = [x == y for x, y in zip(greedy, answer)]
        rec["greedy_prefix_match"] = next((i for i, s in enumerate(same) if not s), len(same))
        rec["greedy_equal_share"] = sum(same) / max(1, len(same))
        # 4. decoded: DFlash and prompt lookup on the same prompt
        for name, proposer in (("dflash", dflash), ("lookup", lookup)):
            res = speculative_generate(target, proposer, ids[:start], max_new_tokens=args.max_new_tokens,
                                       stop_token_ids=stops, static=static)
            rec[f"{name}_tau"] = res.tau
            rec[f"{name}_first_accept"] = (sum(1 for x in res.accepted if x >= 1) / max(1, len(res.accepted)))
        rows.append(rec)
        tf = rec.get("tf_flex", rec["tf_sdpa"])
        print(f"[{n + 1}] row {rec['row']}: {rec['prompt_tokens']}+{rec['answer_tokens']} tok | feat cos "
              f"{rec['feature_cosine']:.4f} tt= {rec['target_token_equal']:.3f} | tf block τ flex "
              f"{tf['block_tau']:.2f} sdpa {rec['tf_sdpa']['block_tau']:.2f} slot1 {tf['slot_accuracy'][0]:.2f}/"
              f"{rec['tf_sdpa']['slot_accuracy'][0]:.2f} | greedy==data prefix {rec['greedy_prefix_match']} "
              f"share {rec['greedy_equal_share']:.2f} | decoded τ dflash {rec['dflash_tau']:.2f} "
              f"(first {rec['dflash_first_accept']:.2f}) lookup {rec['lookup_tau']:.2f}", flush=True)

    def pooled(backend: str) -> dict:
        correct = torch.tensor([r[f"tf_{backend}"]["correct"] for r in rows]).sum(0)
        count = torch.tensor([r[f"tf_{backend}"]["count"] for r in rows]).sum(0).clamp_min(1)
        blocks = sum(r[f"tf_{backend}"]["full_blocks"] for r in rows)
        tau = sum((r[f"tf_{backend}"]["block_tau"] - 1) * r[f"tf_{backend}"]["full_blocks"] for r in rows)
        return {"slot_accuracy": [round(x, 4) for x in (correct / count).tolist()[:4]],
                "block_tau": round(1 + tau / max(1, blocks), 3)}

    mean = lambda key: round(statistics.fmean(r[key] for r in rows), 4)  # noqa: E731
    summary = {"rows": len(rows), "feature_cosine": mean("feature_cosine"), "feature_rel_err": mean("feature_rel_err"),
               "target_token_equal": mean("target_token_equal"),
               "teacher_forced": {b: pooled(b) for b in tf_drafters},
               "greedy_equal_share": mean("greedy_equal_share"), "greedy_prefix_match": mean("greedy_prefix_match"),
               "dflash_tau": mean("dflash_tau"), "dflash_first_accept": mean("dflash_first_accept"),
               "lookup_tau": mean("lookup_tau"), "seconds": round(time.time() - t0, 1)}
    print("summary:", json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
