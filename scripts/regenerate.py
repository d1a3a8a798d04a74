"""Entry point of rule regenerate: the regenerate_shard outputs, in shard order, assembled into one parquet
(draftsmith.regenerate.assemble_shards: shards of one run only, their part ranges contiguous, counts summed)."""

from draftsmith.io import setup_logging
from draftsmith.stages import stage_config

log = setup_logging(snakemake.log[0])  # noqa: F821
cfg = stage_config("regenerate", snakemake.params.settings, snakemake.config)["regenerate"]  # noqa: F821

from draftsmith.regenerate import assemble_shards, summary  # noqa: E402

shards = list(snakemake.input.shards)  # noqa: F821
if len(shards) != cfg["shards"]:
    raise ValueError(f"{snakemake.output[0]}: {len(shards)} shard inputs for regenerate.shards = {cfg['shards']}")  # noqa: F821
report = assemble_shards(shards, snakemake.output[0])  # noqa: F821
log.info("assembled %s: %s", snakemake.output[0], summary(report))  # noqa: F821
