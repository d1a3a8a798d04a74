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
    conda:
        "../envs/draftsmith.yaml"
    params:
        settings=rule_params(config, "extract_plan"),
    script:
        "../scripts/extract_plan.py"


rule extract_shard:
    input:
        known_shard,
        plan="results/features/plan.json",
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        "results/features/shard-{shard}/manifest.json",
    log:
        "logs/extract_shard/shard-{shard}.log",
    benchmark:
        "benchmarks/extract_shard/shard-{shard}.tsv"
    wildcard_constraints:
        shard=r"\d+",
    conda:
        "../envs/draftsmith.yaml"
    threads: gpu_threads("extract_shard", 1, share=len(SHARDS))
    resources:
        **gpu_resources("extract_shard", 1),
    params:
        settings=rule_params(config, "extract_shard"),
    script:
        "../scripts/extract_shard.py"


# Stream mode (stream.slices > 1): the held-out samples once (kept), then each phase's slice, one job per shard,
# written in results/stream/.staging/ and renamed into place when complete (a killed job resumes from its staged
# chunks; Snakemake deletes a failed job's directory output). The slice is temp: gone once its phase succeeded.


rule extract_heldout:
    input:
        plan="results/stream/plans/heldout.json",
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        directory("results/stream/heldout"),
    log:
        "logs/extract_heldout/extract_heldout.log",
    benchmark:
        "benchmarks/extract_heldout/extract_heldout.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: gpu_threads("extract_heldout", 1, share=len(SHARDS))
    resources:
        **gpu_resources("extract_heldout", 1),
    params:
        settings=rule_params(config, "extract_heldout"),
    script:
        "../scripts/extract_heldout.py"


rule extract_slice:
    input:
        disk_token,
        plan="results/stream/plans/phase-{phase}.json",
        train="results/tokenized/train.parquet",
        target=target_dir(),
    output:
        temp(directory("results/stream/phase-{phase}/shard-{shard}")),
    log:
        "logs/extract_slice/phase-{phase}/shard-{shard}.log",
    benchmark:
        "benchmarks/extract_slice/phase-{phase}/shard-{shard}.tsv"
    wildcard_constraints:
        phase=r"\d+",
        shard=r"\d+",
    conda:
        "../envs/draftsmith.yaml"
    threads: gpu_threads("extract_slice", 1, share=len(SHARDS))
    resources:
        **gpu_resources("extract_slice", 1),
    params:
        settings=rule_params(config, "extract_slice"),
    script:
        "../scripts/extract_slice.py"
