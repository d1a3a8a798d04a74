# train: the DFlash drafter, torchrun DDP with one process per leased GPU ({resources.gpu}).
# Checkpoints live in results/drafter/checkpoints/ (not a declared output) so a rerun resumes.
# Output goes to the console (progress: step, rate, ETA) and to the log (tee; the shell's pipefail keeps the
# exit status of training).


# Run by path from the shell (torchrun needs a file), not listed as an input: an input path outside the
# working directory is absolute, and moving or copying the project folder would then rerun training.
TRAIN_SCRIPT = os.path.join(workflow.basedir, "scripts", "train.py")


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
    params:
        args=lambda wildcards: json.dumps(
            {"train": config["train"], "drafter": config["drafter"], "target": config["target"]}
        ),
        # torchrun processes: one per leased GPU, one on the CPU when no GPU is asked for
        nproc=lambda wildcards, resources: max(1, int(resources.gpu)),
    threads: all_cores()
    resources:
        gpu=config["train"]["gpus"],
    shell:
        "{GPU_LEASE} {resources.gpu} -- {PYTHON} -m torch.distributed.run --standalone"
        " --nproc-per-node {params.nproc}"
        " {TRAIN_SCRIPT} --index {input.index} --target {input.target}"
        " --out results/drafter --threads {threads} --args {params.args:q} 2>&1 | tee {log}"
