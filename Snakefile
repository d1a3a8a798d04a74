# draftsmith: train DFlash speculative-decoding drafters for Hugging Face causal LMs.
# Thin on purpose: configuration, validation, the stage rule files, and the final target.
# Stages (rules/<stage>.smk, scripts/<rule>.py, draftsmith/<stage>.py):
#   assets -> curate -> [disk_plan -> regenerate] -> tokenize -> extract_plan -> extract_shard x N -> merge -> train
#   -> export -> evaluate
# With stream.slices > 1 (docs/stream.md): tokenize -> stream_plan -> per phase (extract_slice x N -> merge_slice ->
#   train_phase) -> train -> export -> evaluate, extract_heldout once.

import os
import sys

from snakemake.utils import min_version

# The library and the stage scripts import `draftsmith` from this checkout, installed or not.
sys.path.insert(0, workflow.basedir)
# (Set here, not required from the user: hence no `envvars:` declaration.)
os.environ.update(PYTHONPATH=os.pathsep.join(filter(None, [workflow.basedir, os.environ.get("PYTHONPATH")])))

from snakemake.logging import logger

from draftsmith.config import check_config, check_config_files
from draftsmith.warm_start import overlay_keys

min_version("9.0")


configfile: "config.yaml"


check_config_files(workflow.configfiles)
# the keys the user set, with the file that set each (--configfile files, --config; config.yaml's are defaults): a
# start drafter (drafter.init_from) must not contradict them, and gives its own shape to the others; errors about a
# key's value name that file
USER_KEYS = overlay_keys(
    workflow.config_settings.configfiles, workflow.config_settings.config, f"{workflow.basedir}/config.yaml"
)
for note in check_config(config, f"{workflow.basedir}/schemas/config.schema.yaml", USER_KEYS):
    logger.info(note)


include: "rules/common.smk"
include: "rules/assets.smk"
include: "rules/curate.smk"
include: "rules/regenerate.smk"
include: "rules/stream.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/merge.smk"
include: "rules/train.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        "results/eval/report.json",
        "results/eval/report.md",
