"""How much of the target's next-token distribution the stored top-k holds (``extract.store_target_topk``), over
the supervised positions of a feature index: what ``train.labels: target_topk`` keeps of the target's
distribution and what it leaves out.

    python bench/topk_coverage.py results/features/index.json [--max-samples N]

Prints the supervised positions counted, the top-k probability mass (mean, median, 10th percentile), the target's
top-1 probability (mean; the share of positions above 0.9), the entropy of the renormalised top-k (nats) and the mean
mass of the first j tokens for j = 1, 2, 4, ... up to k (what a smaller ``store_target_topk`` would have kept).
"""

from __future__ import annotations

import argparse

import torch
from safetensors import safe_open

from draftsmith.features import FeatureIndex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("index", help="a merged features index.json with target_top_k > 0")
    ap.add_argument("--max-samples", type=int, default=None, help="read at most this many samples (default all)")
    args = ap.parse_args()
    index = FeatureIndex(args.index)
    if not index.target_top_k:
        raise SystemExit(f"{args.index}: the features hold no top-k (extract.store_target_topk was 0)")
    refs = index.samples[:args.max_samples]
    by_chunk: dict[int, list] = {}
    for ref in refs:
        by_chunk.setdefault(ref.chunk, []).append(ref)
    mass, top1, entropy, cumulative = [], [], [], []
    for ci, chunk_refs in by_chunk.items():  # the loss mask and the top-k only: the hidden states are not read
        with safe_open(str(index.chunks[ci].path), framework="pt") as fh:
            mask, logprobs = fh.get_slice("loss_mask"), fh.get_slice("target_topk_logprobs")
            parts = [logprobs[r.start:r.end][mask[r.start:r.end].bool()] for r in chunk_refs]
        logprobs = torch.cat(parts).float()
        probs = logprobs.exp()
        mass.append(probs.sum(-1))
        cumulative.append(probs.cumsum(-1).mean(0) * probs.shape[0])  # sums; divided by the count below
        top1.append(probs[:, 0])
        q = torch.softmax(logprobs, -1)
        entropy.append(-(q * q.clamp_min(1e-30).log()).sum(-1))
    mass, top1, entropy = torch.cat(mass), torch.cat(top1), torch.cat(entropy)
    print(f"{args.index}: k = {index.target_top_k}, {mass.numel():,} supervised positions; top-k mass mean "
          f"{mass.mean():.4f}, median {mass.median():.4f}, p10 {mass.quantile(0.1):.4f}; top-1 probability mean "
          f"{top1.mean():.4f}, above 0.9 at {(top1 > 0.9).float().mean():.3f} of positions; renormalised top-k "
          f"entropy mean {entropy.mean():.3f} nats")
    by_j = torch.stack(cumulative).sum(0) / mass.numel()  # the stored top-k are in descending order
    cutoffs = [j for j in (1 << i for i in range(11)) if j < index.target_top_k] + [index.target_top_k]
    print("mean mass of the first j tokens: " + ", ".join(f"{j}: {by_j[j - 1]:.4f}" for j in cutoffs))


if __name__ == "__main__":
    main()
