"""Entry point of rule extract_plan: shards balanced by tokens and the target layer ids -> plan.json.

Thin: the work is draftsmith.extract.build_plan (see its docstring for the plan format).
"""

from draftsmith.io import setup_logging, write_json
from draftsmith.stages import stage_config

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)
cfg = stage_config("extract_plan", snakemake.params.settings, snakemake.config)  # noqa: F821

from draftsmith.extract import build_plan  # noqa: E402

plan = build_plan(
    snakemake.input.train,  # noqa: F821
    snakemake.input.target,  # noqa: F821
    num_shards=int(cfg["extract"]["shards"]),
    drafter_cfg=cfg["drafter"],
    extract_cfg=cfg["extract"],
    trust_remote_code=bool(cfg["target"]["trust_remote_code"]),
)
write_json(snakemake.output[0], plan)  # noqa: F821
