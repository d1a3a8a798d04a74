"""Entry point of rule evaluate: real speculative decoding, τ, speedup, losslessness per benchmark set."""

import os

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

import torch  # noqa: E402

torch.set_num_threads(snakemake.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the stage after HF_HUB_OFFLINE, which huggingface_hub reads when it is imported; the lease before CUDA starts
from draftsmith.evaluate import EvaluateSettings, drafter_name, run_evaluate  # noqa: E402
from draftsmith.evaluate.report import start_drops  # noqa: E402

settings = EvaluateSettings.from_rule(snakemake.params.settings, snakemake.config)
lease_gpus(snakemake.resources.gpu, logger=log, job="evaluate", record=LEASE_LOG,
           cpu_fallback=settings.gpu.cpu_fallback, gpus_key="evaluate.gpus")

report = run_evaluate(
    target_dir=snakemake.input.target,
    drafter_dir=os.path.dirname(snakemake.input.drafter),
    curated_eval=snakemake.input.eval,
    tokenized_eval=snakemake.input.tokenized,
    outputs={k: snakemake.output[k] for k in ("json", "md", "tau", "positions", "histogram")},
    settings=settings,
    sources=snakemake.params.sources,
    trainer_state=snakemake.input.trainer_state,
)


def _num(x, suffix=""):
    return "n/a" if x is None else f"{x:.2f}{suffix}"


o = report["overall"]
mtp = o.get("mtp") or {}
fastest = mtp.get("fastest")
mtp_text = (f"; the target's MTP head, fastest at k={fastest}: τ {_num(mtp['by_tokens'][str(fastest)]['tau'])} "
            f"speedup {_num(mtp['by_tokens'][str(fastest)].get('speedup'), 'x')}, the drafter "
            f"{'faster' if mtp.get('drafter_faster') else 'NOT faster'}" if fastest is not None else "")
start = o.get("start")
start_text = (f"; from the start drafter τ {_num(start['before']['tau'])} -> {_num(o['dflash']['tau'])}, tok/s "
              f"{_num(start['before']['tokens_per_s'])} -> {_num(o['dflash']['tokens_per_s'])}"
              + "".join(f"; τ DROPPED on {name} ({before:.2f} -> {after:.2f})"
                        for name, before, after in start_drops(report) if name != "all")
              if start else "")
log.info("evaluate done: %d prompts, %s τ %s speedup %s; prompt lookup τ %s speedup %s%s%s (report.md)",
         o["prompts"], drafter_name(report["run"]), _num(o["dflash"]["tau"]), _num(o["dflash"].get("speedup"), "x"),
         _num(o["prompt_lookup"]["tau"]), _num(o["prompt_lookup"].get("speedup"), "x"), mtp_text, start_text)
log_peak_memory(log)
