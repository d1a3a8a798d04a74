"""Entry point of rule curate: mix every configured source into results/curated/ (see draftsmith.curate)."""

from draftsmith.curate import CurateSettings, curate
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = CurateSettings.from_rule(snakemake.params.settings, snakemake.config)
report = curate(
    snakemake.params.sources,  # config entries with the resolved local_path
    snakemake.output.train,
    snakemake.output.eval,
    snakemake.output.report,
    settings,
)
t = report["totals"]
log.info("curated: read %d, kept %d (train %d, eval %d, +%d repeats), dropped %d %s",
         t["read"], t["kept"], t["train"], t["eval"], t["repeats"], t["dropped_total"], t["dropped"])
