# extract: the target's hidden states at the DFlash target layer ids, one shard job per GPU.
# Only manifest.json is a declared output: chunk files beside it survive a failed job, so a rerun
# resumes from the finished chunks (Snakemake would delete a whole directory() output).


rule extract_plan:
    input:
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        "results/features/plan.json",
    log:
        "logs/extract_plan/extract_plan.log",
    benchmark:
        "benchmarks/extract_plan/extract_plan.tsv"
    params:
        extract=config["extract"],
        drafter=config["drafter"],
        target=config["target"],
    script:
        "../scripts/extract_plan.py"


def _known_shard(wildcards):
    """No file inputs; raises at DAG-build time for a shard outside extract.shards (shard-3 of a 2-shard
    config would otherwise fail only after curate, tokenize and the plan had run)."""
    if int(wildcards.shard) not in SHARDS:
        raise ValueError(f"results/features/shard-{wildcards.shard}/manifest.json: extract.shards is "
                         f"{len(SHARDS)}, so the shards are {SHARDS[0]}..{SHARDS[-1]}")
    return []


rule extract_shard:
    input:
        _known_shard,
        plan="results/features/plan.json",
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        "results/features/shard-{shard}/manifest.json",
    log:
        "logs/extract_shard/shard-{shard}.log",
    benchmark:
        "benchmarks/extract_shard/shard-{shard}.tsv"
    params:
        extract=config["extract"],
        target=config["target"],
    wildcard_constraints:
        shard=r"\d+",
    threads: all_cores(share=len(SHARDS))
    resources:
        gpu=1,
    script:
        "../scripts/extract_shard.py"
