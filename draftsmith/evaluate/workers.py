"""Decoding workers, the evaluate job's side: how many, which conversations each decodes, starting them.

With ``evaluate.gpus`` > 1 and that many GPUs leased, the job starts one decoding process per GPU
(:mod:`draftsmith.evaluate.worker`), each with the conversations :func:`worker_of` gives it; they save what they
decode beside the report (:mod:`draftsmith.evaluate.resume`), and the job merges their saved conversations in the
sets' order into the report one process would write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from draftsmith.evaluate.decoders import EvaluateInputs
from draftsmith.evaluate.settings import EvaluateSettings
from draftsmith.gpu import spawn
from draftsmith.io import write_json

log = logging.getLogger("draftsmith.evaluate")


def _on_cuda(device: torch.device | str | None) -> bool:
    """Whether the job decodes on CUDA: ``device``'s type, or (None) whether CUDA is there."""
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def decoding_workers(gpus: int, device: torch.device | str | None = None) -> int:
    """Decoding processes for an evaluate job: ``gpus`` (``evaluate.gpus``) when the job runs on CUDA and sees at
    least that many GPUs (its lease), else 1 (on the CPU, or a job given fewer GPUs)."""
    gpus = int(gpus or 0)
    if gpus > 1 and _on_cuda(device) and torch.cuda.device_count() >= gpus:
        return gpus
    return 1


def worker_of(conversation_id: str, workers: int) -> int:
    """The worker that decodes a conversation: a stable hash of its id modulo ``workers``. A conversation that sits
    in several sets goes to one worker, which decodes their shared prompts once, as a single process does."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % workers


def run_workers(workers: int, inputs: EvaluateInputs, settings: EvaluateSettings, partial: Path,
                device: torch.device | str | None, which: list[int]) -> None:
    """Start decoding processes ``which`` of ``workers`` (``python -m draftsmith.evaluate.worker``), worker ``w``
    on GPU ``w`` of ``CUDA_VISIBLE_DEVICES`` (or the CPU), and wait for them all (:func:`draftsmith.gpu.spawn`: they
    hold the job's lease and end with the job); their log lines go to this job's
    log file. They read what to do from ``partial/worker-args.json``: ``inputs``, ``settings`` (as JSON), the
    number of workers, the log file, the device kind and their CPU threads.

    Raises:
        RuntimeError: a worker exited with an error (naming it and its exit code).
    """
    cuda = _on_cuda(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count() if cuda else 0)]
    file_handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for h in file_handlers:  # from now on this process appends too: the workers append to the same log
        h.mode = "a"
        h.close()  # reopened, appending, by its next line
    log_files = [h.baseFilename for h in file_handlers]
    partial.mkdir(parents=True, exist_ok=True)
    args_file = partial / "worker-args.json"
    write_json(args_file, {**dataclasses.asdict(inputs), "settings": settings.to_dict(), "partial": str(partial),
                           "workers": workers, "log_file": log_files[0] if log_files else None,
                           "device": "cuda" if cuda else "cpu",
                           "threads": max(1, torch.get_num_threads() // workers)})
    procs = []
    for w in which:
        env = dict(os.environ)
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = gpus[w]
        procs.append(spawn([sys.executable, "-m", "draftsmith.evaluate.worker", "--worker", str(w),
                            "--args", str(args_file)], env=env))
    log.info("evaluate: %d decoding workers started (%s)%s", len(which),
             ", ".join(f"worker {w} on GPU {gpus[w]}" if cuda else f"worker {w} on the CPU" for w in which),
             f"; {workers - len(which)} of {workers} had every conversation saved" if len(which) < workers else "")
    codes = [p.wait() for p in procs]
    failed = [f"worker {w} (exit code {c})" for w, c in zip(which, codes) if c != 0]
    if failed:
        raise RuntimeError(f"evaluate: decoding {', '.join(failed)} failed: the traceback is in the log above")
