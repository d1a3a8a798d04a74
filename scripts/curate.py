"""Entry point of rule curate: mix every configured source into results/curated/ (see draftsmith.curate)."""

from draftsmith.curate import CurateSettings, curate
from draftsmith.io import setup_logging

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)
settings = CurateSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
report = curate(
    snakemake.params.sources,  # noqa: F821 (config entries with the resolved local_path)
    snakemake.output.train,  # noqa: F821
    snakemake.output.eval,  # noqa: F821
    snakemake.output.report,  # noqa: F821
    settings,
)
t = report["totals"]
log.info("curated: read %d, kept %d (train %d, eval %d, +%d repeats), dropped %d %s",
         t["read"], t["kept"], t["train"], t["eval"], t["repeats"], t["dropped_total"], t["dropped"])
