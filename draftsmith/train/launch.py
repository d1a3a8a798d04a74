"""The rules' side of training: lease the GPUs, start ``python -m draftsmith.train`` under torchrun (one process per
leased GPU; one on the CPU when the rule asks for none) and copy its output to the console and the rule's log.

``scripts/train.py`` (rule train) and ``scripts/train_phase.py`` (rule train_phase) call :func:`run_trainer`.
torchrun is started with :func:`draftsmith.gpu.spawn`: it holds the lease, and it and its trainers end with the job
(killed or not); the checkpoint folder's lock is the trainers' (``python -m draftsmith.train``).
"""

from __future__ import annotations

import logging
import subprocess
import sys

from draftsmith.gpu import LEASE_LOG, lease_gpus, spawn


def run_trainer(args: list[str], *, gpus: int, threads: int, log: logging.Logger, job: str,
                cpu_fallback: bool = False, command: list[str] | None = None) -> None:
    """Lease ``gpus`` GPUs (exports CUDA_VISIBLE_DEVICES; held while training runs), then run ``python -m
    torch.distributed.run --standalone --nproc-per-node max(1, gpus) -m draftsmith.train <args> --threads
    <threads>``; its lines go to stderr and, through the log file's own handler, to the rule's log (one file
    position for both: a second handle on the file would overwrite one with the other).

    torchrun is a :func:`draftsmith.gpu.spawn` child: it holds the lease's lock fds, and it and its trainers are
    ended when this job exits, gets SIGTERM / SIGINT, or is killed.

    Args:
        cpu_fallback: ``gpu.cpu_fallback`` (:func:`draftsmith.gpu.lease_gpus`).
        command: run this instead of torchrun (tests).

    Raises:
        GpuUnavailableError: ``gpus > 0`` and no usable GPU, without ``cpu_fallback``.
        SystemExit: the training processes failed (their exit status; the log says so).
    """
    lease_gpus(gpus, logger=log, job=job, record=LEASE_LOG, cpu_fallback=cpu_fallback, gpus_key="train.gpus")
    cmd = command or [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(max(1, gpus)), "-m", "draftsmith.train", *args, "--threads", str(threads)]
    log.info("torchrun: %d process(es)", max(1, gpus))
    log_file = next(h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler))
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:  # progress (rate, ETA) on the console and in the log
            sys.stderr.write(line)
            log_file.stream.write(line)
            log_file.flush()
    if proc.returncode:
        log.error("training failed (exit status %d); its output is above", proc.returncode)
        raise SystemExit(proc.returncode)
