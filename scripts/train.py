"""Entry point of rule train: lease the GPUs, then torchrun ``python -m draftsmith.train`` (one process per leased
GPU; one on the CPU when the rule asks for none), its output to the console and to the rule's log.

The processes get the stage's settings (:class:`draftsmith.train.TrainSettings`: the keys the weights depend on,
the rule's params, and train's runtime keys from the config, cadence and loader, which Snakemake does not rerun
training for) as ``--args`` JSON.
"""

import json
import logging
import subprocess
import sys
from pathlib import Path

from draftsmith.gpu import LEASE_LOG, lease_gpus
from draftsmith.io import setup_logging
from draftsmith.train import TrainSettings

log = setup_logging(snakemake.log[0])
settings = TrainSettings.from_rule(snakemake.params.settings, snakemake.config)
gpus = int(snakemake.resources.gpu)
lease_gpus(gpus, logger=log, job="train", record=LEASE_LOG)  # exports CUDA_VISIBLE_DEVICES; held while training runs
out_dir = Path(snakemake.output.state).parent.parent  # results/drafter
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(max(1, gpus)),
       "-m", "draftsmith.train", "--index", snakemake.input.index, "--target", snakemake.input.target,
       "--out", str(out_dir), "--threads", str(snakemake.threads),
       "--args", json.dumps(settings.to_dict())]
log.info("torchrun: %d process(es)", max(1, gpus))
# the training processes' lines go through the log file's own handler, so they and this script's lines share one
# file position (a second handle on the file would overwrite one with the other)
log_file = next(h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler))
with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
    for line in proc.stdout:  # progress (rate, ETA) on the console and in the log
        sys.stderr.write(line)
        log_file.stream.write(line)
        log_file.flush()
if proc.returncode:
    log.error("training failed (exit status %d); its output is above", proc.returncode)
    raise SystemExit(proc.returncode)
