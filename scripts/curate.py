"""Entry point of rule curate: mix every configured source into results/curated/ (see draftsmith.curate)."""

from draftsmith.curate import curate
from draftsmith.io import setup_logging
from draftsmith.stages import stage_config

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)
data = stage_config("curate", snakemake.params.settings, snakemake.config)["data"]  # noqa: F821
report = curate(
    snakemake.params.sources,  # noqa: F821 (config entries with the resolved local_path)
    snakemake.output.train,  # noqa: F821
    snakemake.output.eval,  # noqa: F821
    snakemake.output.report,  # noqa: F821
    seed=data["seed"],
    eval_fraction=data["eval_fraction"],
    max_chars=data.get("max_chars"),
)
t = report["totals"]
log.info("curated: read %d, kept %d (train %d, eval %d, +%d repeats), dropped %d %s",
         t["read"], t["kept"], t["train"], t["eval"], t["repeats"], t["dropped_total"], t["dropped"])
