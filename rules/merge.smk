# merge: one verified index over all extraction shards.


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
    script:
        "../scripts/merge.py"
