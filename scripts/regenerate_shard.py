"""Entry point of rule regenerate_shard: the target answers one shard of the training prompts itself
(draftsmith.regenerate.run.run; resumable: finished parts are kept beside the shard's output).

Leases regenerate.gpus GPUs from the node pool before CUDA starts (one process runs on the first).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory  # noqa: E402
from draftsmith.io import setup_logging  # noqa: E402
from draftsmith.regenerate.settings import RegenerateShardSettings  # noqa: E402

log = setup_logging(snakemake.log[0])  # noqa: F821
settings = RegenerateShardSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
shard = int(snakemake.wildcards.shard)  # noqa: F821
devices = lease_gpus(int(snakemake.resources.gpu), logger=log, job=f"regenerate shard {shard}",  # noqa: F821
                     record=LEASE_LOG)  # sets CUDA_VISIBLE_DEVICES

import torch  # noqa: E402

from draftsmith.regenerate.run import run  # noqa: E402

torch.set_num_threads(int(snakemake.threads))  # noqa: F821
if len(devices) > 1:
    log.warning("a regenerate shard runs one process on one GPU; %d GPUs were leased (set regenerate.gpus: 1 and "
                "regenerate.shards to the GPUs)", len(devices))
run(
    conversations=snakemake.input.conversations,  # noqa: F821
    target_dir=snakemake.input.target,  # noqa: F821
    output=snakemake.output[0],  # noqa: F821
    settings=settings,
    shard=shard,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
log_peak_memory(log)
