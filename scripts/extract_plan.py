"""Entry point of rule extract_plan: shards balanced by tokens and the target layer ids -> plan.json.

Thin: the work is draftsmith.extract.plan.build_plan (see its docstring for the plan format).
"""

from draftsmith.io import setup_logging, write_json

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from draftsmith.extract.plan import ExtractPlanSettings, build_plan  # noqa: E402

settings = ExtractPlanSettings.from_rule(snakemake.params.settings, snakemake.config)  # noqa: F821
plan = build_plan(snakemake.input.train, snakemake.input.target, settings)  # noqa: F821
write_json(snakemake.output[0], plan)  # noqa: F821
