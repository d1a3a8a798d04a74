# regenerate (optional): the target answers the training prompts itself, greedy, so the drafter
# learns the target's own distribution. Turn by turn (later prompts hold the target's own earlier
# answers); tool-call turns are kept. regenerate.shards jobs, each with its own GPU lease, over
# contiguous ranges of the conversation parts (regenerate.chunk_size each); the regenerate rule
# assembles them in order (row for row a one-job run's output). Resumable: a shard's finished parts
# are kept beside its output (results/regenerated/shard-{shard}.parquet.parts/) until it is written,
# and a rerun with another regenerate.shards takes the finished parts from the old shards' folders.


rule regenerate_shard:
    input:
        known_regenerate_shard,
        # the disk check before any GPU hour (ancient: a rerun of the check never reruns regeneration)
        disk=ancient("results/stream/disk-plan.json"),
        conversations="results/curated/train.parquet",
        target=target_dir(),
        tokenizer=target_tokenizer_files(),
    output:
        "results/regenerated/shard-{shard}.parquet",
    log:
        "logs/regenerate_shard/shard-{shard}.log",
    benchmark:
        "benchmarks/regenerate_shard/shard-{shard}.tsv"
    wildcard_constraints:
        shard=r"\d+",
    conda:
        "../envs/draftsmith.yaml"
    threads: gpu_threads("regenerate_shard", config["regenerate"]["gpus"], share=len(REGENERATE_SHARDS))
    resources:
        **gpu_resources("regenerate_shard", config["regenerate"]["gpus"]),
    params:
        settings=rule_params(config, "regenerate_shard"),
    script:
        "../scripts/regenerate_shard.py"


rule regenerate:
    input:
        shards=regenerated_shards(),
    output:
        "results/regenerated/train.parquet",
    log:
        "logs/regenerate/regenerate.log",
    benchmark:
        "benchmarks/regenerate/regenerate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    params:
        settings=rule_params(config, "regenerate"),
    script:
        "../scripts/regenerate.py"
