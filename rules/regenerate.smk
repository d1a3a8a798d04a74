# regenerate (optional): the target answers the training prompts itself, greedy, so the drafter
# learns the target's own distribution.


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
        regenerate=config["regenerate"],
        target=config["target"],
        chat_template_kwargs=config["tokenize"]["chat_template_kwargs"],
    threads: workflow.cores
    resources:
        gpu=config["regenerate"]["gpus"],
    script:
        "../scripts/regenerate.py"
