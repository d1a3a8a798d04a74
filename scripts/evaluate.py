"""Entry point of rule evaluate: real speculative decoding, τ, speedup, losslessness per benchmark set."""

import os

import torch

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import setup_logging

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake injects it)
lease_gpus(snakemake.resources.gpu, logger=log, job="evaluate", record=LEASE_LOG)  # noqa: F821
torch.set_num_threads(snakemake.threads)  # noqa: F821
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftsmith.evaluate import EvaluateSettings, run_evaluate  # noqa: E402

settings = EvaluateSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821

report = run_evaluate(
    target_dir=snakemake.input.target,  # noqa: F821
    drafter_dir=os.path.dirname(snakemake.input.drafter),  # noqa: F821
    curated_eval=snakemake.input.eval,  # noqa: F821
    tokenized_eval=snakemake.input.tokenized,  # noqa: F821
    outputs={k: snakemake.output[k] for k in ("json", "md", "tau", "positions", "histogram")},  # noqa: F821
    settings=settings,
    sources=snakemake.params.sources,  # noqa: F821
    trainer_state=snakemake.input.trainer_state,  # noqa: F821
)


def _num(x, suffix=""):
    return "n/a" if x is None else f"{x:.2f}{suffix}"


o = report["overall"]
log.info("evaluate done: %d prompts, DFlash τ %s speedup %s; prompt lookup τ %s speedup %s (report.md)",
         o["prompts"], _num(o["dflash"]["tau"]), _num(o["dflash"].get("speedup"), "x"),
         _num(o["prompt_lookup"]["tau"]), _num(o["prompt_lookup"].get("speedup"), "x"))
log_peak_memory(log)
