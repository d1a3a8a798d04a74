# train: the DFlash drafter, torchrun DDP with one process per leased GPU ({resources.gpu}).
# Checkpoints live in results/drafter/checkpoints/ (not a declared output) so a rerun resumes.
# scripts/train.py leases the GPUs and runs torchrun; output goes to the console (progress: step, rate, ETA)
# and to the log.


rule train:
    input:
        index="results/features/index.json",
        target=target_dir(),
    output:
        weights="results/drafter/trained/model.safetensors",
        config="results/drafter/trained/config.json",
        state="results/drafter/trained/trainer_state.json",
    log:
        "logs/train/train.log",
    benchmark:
        "benchmarks/train/train.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: all_cores()
    resources:
        gpu=config["train"]["gpus"],
    params:
        settings=rule_params(config, "train"),
    script:
        "../scripts/train.py"
