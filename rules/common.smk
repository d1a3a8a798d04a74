# Input functions and paths shared by the stage rule files.

import json
import os

from snakemake.logging import logger

from draftsmith.stages import canonical, rule_params, stage_config

ASSETS = config["assets"]["dir"]
EMBEDDED = "embedded:"


def all_cores(share=1, most=None):
    """Threads of a job that uses the cores Snakemake gives it: --cores / `share` jobs, at most `most`.

    Local runs give --cores (profiles/default: all); Snakemake caps every job at it anyway. A cluster run
    (profiles/slurm) is started without --cores: every job has its own allocation there, which the
    profile's set-threads names per rule (the executor asks SLURM for that many CPUs, and the job runs
    with as many threads), so this is only the fallback, 1, for a rule the profile does not name.
    (`threads: workflow.cores` failed such a run at parse time: "Workflow requires a total number of
    cores to be defined".)
    """
    cores = workflow.resource_settings.cores
    if cores is None:
        return 1
    return max(1, min(cores // max(1, share), most or cores))


onstart:
    # (the executor is known once the DAG is built, not at parse time)
    if workflow.non_local_exec and workflow.resource_settings.cores is not None:
        logger.warning(
            f"--cores {workflow.resource_settings.cores} with a cluster executor caps the threads of "
            "every job at that number, the cores of this login node; profiles/slurm sizes each job "
            "itself (set-threads): run it without --cores"
        )


def target_dir(wildcards=None):
    """The target's Hugging Face folder: materialised under resources/ for `embedded:` targets.

    Checked at parse time (draftsmith.assets.resolve_target): an unknown embedded name lists the known
    ones; a local path must be an existing Hugging Face model folder (the error names the path).
    """
    from draftsmith.assets import resolve_target

    model = config["target"]["model"]
    folder = resolve_target(model, ASSETS, must_exist=False)
    return str(folder) if model.startswith(EMBEDDED) else model


def source_path(source):
    """A data source's local path: unpacked under resources/data/ for `embedded:` datasets.

    Checked at parse time (draftsmith.assets.resolve_data_path): unknown embedded names and missing
    local paths fail with the source's name.
    """
    from draftsmith.assets import resolve_data_path

    path = source["path"]
    local = resolve_data_path(path, ASSETS, source=source.get("name"))
    return str(local) if path.startswith(EMBEDDED) else path


def curate_inputs(wildcards=None):
    """Every data source's path, embedded ones included (their fetch rules run first)."""
    return sorted({source_path(s) for s in config["data"]["sources"]})


def tokenize_train_input(wildcards=None):
    """Curated train conversations, or the target-regenerated ones when `regenerate.enabled`."""
    if config["regenerate"]["enabled"]:
        return "results/regenerated/train.parquet"
    return "results/curated/train.parquet"


SHARDS = list(range(config["extract"]["shards"]))


def shard_manifests(wildcards=None):
    return [f"results/features/shard-{i}/manifest.json" for i in SHARDS]


REGENERATE_SHARDS = list(range(config["regenerate"]["shards"]))


def regenerated_shards(wildcards=None):
    """The regenerate_shard outputs, shard 0 first (the order the regenerate rule assembles them in)."""
    return [f"results/regenerated/shard-{i}.parquet" for i in REGENERATE_SHARDS]


def known_dataset(wildcards):
    """No file inputs; raises at DAG-build time for an unknown dataset, listing the known ones."""
    from draftsmith.assets import dataset_spec

    dataset_spec(wildcards.dataset)
    return []


def known_target(wildcards):
    """No file inputs; raises at DAG-build time for an unknown target, listing the known ones."""
    from draftsmith.assets import target_spec

    target_spec(wildcards.target)
    return []


def _known_shard(key, shards, output):
    """An input function with no file inputs that raises at DAG-build time for a shard outside `key`'s range
    (naming the output and the key): shard-3 of a 2-shard config would otherwise fail only after the jobs
    before it had run."""

    def check(wildcards):
        if int(wildcards.shard) not in shards:
            raise ValueError(
                f"{output.format(shard=wildcards.shard)}: {key} is {len(shards)}, so the shards are "
                f"{shards[0]}..{shards[-1]}"
            )
        return []

    return check


known_shard = _known_shard("extract.shards", SHARDS, "results/features/shard-{shard}/manifest.json")
known_regenerate_shard = _known_shard(
    "regenerate.shards", REGENERATE_SHARDS, "results/regenerated/shard-{shard}.parquet"
)
