"""Entry point of rule regenerate: the regenerate_shard outputs, in shard order, assembled into one parquet
(draftsmith.regenerate.shards.assemble_shards: shards of one run only, their part ranges contiguous, counts
summed)."""

from draftsmith.io import setup_logging
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = RegenerateSettings.from_rule(snakemake.params.settings, snakemake.config)

# the stage (pyarrow, torch) once the job's log is set up: an import failure lands in the log
from draftsmith.regenerate.report import summary  # noqa: E402
from draftsmith.regenerate.shards import assemble_shards  # noqa: E402

shards = list(snakemake.input.shards)
if len(shards) != settings.regenerate.shards:
    raise ValueError(f"{snakemake.output[0]}: {len(shards)} shard inputs for regenerate.shards = "
                     f"{settings.regenerate.shards}")
report = assemble_shards(shards, snakemake.output[0])
log.info("assembled %s: %s", snakemake.output[0], summary(report))
