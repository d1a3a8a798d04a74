# evaluate: real speculative decoding with the target: acceptance length, speedup, losslessness.


rule evaluate:
    input:
        drafter="results/drafter/final/config.json",
        target=target_dir(),
        eval="results/curated/eval.parquet",
        tokenized="results/tokenized/eval.parquet",
    output:
        json="results/eval/report.json",
        md=report("results/eval/report.md", category="Evaluation"),
        tau=report("results/eval/tau.png", category="Evaluation"),
        positions=report("results/eval/per_position.png", category="Evaluation"),
        histogram=report("results/eval/acceptance_hist.png", category="Evaluation"),
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    params:
        evaluate=config["evaluate"],
        target=config["target"],
    threads: workflow.cores
    resources:
        gpu=config["evaluate"]["gpus"],
    script:
        "../scripts/evaluate.py"
