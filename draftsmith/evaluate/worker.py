"""``python -m draftsmith.evaluate.worker --worker W --args FILE``: one decoding worker of an evaluate job.

:func:`draftsmith.evaluate.run.run_evaluate` starts one per GPU when ``evaluate.gpus`` > 1
(:func:`draftsmith.evaluate.workers.run_workers`); each decodes its share of the conversations
(:func:`draftsmith.evaluate.workers.deal_conversations`) and saves them beside the report. Nothing imports this
module: it runs only as a process's main module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from pathlib import Path

import torch

from draftsmith.evaluate.decoders import EvaluateInputs, decode_set, decoding_path, prepare_decoders, read_sets
from draftsmith.evaluate.resume import load_saved, run_key, save_conversations, saved_file, set_key
from draftsmith.evaluate.settings import EvaluateSettings
from draftsmith.evaluate.workers import deal_conversations
from draftsmith.gpu import log_peak_memory
from draftsmith.io import read_json, setup_logging, write_json
from draftsmith.progress import progress

log = logging.getLogger("draftsmith.evaluate")


def decode_worker(worker: int, args: dict) -> None:
    """One decoding worker: the sets' conversations :func:`~draftsmith.evaluate.workers.deal_conversations`
    gives it, decoded as :func:`~draftsmith.evaluate.run.run_evaluate` decodes them and saved to
    ``partial/<set>/worker-<w>-of-<n>.json`` as it goes; conversations any earlier process saved are reused, and a
    worker with nothing left never loads the target. A worker that loaded the models writes how they decode
    (``partial/decoding.json``) for the report.

    Args:
        args: the job's ``worker-args.json`` (:func:`~draftsmith.evaluate.workers.run_workers`).
    """
    workers, partial = int(args["workers"]), Path(args["partial"])
    torch.set_num_threads(int(args["threads"]))
    device = torch.device("cuda", 0) if args["device"] == "cuda" else torch.device("cpu")
    inputs = EvaluateInputs(**{f.name: args[f.name] for f in dataclasses.fields(EvaluateInputs)})
    settings = EvaluateSettings.from_config(args["settings"])
    decoders = prepare_decoders(inputs, settings, device)
    sets = read_sets(decoders, inputs, settings.evaluate.sets)
    base_key = run_key(decoders, inputs.target_dir, inputs.drafter_dir)
    deal = deal_conversations(sets, workers)
    mine = [dataclasses.replace(b, conversations=[c for c in b.conversations if deal[c.id] == worker]) for b in sets]
    bar = progress(sum(len(c.user_turns) for b in mine for c in b.conversations), f"evaluate worker {worker}",
                   unit="prompt", logger=log, interval=float(settings.evaluate.progress_interval))
    decoded: dict = {}
    interval = float(settings.evaluate.checkpoint_interval)
    with contextlib.closing(bar):  # a failed decoding stops the bar's heartbeat thread too
        for bset, own in zip(sets, mine):
            key, path = set_key(base_key, bset), saved_file(partial, bset.name, f"worker-{worker}-of-{workers}")
            decode_set(decoders, own, decoded, bar, load_saved(partial, bset.name, key),
                       lambda records, key=key, path=path: save_conversations(path, key, records), interval)
    if decoders.target is not None:
        write_json(partial / "decoding.json", decoding_path(decoders))
    log.info("evaluate worker %d done (GPU %s)%s", worker, os.environ.get("CUDA_VISIBLE_DEVICES", "none"),
             "" if decoders.target is not None else ": every conversation was saved by an earlier run")
    log_peak_memory(log)  # each worker's own peak: the job's line after it is the merging process's


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.evaluate.worker --worker W --args FILE``: one decoding worker of an evaluate job."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--args", required=True, help="JSON written by the evaluate job")
    opts = ap.parse_args(argv)
    args = read_json(opts.args)
    setup_logging(args["log_file"], append=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    decode_worker(opts.worker, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
