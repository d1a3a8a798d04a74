"""Entry point of rule extract_slice: one shard of phase {phase}'s slice (stream mode) -> its folder.

Thin: leases one GPU, then draftsmith.extract.extract_shard on the slice's extraction plan, staged in
results/stream/.staging/phase-{phase}/shard-{shard}/ (a killed job resumes from its chunks there) and renamed onto
the rule's output folder when complete.
"""

from pathlib import Path

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
phase, shard = int(snakemake.wildcards.phase), int(snakemake.wildcards.shard)

# torch is imported before the lease, CUDA starts after it, on the leased GPU only
import torch  # noqa: E402

from draftsmith.extract import ExtractSliceSettings, extract_shard  # noqa: E402

settings = ExtractSliceSettings.from_rule(snakemake.params.settings, snakemake.config)
lease_gpus(int(snakemake.resources.gpu), logger=log, job=f"extract_slice {phase}/{shard}", record=LEASE_LOG,
           cpu_fallback=settings.gpu.cpu_fallback)
torch.set_num_threads(int(snakemake.threads))
out = Path(snakemake.output[0])
extract_shard(
    plan_path=snakemake.input.plan,
    tokenized_path=snakemake.input.train,
    target_dir=snakemake.input.target,
    manifest_path=out / "manifest.json",
    shard=shard,
    settings=settings,
    staging_dir=out.parent.parent / ".staging" / out.parent.name / out.name,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
log_peak_memory(log)
