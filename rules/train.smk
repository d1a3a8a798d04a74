# train: the DFlash drafter, torchrun DDP with one process per leased GPU ({resources.gpu}).
# Checkpoints live in results/drafter/checkpoints/ (not a declared output) so a killed run resumes; a finished
# run whose outputs Snakemake removed to rerun it (--forcerun, changed inputs) trains again (train/checkpoint.py).
# scripts/train.py leases the GPUs and runs torchrun; output goes to the console (progress: step, rate, ETA)
# and to the log. In stream mode (stream.slices > 1, docs/stream.md) train_phase trains one phase of the global plan
# on its slice (resuming from the previous phase's last checkpoint), and train ends the run: the final held-out
# metrics and trained/, as offline. With drafter.init_from the drafter starts from that folder (its files are inputs:
# a changed start retrains).


if STREAM:

    rule train_phase:
        input:
            index="results/stream/phase-{phase}/index.json",
            # the slice's shards: read through the index; inputs, so temp() keeps them until the phase succeeded
            shards=phase_shards,
            heldout="results/stream/heldout",
            train="results/tokenized/train.parquet",
            plan="results/stream/plan.json",
            target=target_dir(),
            previous=previous_phase,
            start=init_from_files(),
        output:
            marker="results/drafter/phases/phase-{phase}.json",
        log:
            "logs/train_phase/phase-{phase}.log",
        benchmark:
            "benchmarks/train_phase/phase-{phase}.tsv"
        wildcard_constraints:
            phase=r"\d+",
        conda:
            "../envs/draftsmith.yaml"
        threads: gpu_threads("train_phase", config["train"]["gpus"])
        resources:
            **gpu_resources("train_phase", config["train"]["gpus"]),
        params:
            settings=rule_params(config, "train_phase"),
        script:
            "../scripts/train_phase.py"

    rule train:
        input:
            marker=phase_marker(PHASES[-1]),
            heldout="results/stream/heldout",
            train="results/tokenized/train.parquet",
            target=target_dir(),
            start=init_from_files(),
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
        threads: gpu_threads("train", config["train"]["gpus"])
        resources:
            **gpu_resources("train", config["train"]["gpus"]),
        params:
            settings=rule_params(config, "train"),
        script:
            "../scripts/train.py"

else:

    rule train:
        input:
            index="results/features/index.json",
            target=target_dir(),
            start=init_from_files(),
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
        threads: gpu_threads("train", config["train"]["gpus"])
        resources:
            **gpu_resources("train", config["train"]["gpus"]),
        params:
            settings=rule_params(config, "train"),
        script:
            "../scripts/train.py"
