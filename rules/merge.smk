# merge: one verified index over all extraction shards (draftsmith/merge.py). Reads the manifests and
# the chunk files' safetensors headers (sha256 of every byte only with merge.verify_sha256), checks that
# the shards hold every tokenized train row exactly once with consistent metadata, and fails naming
# shard, chunk and sample otherwise.


rule merge:
    input:
        manifests=shard_manifests,
        plan="results/features/plan.json",
        train="results/tokenized/train.parquet",
    output:
        "results/features/index.json",
    log:
        "logs/merge/merge.log",
    benchmark:
        "benchmarks/merge/merge.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: all_cores(most=8)
    script:
        "../scripts/merge.py"


# Stream mode: one slice's index (coverage = exactly the slice's rows); temp, like the slice.


rule merge_slice:
    input:
        shards=phase_shards,
        plan="results/stream/plans/phase-{phase}.json",
        train="results/tokenized/train.parquet",
    output:
        temp("results/stream/phase-{phase}/index.json"),
    log:
        "logs/merge_slice/phase-{phase}.log",
    benchmark:
        "benchmarks/merge_slice/phase-{phase}.tsv"
    wildcard_constraints:
        phase=r"\d+",
    conda:
        "../envs/draftsmith.yaml"
    threads: all_cores(most=8)
    script:
        "../scripts/merge_slice.py"
