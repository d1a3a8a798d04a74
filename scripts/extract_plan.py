"""Entry point of rule extract_plan: shards balanced by tokens and the target layer ids -> plan.json.

Thin: the work is draftsmith.extract.build_plan (see its docstring for the plan format).
"""

from draftsmith.io import setup_logging, write_json

log = setup_logging(snakemake.log[0])  # noqa: F821 (snakemake is injected by the script directive)

from draftsmith.extract import build_plan  # noqa: E402

plan = build_plan(
    snakemake.input.train,  # noqa: F821
    snakemake.input.target,  # noqa: F821
    num_shards=int(snakemake.params.extract["shards"]),  # noqa: F821
    drafter_cfg=snakemake.params.drafter,  # noqa: F821
    extract_cfg=snakemake.params.extract,  # noqa: F821
    trust_remote_code=bool(snakemake.params.target.get("trust_remote_code", False)),  # noqa: F821
)
write_json(snakemake.output[0], plan)  # noqa: F821
