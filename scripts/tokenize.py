"""Entry point of rule tokenize: curated conversations -> token ids + loss masks (draftsmith.tokenize)."""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel across worker processes instead

from draftsmith.io import setup_logging  # noqa: E402
from draftsmith.tokenize import TokenizeSettings, run  # noqa: E402

setup_logging(snakemake.log[0])  # noqa: F821
settings = TokenizeSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
# the workers are the job's threads: tokenize.threads, unless the profile sets them or --cores caps them
settings = dataclasses.replace(settings, tokenize=settings.tokenize.replace(threads=snakemake.threads))  # noqa: F821
run(
    train_in=snakemake.input.train,  # noqa: F821
    eval_in=snakemake.input.eval,  # noqa: F821
    target_dir=snakemake.input.target,  # noqa: F821
    train_out=snakemake.output.train,  # noqa: F821
    eval_out=snakemake.output.eval,  # noqa: F821
    report_out=snakemake.output.report,  # noqa: F821
    settings=settings,
)
