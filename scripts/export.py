"""Entry point of rule export: results/drafter/trained -> results/drafter/final (z-lab DFlash format)."""

from pathlib import Path

from draftsmith.export import ExportSettings, export_drafter
from draftsmith.io import setup_logging

setup_logging(snakemake.log[0])  # noqa: F821 - injected by Snakemake
settings = ExportSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
export_drafter(
    trained_dir=Path(snakemake.input.config).parent,  # noqa: F821
    target_dir=snakemake.input.target,  # noqa: F821
    out_dir=Path(snakemake.output.config).parent,  # noqa: F821
    settings=settings,
)
