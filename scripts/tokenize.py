"""Entry point of rule tokenize: curated conversations -> token ids + loss masks (draftsmith.tokenize)."""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel across worker processes instead

from draftsmith.io import setup_logging
from draftsmith.tokenize import TokenizeSettings, run

setup_logging(snakemake.log[0])
settings = TokenizeSettings.from_rule(snakemake.params.settings, snakemake.config)
# the workers are the job's threads: tokenize.threads, unless the profile sets them or --cores caps them
settings = dataclasses.replace(settings, tokenize=settings.tokenize.replace(threads=snakemake.threads))
run(
    train_in=snakemake.input.train,
    eval_in=snakemake.input.eval,
    target_dir=snakemake.input.target,
    train_out=snakemake.output.train,
    eval_out=snakemake.output.eval,
    report_out=snakemake.output.report,
    settings=settings,
)
