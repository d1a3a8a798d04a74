"""Entry point of rule train_phase (stream mode, docs/stream.md): lease the GPUs, then torchrun ``python -m
draftsmith.train --phase {phase}`` (one process per leased GPU, as many as ``train.gpus`` cut the plan for), its
output to the console and to the rule's log (:func:`draftsmith.train.launch.run_trainer`).

Inputs: ``input.index`` (the slice's index.json), ``input.train`` (the tokenized train parquet), ``input.plan``
(the stream plan, results/stream/plan.json, whose record of the phase is checked), ``input.target``, and when the
rule has them ``input.heldout`` (the held-out features' folder) and ``input.previous`` (phase p - 1's marker).
Output: ``output.marker`` (results/drafter/phases/phase-{p}.json; checkpoints and TensorBoard go beside its folder,
in results/drafter). Settings: :class:`draftsmith.train.TrainPhaseSettings` (the train, drafter and stream keys).
"""

import json
from pathlib import Path

from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

from draftsmith.train import TrainPhaseSettings  # noqa: E402
from draftsmith.train.launch import run_trainer  # noqa: E402

settings = TrainPhaseSettings.from_rule(snakemake.params.settings, snakemake.config)
phase = int(snakemake.wildcards.phase)
marker = Path(snakemake.output.marker)
args = ["--phase", str(phase), "--index", snakemake.input.index, "--tokenized", snakemake.input.train,
        "--plan", snakemake.input.plan, "--marker", str(marker)]
for name in ("heldout", "previous"):  # previous: a list from an input function, empty for phase 0
    value = getattr(snakemake.input, name, None)
    if value:
        args += [f"--{name}", str(value if isinstance(value, str) else value[0])]
run_trainer([*args, "--target", snakemake.input.target, "--out", str(marker.parent.parent), "--args",
             json.dumps(settings.to_dict())], gpus=int(snakemake.resources.gpu), threads=snakemake.threads, log=log,
            job=f"train_phase {phase}", cpu_fallback=settings.gpu.cpu_fallback)
