# draftsmith: train DFlash speculative-decoding drafters for Hugging Face causal LMs.
# Thin on purpose: configuration, validation, the stage rule files, and the final target.
# Stages (rules/<stage>.smk, scripts/<rule>.py, draftsmith/<stage>.py):
#   assets -> curate -> [regenerate] -> tokenize -> extract_shard x N -> merge -> train -> export -> evaluate

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


validate(config, "schemas/config.schema.yaml")


include: "rules/common.smk"
include: "rules/assets.smk"
include: "rules/curate.smk"
include: "rules/regenerate.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/merge.smk"
include: "rules/train.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"


rule all:
    input:
        "results/eval/report.json",
        "results/eval/report.md",
    default_target: True
