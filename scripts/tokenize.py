"""Entry point of rule tokenize: curated conversations -> token ids + loss masks (draftsmith.tokenize)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel across worker processes instead

from draftsmith.io import setup_logging  # noqa: E402
from draftsmith.stages import stage_config  # noqa: E402
from draftsmith.tokenize import run  # noqa: E402

setup_logging(snakemake.log[0])  # noqa: F821
cfg = stage_config("tokenize", snakemake.params.settings, snakemake.config)  # noqa: F821
run(
    train_in=snakemake.input.train,  # noqa: F821
    eval_in=snakemake.input.eval,  # noqa: F821
    target_dir=snakemake.input.target,  # noqa: F821
    train_out=snakemake.output.train,  # noqa: F821
    eval_out=snakemake.output.eval,  # noqa: F821
    report_out=snakemake.output.report,  # noqa: F821
    chat_template_kwargs=dict(cfg["tokenize"]["chat_template_kwargs"]),
    max_length=cfg["tokenize"]["max_length"],
    overflow=cfg["tokenize"]["overflow"],
    threads=snakemake.threads,  # noqa: F821
    trust_remote_code=cfg["target"]["trust_remote_code"],
)
