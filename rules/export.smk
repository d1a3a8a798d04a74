# export: the trained drafter in the z-lab DFlash format (loads in `dflash`, vLLM and SGLang).


rule export:
    input:
        weights="results/drafter/trained/model.safetensors",
        config="results/drafter/trained/config.json",
        target=target_dir(),
    output:
        config="results/drafter/final/config.json",
        weights="results/drafter/final/model.safetensors",
    log:
        "logs/export/export.log",
    benchmark:
        "benchmarks/export/export.tsv"
    conda:
        "../envs/draftsmith.yaml"
    params:
        settings=rule_params(config, "export"),
    script:
        "../scripts/export.py"
