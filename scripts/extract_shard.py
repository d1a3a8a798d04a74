"""Entry point of rule extract_shard: one shard of target hidden states -> chunk files + manifest.json.

Thin: leases one GPU from the node pool before CUDA starts, then draftsmith.extract.shard.extract_shard
(resumable: finished chunks recorded in progress.json beside the manifest are kept).
"""

from draftsmith.io import setup_logging

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory  # noqa: E402

lease_gpus(int(snakemake.resources.gpu), logger=log, job=f"extract_shard {snakemake.wildcards.shard}",  # noqa: F821
           record=LEASE_LOG)  # sets CUDA_VISIBLE_DEVICES

import torch  # noqa: E402

torch.set_num_threads(int(snakemake.threads))  # noqa: F821

from draftsmith.extract.shard import ExtractShardSettings, extract_shard  # noqa: E402

settings = ExtractShardSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
extract_shard(
    plan_path=snakemake.input.plan,  # noqa: F821
    tokenized_path=snakemake.input.train,  # noqa: F821
    target_dir=snakemake.input.target,  # noqa: F821
    manifest_path=snakemake.output[0],  # noqa: F821
    shard=int(snakemake.wildcards.shard),  # noqa: F821
    settings=settings,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
log_peak_memory(log)
