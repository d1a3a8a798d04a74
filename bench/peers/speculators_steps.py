"""Optimizer steps per epoch of speculators 0.9.0's training loader on a writer's folder, computed by speculators'
own batch sampler (run with the speculators Python). The peer benchmark needs it to give speculators the same number
of steps as draftsmith: its trainer stops an epoch at ``--max-steps`` but then runs one more step in every later
epoch (``speculators/train/trainer.py``: ``run_training`` loops over all ``--epochs``; ``train_epoch`` breaks only
after a step), so ``--epochs`` must be the least number of epochs that holds the steps.

    $SPECULATORS_PYTHON bench/peers/speculators_steps.py --data D --train-ratio R --total-seq-len N --seed S \
        --epochs E          # prints {"steps_per_epoch": [...]}
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--train-ratio", type=float, required=True)
    ap.add_argument("--total-seq-len", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, required=True)
    args = ap.parse_args(argv)
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    data = load_from_disk(args.data)
    n_train = int(len(data) * args.train_ratio)
    lengths = list(data.select(range(n_train)).with_format(None)["seq_len"])
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=args.total_seq_len, lengths=lengths,
                                                 num_replicas=1, rank=0, seed=args.seed)
    steps = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        steps.append(len(sampler))
    print(json.dumps({"steps_per_epoch": steps, "train_rows": n_train}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
