"""The README's SLURM command, run for real: ``snakemake --workflow-profile profiles/slurm`` with the real
executor plugin (snakemake-executor-plugin-slurm) against fake SLURM commands that record what they get.

The fake ``sbatch`` records its arguments, "runs" the job by creating its output files (so Snakemake moves
on down the DAG) and prints a job id; the fake ``sacct`` reports every recorded job COMPLETED; the other
SLURM commands answer nothing. The embedded default config (regenerate on in 1 shard, 2 extraction shards) runs from
curate to evaluate this way, every rule one sbatch job, and the test asserts each submitted line: the GPUs
and CPUs the profile names, the threads each job runs with equal to its own allocation (not the login
node's cores), the profile's memory and runtime, and no absolute workflow path among a job's inputs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflow import copy_workflow

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROFILE = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
# Outputs of each rule of the embedded default, created by the fake sbatch ({shard}: the job's wildcard).
OUTPUTS = {
    "curate": ["results/curated/train.parquet", "results/curated/eval.parquet", "results/curated/report.json"],
    "disk_plan": ["results/stream/disk-plan.json"],
    "regenerate_shard": ["results/regenerated/shard-{shard}.parquet"],
    "regenerate": ["results/regenerated/train.parquet"],
    "tokenize": ["results/tokenized/train.parquet", "results/tokenized/eval.parquet",
                 "results/tokenized/report.json"],
    "extract_plan": ["results/features/plan.json"],
    "extract_shard": ["results/features/shard-{shard}/manifest.json"],
    "merge": ["results/features/index.json"],
    "train": ["results/drafter/trained/model.safetensors", "results/drafter/trained/config.json",
              "results/drafter/trained/trainer_state.json"],
    "export": ["results/drafter/final/config.json", "results/drafter/final/model.safetensors"],
    "evaluate": ["results/eval/report.json", "results/eval/report.md", "results/eval/tau.png",
                 "results/eval/per_position.png", "results/eval/acceptance_hist.png"],
}
for _rule, _files in OUTPUTS.items():  # and its benchmark file, also a job output
    _files.append(f"benchmarks/{_rule}/" + ("shard-{shard}" if _rule.endswith("_shard") else _rule) + ".tsv")
GPU_RULES = ["regenerate_shard", "extract_shard", "train", "evaluate"]

FAKE_SBATCH = '''
import json, os, re, shlex, sys
d = os.environ["FAKE_SLURM_DIR"]
log = os.path.join(d, "sbatch.jsonl")
n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
with open(log, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
wrap = next(a for a in sys.argv[1:] if a.startswith("--wrap="))
rule, _, wildcards = shlex.split(re.search(r"--target-jobs ('[^']*')", wrap).group(1))[0].partition(":")
values = dict(w.split("=", 1) for w in wildcards.split(",") if w)
for pattern in json.load(open(os.path.join(d, "outputs.json")))[rule]:
    path = pattern.format(**values)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "a").close()
print(7001 + n)
'''
FAKE_SACCT = '''
import os, sys
d = os.environ["FAKE_SLURM_DIR"]
log = os.path.join(d, "sbatch.jsonl")
if "--name" in sys.argv and os.path.exists(log):
    for i in range(sum(1 for _ in open(log))):
        print(f"{7001 + i}|COMPLETED")
'''


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in [("sbatch", FAKE_SBATCH), ("sacct", FAKE_SACCT)] + [
            (c, "") for c in ("squeue", "sinfo", "sacctmgr", "sshare", "scontrol", "scancel", "srun")]:
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)


def _set_threads(wrap: str) -> dict[str, int]:
    """Per-rule threads the remote job gets (the --set-threads it is handed, base64 'rule=N' values)."""
    values = re.search(r"--set-threads ((?:base64//\S+ ?)+)", wrap).group(1).split()
    pairs = [base64.b64decode(v[len("base64//"):]).decode().split("=") for v in values]
    return {rule: int(n) for rule, n in pairs}


def _set_resources(wrap: str) -> dict[str, dict[str, int]]:
    """Per-rule resources the remote job is handed (its --set-resources, base64 'rule:name=value' values)."""
    values = re.search(r"--set-resources ((?:base64//\S+ ?)+)", wrap).group(1).split()
    out: dict[str, dict[str, int]] = {}
    for v in values:
        key, value = base64.b64decode(v[len("base64//"):]).decode().split("=", 1)
        rule, name = key.split(":", 1)
        out.setdefault(rule, {})[name] = int(value) if value.isdigit() else value
    return out


def _flag(args: list[str], name: str) -> str | None:
    for k, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name:
            return args[k + 1]
    return None


def test_documented_slurm_command_submits_every_rule_with_its_allocation(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    work = copy_workflow(tmp_path / "workflow")
    config = yaml.safe_load((work / "config.yaml").read_text())
    # GPU counts of the config, not of the profile: train on 2 GPUs, evaluate on 3
    config["train"]["gpus"], config["evaluate"]["gpus"] = 2, 3
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    gpus = {"train": 2, "evaluate": 3, "regenerate_shard": 1, "extract_shard": 1}
    # the assets the login node would fetch (localrule fetch_dataset) and materialise are there already
    for source in config["data"]["sources"]:
        (work / "resources" / "data" / source["path"].split(":", 1)[1]).mkdir(parents=True)
    (work / "resources" / "targets" / config["target"]["model"].split(":", 1)[1]).mkdir(parents=True)
    fake = tmp_path / "slurm"
    fake.mkdir()
    (fake / "outputs.json").write_text(json.dumps(OUTPUTS))
    _fake_slurm(tmp_path / "bin")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(fake),
               HF_HUB_OFFLINE="1")
    env.pop("SLURM_JOB_ID", None)
    # the README's command; only the plugin's first status check is brought forward from 40 s
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--workflow-profile", "profiles/slurm",
                           "--slurm-init-seconds-before-status-checks", "1"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "Workflow requires a total number of cores" not in out

    jobs = {}
    for line in (fake / "sbatch.jsonl").read_text().splitlines():
        args = json.loads(line)
        rule = _flag(args, "--comment").removeprefix("rule_")
        jobs[rule] = args
    assert sorted(jobs) == sorted(["curate", "disk_plan", "regenerate_shard_wildcards_0", "regenerate", "tokenize",
                                   "extract_plan", "extract_shard_wildcards_0", "extract_shard_wildcards_1", "merge",
                                   "train", "export", "evaluate"])
    for name, args in jobs.items():
        rule = name.split("_wildcards_")[0]
        wrap = _flag(args, "--wrap")
        resources = {**PROFILE["default-resources"], **PROFILE["set-resources"].get(rule, {})}
        threads = _set_threads(wrap).get(rule, 1)  # what the job runs with on its node (CPU rules)
        assert _flag(args, "-t") == str(resources["runtime"]), name  # the profile's runtime
        if rule in GPU_RULES:
            # the GPUs of the config; the CPUs and memory per GPU of the profile, times those GPUs
            assert "gpu" not in resources and rule not in PROFILE["set-threads"], name
            assert _flag(args, "--gpus") == str(gpus[rule]), name
            assert _flag(args, "--cpus-per-gpu") == str(resources["cpus_per_gpu"]), name
            assert _flag(args, "--cpus-per-task") is None, name
            assert _flag(args, "--mem") == str(gpus[rule] * resources["mem_mb_per_gpu"]), name
            # the job's own run on its node is handed the per-GPU figures: its threads are gpus x cpus_per_gpu
            assert _set_resources(wrap)[rule]["cpus_per_gpu"] == resources["cpus_per_gpu"], name
        else:
            assert threads == PROFILE["set-threads"].get(rule, 1), name
            assert _flag(args, "--mem") == str(resources["mem_mb"]), name  # the profile's memory
            assert _flag(args, "--gpus") is None and _flag(args, "--cpus-per-task") == str(threads), name
        remote = shlex.split(wrap.removeprefix("--wrap="))
        # the remote job runs on its node's allocation, not capped at the submitting host's cores
        assert _flag(remote, "--cores") == "all", name
        # no absolute workflow path among its inputs (moving the project folder must not rerun it)
        inputs = remote[remote.index("--wait-for-files") + 1:remote.index("--force")]
        assert not [p for p in inputs if p.startswith(str(work)) and ".snakemake" not in p], (name, inputs)
    # train follows train.gpus (issue 34: 8 GPUs and 512 GB whatever it said): 2 GPUs x 8 CPUs x 64 GB
    assert [_flag(jobs["train"], f) for f in ("--gpus", "--cpus-per-gpu", "--mem")] == ["2", "8", "128000"]
    assert [_flag(jobs["evaluate"], f) for f in ("--gpus", "--cpus-per-gpu", "--mem")] == ["3", "8", "384000"]
    assert (work / "results" / "eval" / "report.json").exists()
