"""``python -m draftsmith.train``: one training process (torchrun starts one per GPU; rule train runs it through
``scripts/train.py``)."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist

from draftsmith.train.settings import TrainSettings
from draftsmith.train.trainer import train


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.train``: one training process (torchrun starts one per GPU; rule train runs it).

    ``--args`` is JSON ``{"train": {...}, "drafter": {...}}`` (missing keys take the defaults). Resumes from
    ``<out>/checkpoints/`` when a checkpoint of the same configuration is there.
    """
    import argparse

    from draftsmith.io import setup_logging

    parser = argparse.ArgumentParser(prog="python -m draftsmith.train", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="results/features/index.json")
    parser.add_argument("--target", required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", required=True, help="output folder (results/drafter)")
    parser.add_argument("--args", required=True, help="JSON with the train and drafter config sections")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for all processes together")
    args = parser.parse_args(argv)
    settings = TrainSettings.from_config(json.loads(args.args))
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, level=logging.INFO if rank == 0 else logging.WARNING)  # the rule tees output to its log
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        train(args.index, args.target, args.out, settings, threads=args.threads)
    finally:
        if dist.is_initialized():  # NCCL warns (and may leak) without an explicit teardown
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
