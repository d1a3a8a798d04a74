"""Entry point of rule export: results/drafter/trained -> results/drafter/final (z-lab DFlash format)."""

from pathlib import Path

from draftsmith.export import ExportSettings, export_drafter
from draftsmith.io import setup_logging
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = ExportSettings.from_rule(snakemake.params.settings, snakemake.config)
export_drafter(
    trained_dir=Path(snakemake.input.config).parent,
    target_dir=snakemake.input.target,
    out_dir=Path(snakemake.output.config).parent,
    settings=settings,
)
