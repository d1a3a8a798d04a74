"""Entry point of rule train, run by torchrun (one process per leased GPU; a shell rule, so no `snakemake` object).

    python -m draftsmith.gpu --gpus N -- python -m torch.distributed.run --standalone --nproc-per-node N \
        scripts/train.py --index results/features/index.json --target TARGET --out results/drafter \
        --args '{"train": {...}, "drafter": {...}, "target": {...}}' [--threads T]

Resumes from results/drafter/checkpoints/ when a checkpoint of the same configuration is there.
"""

import os
import sys

# Run as a file, Python puts scripts/ first on sys.path, where scripts/tokenize.py would shadow the standard
# library's `tokenize` (imported by logging / linecache): drop that entry before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402

from draftsmith.io import setup_logging  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="results/features/index.json")
    parser.add_argument("--target", required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", required=True, help="output folder (results/drafter)")
    parser.add_argument("--args", required=True, help="JSON with the train, drafter and target config sections")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for all processes together")
    args = parser.parse_args()
    cfg = json.loads(args.args)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, level=logging.INFO if rank == 0 else logging.WARNING)  # stdout/stderr go to the rule's log

    import torch  # after logging, so import warnings land in the log

    from draftsmith.train import train

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        train(args.index, args.target, args.out, cfg.get("train"), cfg.get("drafter"), threads=args.threads)
    finally:
        if torch.distributed.is_initialized():  # NCCL warns (and may leak) without an explicit teardown
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
