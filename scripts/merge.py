"""Entry point of rule merge: verify the extraction shards and write results/features/index.json."""

from draftsmith.io import setup_logging
from draftsmith.merge import MergeError, MergeSettings, merge_features
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
# the rule has no params: merge reads runtime keys only (draftsmith.stages.STAGE_KEYS)
settings = MergeSettings.from_rule({}, snakemake.config)
try:
    merge_features(
        plan_path=snakemake.input.plan,
        manifest_paths=list(snakemake.input.manifests),
        tokenized_path=snakemake.input.train,
        index_path=snakemake.output[0],
        settings=settings,
        threads=snakemake.threads,
        logger=log,
    )
except MergeError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
