# curate: mix every configured source into one clean chat dataset, with a reconciled report.

from draftsmith.curate import check_sources

# Source configuration mistakes (unknown adapter options, a prompt-only source outside the eval
# split, a name used twice, bad columns) stop Snakemake here, before anything runs.
check_sources(config["data"]["sources"])


rule curate:
    input:
        curate_inputs,
    output:
        train="results/curated/train.parquet",
        eval="results/curated/eval.parquet",
        report="results/curated/report.json",
    log:
        "logs/curate/curate.log",
    benchmark:
        "benchmarks/curate/curate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    params:
        settings=rule_params(config, "curate"),
        sources=canonical([dict(s, local_path=source_path(s)) for s in config["data"]["sources"]]),
    script:
        "../scripts/curate.py"
