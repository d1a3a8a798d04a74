"""Entry point of rule merge: verify the extraction shards and write results/features/index.json."""

from draftsmith.io import setup_logging
from draftsmith.merge import MergeError, merge_features
from draftsmith.stages import stage_config

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)
try:
    merge_features(
        plan_path=snakemake.input.plan,  # noqa: F821
        manifest_paths=list(snakemake.input.manifests),  # noqa: F821
        tokenized_path=snakemake.input.train,  # noqa: F821
        index_path=snakemake.output[0],  # noqa: F821
        verify_sha256=stage_config("merge", {}, snakemake.config)["merge"]["verify_sha256"],  # noqa: F821
        threads=snakemake.threads,  # noqa: F821
        logger=log,
    )
except MergeError as exc:
    log.error("%s", exc)
    raise SystemExit(1) from None
