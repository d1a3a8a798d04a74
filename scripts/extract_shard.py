"""Entry point of rule extract_shard: one shard of target hidden states -> chunk files + manifest.json.

Thin: leases one GPU from the node pool before CUDA starts, then draftsmith.extract.shard.extract_shard
(resumable: finished chunks recorded in progress.json beside the manifest are kept).
"""

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
# torch is imported before the lease, CUDA starts after it, on the leased GPU only
import torch  # noqa: E402

from draftsmith.extract.shard import ExtractShardSettings, extract_shard  # noqa: E402

settings = ExtractShardSettings.from_rule(snakemake.params.settings, snakemake.config)
lease_gpus(int(snakemake.resources.gpu), logger=log, job=f"extract_shard {snakemake.wildcards.shard}",
           record=LEASE_LOG, cpu_fallback=settings.gpu.cpu_fallback)  # sets CUDA_VISIBLE_DEVICES
torch.set_num_threads(int(snakemake.threads))
extract_shard(
    plan_path=snakemake.input.plan,
    tokenized_path=snakemake.input.train,
    target_dir=snakemake.input.target,
    manifest_path=snakemake.output[0],
    shard=int(snakemake.wildcards.shard),
    settings=settings,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
log_peak_memory(log)
