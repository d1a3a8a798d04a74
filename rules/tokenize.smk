# tokenize: the target's own chat template, token-exact assistant-only loss masks.


rule tokenize:
    input:
        train=tokenize_train_input,
        eval="results/curated/eval.parquet",
        target=target_dir(),
        tokenizer=target_tokenizer_files(),
    output:
        train="results/tokenized/train.parquet",
        eval="results/tokenized/eval.parquet",
        report="results/tokenized/report.json",
    log:
        "logs/tokenize/tokenize.log",
    benchmark:
        "benchmarks/tokenize/tokenize.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["tokenize"]["threads"]
    params:
        settings=rule_params(config, "tokenize"),
    script:
        "../scripts/tokenize.py"
