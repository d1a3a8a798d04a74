"""Entry point of rule tokenize: curated conversations -> token ids + loss masks (draftsmith.tokenize)."""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel across worker processes instead

from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers
from draftsmith.target_checks import check_target_in_job
from draftsmith.tokenize import TokenizeSettings, run


def main() -> None:
    log = setup_logging(snakemake.log[0])
    invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
    # an embedded target materialised in this run was not there when the workflow was planned: the settings are checked
    # against it here, before extraction's GPU hours (rules/common.smk checks them at planning when it exists)
    check_target_in_job(snakemake.config, snakemake.input.target, log)
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


# the guard matters: tokenize's worker processes (multiprocessing's forkserver) import this script again as their
# main module, and must not run the job in each of them
if __name__ == "__main__":
    main()
