"""Entry point of rule merge: verify the extraction shards and write results/features/index.json."""

from draftsmith.io import setup_logging
from draftsmith.merge import MergeError, MergeSettings, merge_features

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)
# the rule has no params: merge reads runtime keys only (draftsmith.stages.STAGE_KEYS)
settings = MergeSettings.from_rule({}, snakemake.config)  # noqa: F821
try:
    merge_features(
        plan_path=snakemake.input.plan,  # noqa: F821
        manifest_paths=list(snakemake.input.manifests),  # noqa: F821
        tokenized_path=snakemake.input.train,  # noqa: F821
        index_path=snakemake.output[0],  # noqa: F821
        settings=settings,
        threads=snakemake.threads,  # noqa: F821
        logger=log,
    )
except MergeError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
