"""``python -m draftsmith.train``: one training process (torchrun starts one per GPU). Rule train runs it through
``scripts/train.py`` (offline, or in stream mode the run's end), rule train_phase through
``scripts/train_phase.py``."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from draftsmith.gpu import die_with_parent
from draftsmith.io import FolderLockedError, lock_folder
from draftsmith.train.phases import phase_record, train_final, train_phase
from draftsmith.train.settings import TrainPhaseSettings, TrainSettings
from draftsmith.train.trainer import NonFiniteError, train


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.train``: one training process (torchrun starts one per GPU).

    Three modes:

    * offline: ``--index results/features/index.json``; resumes from ``<out>/checkpoints/`` when a checkpoint of the
      same configuration is there;
    * stream mode's phase p: ``--phase P --index <the slice's index.json> --tokenized <train parquet>
      [--heldout <held-out features>] [--plan <stream plan.json>] [--previous <phase p-1's marker>]
      [--marker <this phase's marker>]``;
    * stream mode's end: ``--final <the last phase's marker> --tokenized <train parquet> [--heldout ...]``.

    ``--args`` is JSON ``{"train": {...}, "drafter": {...}}`` (phase: also ``"stream"``; missing keys take the
    defaults).

    Under torchrun each process asks to die with torchrun (:func:`draftsmith.gpu.die_with_parent`: torchrun starts
    it in a session of its own, out of the job's reach). Rank 0 locks ``<out>/checkpoints`` for the run
    (:func:`draftsmith.io.lock_folder`: ``checkpoints/writer.lock`` with its pid and host) before anything is read
    or written, so a second run into the same folder stops, naming the first.

    Returns 1 (the message on stderr) when another live run writes ``<out>/checkpoints``, and when a step's loss or
    gradient norm is not finite (the error names the step and its rows; the newest checkpoint is kept:
    :meth:`~draftsmith.train.trainer.Trainer.check_finite`).
    """
    import argparse

    from draftsmith.io import setup_logging

    parser = argparse.ArgumentParser(prog="python -m draftsmith.train", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", help="results/features/index.json (offline) or the slice's index (phase)")
    parser.add_argument("--target", required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", required=True, help="output folder (results/drafter)")
    parser.add_argument("--args", required=True, help="JSON with the train and drafter (phase: stream) sections")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for all processes together")
    parser.add_argument("--phase", type=int, default=None, help="stream mode: train this phase")
    parser.add_argument("--final", default=None, help="stream mode: the last phase's marker; write trained/")
    parser.add_argument("--tokenized", default=None, help="stream mode: the tokenized train parquet")
    parser.add_argument("--heldout", default=None, help="stream mode: the held-out features (folder or index.json)")
    parser.add_argument("--plan", default=None, help="stream mode: the stream plan (its record of the phase)")
    parser.add_argument("--previous", default=None, help="stream mode: the previous phase's marker")
    parser.add_argument("--marker", default=None, help="stream mode: where the phase's marker goes")
    args = parser.parse_args(argv)
    stream = args.phase is not None or args.final is not None
    if args.phase is not None and args.final is not None:
        parser.error("--phase and --final are two modes: give one")
    if (args.index is None) != (args.final is not None):
        parser.error("--index is needed to train (offline or a phase), and not read by --final")
    if stream and args.tokenized is None:
        parser.error("stream mode (--phase / --final) needs --tokenized")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: end with it
        die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, level=logging.INFO if rank == 0 else logging.WARNING)  # the rule tees output to its log
    if rank == 0:
        try:
            lock_folder(os.path.join(args.out, "checkpoints"), what="the checkpoint folder")
        except FolderLockedError as exc:
            print(f"python -m draftsmith.train: {exc}", file=sys.stderr, flush=True)
            return 1
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    sections = json.loads(args.args)
    try:
        if args.phase is not None:
            train_phase(args.phase, args.index, args.heldout, args.tokenized, args.target, args.out,
                        TrainPhaseSettings.from_config(sections), marker_path=args.marker, previous=args.previous,
                        expected=phase_record(args.plan, args.phase) if args.plan else None, threads=args.threads)
        elif args.final is not None:
            train_final(args.final, args.heldout, args.tokenized, args.target, args.out,
                        TrainSettings.from_config(sections), threads=args.threads)
        else:
            train(args.index, args.target, args.out, TrainSettings.from_config(sections), threads=args.threads)
    except NonFiniteError as exc:  # the step, its rows and the checkpoint kept: the message says it all
        logging.getLogger("draftsmith.train").error("%s", exc)
        return 1
    finally:
        if dist.is_initialized():  # NCCL warns (and may leak) without an explicit teardown
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
