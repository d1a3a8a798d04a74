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
        regenerate=config["regenerate"],
        target=config["target"],
        chat_template_kwargs=config["tokenize"]["chat_template_kwargs"],
        # a prompt this long leaves no answer token inside a training row
        max_prompt_tokens=config["tokenize"]["max_length"],
    threads: all_cores()
    resources:
        gpu=config["regenerate"]["gpus"],
    script:
        "../scripts/regenerate.py"
