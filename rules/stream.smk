# stream: the disk checked before regeneration, and the global plan of a run trained in slices (draftsmith/stream.py,
# docs/stream.md). disk_plan projects an upper bound of the features from the curated conversations and refuses a
# run the disk cannot hold before the target regenerates anything; it only checks (its keys are runtime keys).
# stream_plan (stream.slices > 1) cuts the global batch plan into phases and writes each slice's extraction plan.


rule disk_plan:
    input:
        conversations="results/curated/train.parquet",
        target=target_dir(),
    output:
        "results/stream/disk-plan.json",
    log:
        "logs/disk_plan/disk_plan.log",
    benchmark:
        "benchmarks/disk_plan/disk_plan.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: all_cores(most=8)
    script:
        "../scripts/disk_plan.py"


rule stream_plan:
    input:
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        plan="results/stream/plan.json",
        phases=expand("results/stream/plans/phase-{phase}.json", phase=PHASES),
        heldout="results/stream/plans/heldout.json",
    log:
        "logs/stream_plan/stream_plan.log",
    benchmark:
        "benchmarks/stream_plan/stream_plan.tsv"
    conda:
        "../envs/draftsmith.yaml"
    params:
        settings=rule_params(config, "stream_plan"),
    script:
        "../scripts/stream_plan.py"
