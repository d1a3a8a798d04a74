# evaluate: real speculative decoding with the target: acceptance length, speedup, losslessness.
# Library: draftsmith/evaluate/ (decode loops, exact GDN rollback, sets, report). One GPU (leased).

from draftsmith.config import check_eval_sets

# A set whose source the eval split cannot hold (a typo, a split: train source) stops Snakemake here,
# not when evaluate starts after the whole DAG.
check_eval_sets(config["evaluate"], config["data"]["sources"])


rule evaluate:
    input:
        drafter="results/drafter/final/config.json",
        weights="results/drafter/final/model.safetensors",
        target=target_dir(),
        tokenizer=target_tokenizer_files(),
        eval="results/curated/eval.parquet",
        tokenized="results/tokenized/eval.parquet",
        trainer_state="results/drafter/trained/trainer_state.json",
        start=init_from_files(),
    output:
        json="results/eval/report.json",
        md=report("results/eval/report.md", category="Evaluation", labels={"figure": "report (tables)"}),
        tau=report(
            "results/eval/tau.png",
            category="Evaluation",
            labels={"figure": "acceptance length per set (DFlash vs prompt lookup)"},
        ),
        positions=report(
            "results/eval/per_position.png", category="Evaluation", labels={"figure": "per-position acceptance"}
        ),
        histogram=report(
            "results/eval/acceptance_hist.png", category="Evaluation", labels={"figure": "acceptance-length histogram"}
        ),
    log:
        "logs/evaluate/evaluate.log",
    benchmark:
        "benchmarks/evaluate/evaluate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: gpu_threads("evaluate", config["evaluate"]["gpus"])
    resources:
        **gpu_resources("evaluate", config["evaluate"]["gpus"]),
    params:
        settings=rule_params(config, "evaluate"),
        sources=canonical(config["data"]["sources"]),
    script:
        "../scripts/evaluate.py"
