"""Entry point of rule extract_plan: shards balanced by tokens and the target layer ids -> plan.json.

Thin: the work is draftsmith.extract.plan.build_plan (see its docstring for the plan format).
"""

from pathlib import Path

from draftsmith.io import setup_logging, write_json
from draftsmith.stale import invalidate_consumers

log = setup_logging(snakemake.log[0])
invalidate_consumers(snakemake.output, log)  # first: what was made from this job's old outputs goes

# the stage (torch, transformers) once the job's log is set up: an import failure lands in the log
from draftsmith.extract.plan import ExtractPlanSettings, build_plan  # noqa: E402

settings = ExtractPlanSettings.from_rule(snakemake.params.settings, snakemake.config)
# the disk is measured where the bytes go: the features beside the plan (results/features), the checkpoints and the
# trained drafter under results/drafter
features = Path(snakemake.output[0]).parent
plan = build_plan(snakemake.input.train, snakemake.input.target, settings, features_dir=features,
                  drafter_dir=features.parent / "drafter", results_dir=features.parent)
write_json(snakemake.output[0], plan)
