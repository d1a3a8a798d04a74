"""Entry point of rule regenerate_shard: the target answers one shard of the training prompts itself
(draftsmith.regenerate.run.run; resumable: finished parts are kept beside the shard's output).

Leases regenerate.gpus GPUs from the node pool before CUDA starts (one process runs on the first).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftsmith.gpu import LEASE_LOG, lease_gpus, log_peak_memory
from draftsmith.io import setup_logging
from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = RegenerateShardSettings.from_rule(snakemake.params.settings, snakemake.config)
shard = int(snakemake.wildcards.shard)
devices = lease_gpus(int(snakemake.resources.gpu), logger=log, job=f"regenerate shard {shard}", record=LEASE_LOG,
                     cpu_fallback=settings.gpu.cpu_fallback, gpus_key="regenerate.gpus")  # sets CUDA_VISIBLE_DEVICES

# torch and the stage after the lease, so that CUDA starts on the leased GPUs only
import torch  # noqa: E402

from draftsmith.regenerate.run import run  # noqa: E402

torch.set_num_threads(int(snakemake.threads))
if len(devices) > 1:
    log.warning("a regenerate shard runs one process on one GPU; %d GPUs were leased (set regenerate.gpus: 1 and "
                "regenerate.shards to the GPUs)", len(devices))
run(
    conversations=snakemake.input.conversations,
    target_dir=snakemake.input.target,
    output=snakemake.output[0],
    settings=settings,
    shard=shard,
    device="cuda" if torch.cuda.is_available() else "cpu",
)
log_peak_memory(log)
