"""Entry point of rule train: lease the GPUs, then torchrun ``python -m draftsmith.train`` (one process per leased
GPU; one on the CPU when the rule asks for none), its output to the console and to the rule's log
(:func:`draftsmith.train.launch.run_trainer`).

Offline (``input.index``: results/features/index.json) it trains the drafter. In stream mode (``input.marker``: the
last phase's marker, with ``input.train``, the tokenized train parquet, and ``input.heldout``, the held-out features'
folder, when the rule has one) it ends the run: the final checkpoint's held-out metrics and ``trained/``.

The processes get the stage's settings (:class:`draftsmith.train.TrainSettings`: the keys the weights depend on,
the rule's params, and train's runtime keys from the config, cadence and loader, which Snakemake does not rerun
training for) as ``--args`` JSON.
"""

import json
from pathlib import Path

from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

from draftsmith.train import TrainSettings  # noqa: E402
from draftsmith.train.launch import run_trainer  # noqa: E402

settings = TrainSettings.from_rule(snakemake.params.settings, snakemake.config)
out_dir = Path(snakemake.output.state).parent.parent  # results/drafter
if hasattr(snakemake.input, "marker"):  # stream mode: the run's end
    args = ["--final", snakemake.input.marker, "--tokenized", snakemake.input.train]
    if getattr(snakemake.input, "heldout", None):
        args += ["--heldout", snakemake.input.heldout]
else:
    args = ["--index", snakemake.input.index]
run_trainer([*args, "--target", snakemake.input.target, "--out", str(out_dir), "--args",
             json.dumps(settings.to_dict())], gpus=int(snakemake.resources.gpu), threads=snakemake.threads, log=log,
            job="train", cpu_fallback=settings.gpu.cpu_fallback)
