"""Entry point of rule merge_slice: verify one stream-mode slice's shards (coverage = exactly the slice's rows) and
write its index."""

from pathlib import Path

from draftsmith.io import setup_logging
from draftsmith.merge import MergeError, MergeSliceSettings, merge_features
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
# the rule has no params: merge reads runtime keys only (draftsmith.stages.STAGE_KEYS)
settings = MergeSliceSettings.from_rule({}, snakemake.config)
try:
    merge_features(
        plan_path=snakemake.input.plan,
        manifest_paths=[Path(shard) / "manifest.json" for shard in snakemake.input.shards],
        tokenized_path=snakemake.input.train,
        index_path=snakemake.output[0],
        settings=settings,
        threads=snakemake.threads,
        logger=log,
    )
except MergeError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
