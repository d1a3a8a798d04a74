# regenerate (optional): the target answers the training prompts itself, greedy, so the drafter
# learns the target's own distribution. Turn by turn (later prompts hold the target's own earlier
# answers); tool-call turns are kept. Resumable: finished parts are kept beside the output
# (results/regenerated/train.parquet.parts/) until the output is assembled.


rule regenerate:
    input:
        conversations="results/curated/train.parquet",
        target=target_dir(),
    output:
        "results/regenerated/train.parquet",
    log:
        "logs/regenerate/regenerate.log",
    benchmark:
        "benchmarks/regenerate/regenerate.tsv"
    params:
        settings=rule_params(config, "regenerate"),
    threads: all_cores()
    resources:
        gpu=config["regenerate"]["gpus"],
    conda:
        "../envs/draftsmith.yaml"
    script:
        "../scripts/regenerate.py"
