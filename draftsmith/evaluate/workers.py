"""Decoding workers, the evaluate job's side: how many, which conversations each decodes, starting them.

With ``evaluate.gpus`` > 1 and that many GPUs leased, the job starts one decoding process per GPU
(:mod:`draftsmith.evaluate.worker`), or ``evaluate.workers_per_gpu`` sharing each GPU, each with the conversations
:func:`deal_conversations` gives it; they save what they decode beside the report (:mod:`draftsmith.evaluate.resume`),
and the job merges their saved conversations in the sets' order into the report one process would write.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.evaluate.decoders import EvaluateInputs
from draftsmith.evaluate.prompts import BenchmarkSet
from draftsmith.evaluate.settings import EvaluateSettings
from draftsmith.gpu import spawn
from draftsmith.io import write_json

log = logging.getLogger("draftsmith.evaluate")


def on_cuda(device: torch.device | str | None) -> bool:
    """Whether the job decodes on CUDA: ``device``'s type, or (None) whether CUDA is there."""
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def decoding_workers(gpus: int, device: torch.device | str | None = None, per_gpu: int = 1) -> int:
    """Decoding processes for an evaluate job on CUDA: ``per_gpu`` (``evaluate.workers_per_gpu``) on each GPU of
    ``gpus`` (``evaluate.gpus``) when it sees at least that many (its lease), else on one GPU; 1 on the CPU."""
    if not on_cuda(device):
        return 1
    gpus = int(gpus or 0)
    used = gpus if gpus > 1 and torch.cuda.device_count() >= gpus else 1
    return used * max(1, int(per_gpu or 1))


def gpu_of(worker: int, workers: int, per_gpu: int, visible: list[str]) -> str:
    """The GPU (an entry of ``visible``, the job's ``CUDA_VISIBLE_DEVICES``) decoding worker ``worker`` of
    ``workers`` runs on: the workers are dealt round-robin over the first ``workers / per_gpu`` GPUs, so each of
    those GPUs runs ``per_gpu`` of them.

    Raises:
        ValueError: fewer visible GPUs than the workers need.
    """
    used = max(1, workers // max(1, per_gpu))
    if len(visible) < used:
        raise ValueError(f"evaluate: {workers} decoding workers, {per_gpu} a GPU, need {used} GPU(s); "
                         f"CUDA_VISIBLE_DEVICES has {len(visible)}")
    return visible[worker % used]


def deal_conversations(sets: Sequence[BenchmarkSet], workers: int) -> dict[str, int]:
    """Which decoding worker decodes each conversation of ``sets``: ``{conversation id: worker}``, balanced by
    the tokens each may decode.

    A conversation's cost is its user turns times the largest ``max_new_tokens`` of the sets it sits in (batch-1
    decoding time grows with the tokens generated; prefill is small beside it). Conversations are dealt longest
    first, each to the worker with the least cost so far (LPT; ties: the lower worker index, the smaller id), so
    no worker's cost exceeds the mean by more than one conversation's. The deal depends on the sets alone, not on
    what an earlier run saved: every process of a job, and a rerun with the same number of workers, deals the same
    way (a worker rewrites its own file with the conversations it had saved). A conversation that sits in several
    sets goes to one worker, which decodes their shared prompts once, as a single process does. Replaces a hash of
    the id, which dealt the gpu-proof sets' 82 prompts 33 / 29 / 20 to three workers.

    Args:
        sets: the job's benchmark sets (:func:`~draftsmith.evaluate.decoders.read_sets`).
        workers: decoding processes, >= 1.
    """
    cost: dict[str, int] = {}
    for bset in sets:
        for conv in bset.conversations:
            cost[conv.id] = max(cost.get(conv.id, 0), len(conv.user_turns) * int(bset.max_new_tokens))
    load = [(0, w) for w in range(max(1, int(workers)))]
    heapq.heapify(load)
    deal: dict[str, int] = {}
    for cid in sorted(cost, key=lambda c: (-cost[c], c)):
        spent, w = heapq.heappop(load)
        deal[cid] = w
        heapq.heappush(load, (spent + cost[cid], w))
    return deal


def run_workers(workers: int, inputs: EvaluateInputs, settings: EvaluateSettings, partial: Path,
                device: torch.device | str | None, which: list[int]) -> None:
    """Start decoding processes ``which`` of ``workers`` (``python -m draftsmith.evaluate.worker``), worker ``w``
    on the GPU :func:`gpu_of` gives it (``settings.evaluate.workers_per_gpu`` to a GPU) or the CPU, and wait for
    them all (:func:`draftsmith.gpu.spawn`: they
    hold the job's lease and end with the job); their log lines go to this job's
    log file. They read what to do from ``partial/worker-args.json``: ``inputs``, ``settings`` (as JSON), the
    number of workers, the log file, the device kind and their CPU threads.

    Raises:
        RuntimeError: a worker exited with an error (naming it and its exit code).
    """
    cuda = on_cuda(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count() if cuda else 0)]
    per_gpu = int(settings.evaluate.workers_per_gpu) if cuda else 1
    gpu = {w: gpu_of(w, workers, per_gpu, gpus) for w in which} if cuda else {}
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
            env["CUDA_VISIBLE_DEVICES"] = gpu[w]
        procs.append(spawn([sys.executable, "-m", "draftsmith.evaluate.worker", "--worker", str(w),
                            "--args", str(args_file)], env=env))
    log.info("evaluate: %d decoding workers started (%s)%s", len(which),
             ", ".join(f"worker {w} on GPU {gpu[w]}" if cuda else f"worker {w} on the CPU" for w in which),
             f"; {workers - len(which)} of {workers} had every conversation saved" if len(which) < workers else "")
    codes = [p.wait() for p in procs]
    failed = [f"worker {w} (exit code {c})" for w, c in zip(which, codes) if c != 0]
    if failed:
        raise RuntimeError(f"evaluate: decoding {', '.join(failed)} failed: the traceback is in the log above")
