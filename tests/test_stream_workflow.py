"""Stream mode end to end (docs/stream.md): the DAG trains in phases over slices of the data with a bounded disk.

A tiny configuration (tests/test_workflow.py's, with its target and data) is run twice in temporary copies of the
workflow: offline (``stream.slices: 1``) and in stream mode (3 slices, reuse 1, 2 epochs, 2 extraction shards,
``--resources gpu=2``). Extraction runs one sample per forward (``extract.token_budget: 1``), so every sample's
features are the same whatever slice it lands in, and the two runs must train the same weights bit for bit. While the
stream run goes, a thread samples the features on disk: never more than one slice (plus the held-out features).
Then: nothing left to do, no slice left behind; a forced rerun of the last phase reruns exactly it, the final
training, export and evaluate; a crashed phase resumes without re-extracting its slice; a changed learning rate
reruns every phase; a 200-slice DAG plans in under a minute.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from workflow import REPO, build_tiny_target, copy_workflow, planned_jobs, snakemake, tiny_config, write_tiny_sources

pytestmark = pytest.mark.slow

SLICES, EPOCHS, SHARDS = 3, 2, 2


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _bytes_under(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors") if f.is_file()) if folder.exists() else 0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, unpacked_wheel):
    root = tmp_path_factory.mktemp("stream")
    target = build_tiny_target(root / "tiny-target", unpacked_wheel)
    sources = write_tiny_sources(root / "data", unpacked_wheel)
    config = tiny_config(target, sources)
    config["extract"].update(token_budget=1, shards=SHARDS)
    config["train"].update(epochs=EPOCHS, max_steps=None, save_every=2, eval_every=4, gpus=1)
    config["evaluate"]["sets"] = {"heldout": {"source": "heldout", "max_prompts": 1, "max_new_tokens": 6}}
    return root, config


def _run(root: Path, name: str, config: dict, *args: str):
    work = copy_workflow(root / name)
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return work, snakemake(work, "--resources", "gpu=2", *args)


@pytest.fixture(scope="module")
def runs(inputs):
    root, config = inputs
    offline, proc = _run(root, "offline", config)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    stream_cfg = json.loads(json.dumps(config))
    stream_cfg["stream"] = {"slices": SLICES, "reuse": 1, "heldout_samples": 1000}
    work = copy_workflow(root / "stream")
    (work / "config.yaml").write_text(yaml.safe_dump(stream_cfg, sort_keys=False))
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            stream = work / "results" / "stream"  # a slice's shards: staged while extracted, then in place
            slices = sorted(stream.glob("phase-*")) + sorted(stream.glob(".staging/phase-*"))
            by_phase: dict[str, int] = {}
            try:
                for folder in slices:
                    by_phase[folder.name] = by_phase.get(folder.name, 0) + _bytes_under(folder)
            except FileNotFoundError:  # a shard moved from staging into place while walked: sample again
                continue  # (an uncaught error ended the sampler early, so it missed every later slice)
            samples.append(by_phase)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = snakemake(work, "--resources", "gpu=2")
    finally:
        stop.set()
        sampler.join()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return offline, work, samples


def test_stream_run_trains_the_offline_weights_with_one_slice_on_disk(runs):
    offline, work, samples = runs
    trained = "results/drafter/trained/model.safetensors"
    assert _sha(work / trained) == _sha(offline / trained)
    final = "results/drafter/final/model.safetensors"
    assert _sha(work / final) == _sha(offline / final)
    plan = json.loads((work / "results/stream/plan.json").read_text())
    assert len(plan["phases"]) == SLICES * EPOCHS
    # at most one slice's features on disk at any sampled moment, and none left behind
    assert samples and max(sum(1 for b in s.values() if b) for s in samples) <= 1
    # a slice's bytes: tokens x bytes a token, plus offsets and headers (extract.disk_headroom, 1.05, allows them)
    assert max(sum(s.values()) for s in samples) <= 1.05 * max(p["bytes"] for p in plan["phases"])
    assert max(sum(s.values()) for s in samples) >= 0.9 * min(p["bytes"] for p in plan["phases"])  # sampled a slice
    assert not list((work / "results" / "stream").glob("phase-*/shard-*"))
    assert (work / "results/stream/heldout/index.json").exists()  # the held-out features are kept
    assert [json.loads((work / f"results/drafter/phases/phase-{p}.json").read_text())["phase"]
            for p in range(SLICES * EPOCHS)] == list(range(SLICES * EPOCHS))


def test_the_node_analysis_reads_every_phase_from_the_run_s_logs(runs):
    """docs/node-x8/analyze.py (issue 35's table) parses what the jobs log: each slice's shards and tokens as the
    plan has them, each phase's steps, its lease-to-release wall time, the disk budget."""
    spec = importlib.util.spec_from_file_location("analyze", REPO / "docs" / "node-x8" / "analyze.py")
    analyze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(analyze)
    _, work, _ = runs
    plan = json.loads((work / "results/stream/plan.json").read_text())
    a = analyze.analyze(work)
    assert sorted(a["extraction"]) == sorted(a["phases"]) == list(range(SLICES * EPOCHS))
    for phase in plan["phases"]:
        p = phase["phase"]
        assert a["extraction"][p]["shards"] == SHARDS and a["extraction"][p]["tokens"] == phase["tokens"]
        assert a["extraction"][p]["leases_at_once"] >= 1 and a["extraction"][p]["one_shard_tok_s"] > 0
        assert a["phases"][p]["steps"] == phase["end_step"] - phase["first_step"]
        assert a["phases"][p]["wall_s"] > a["phases"][p]["train_steps_s"] > 0
        assert f"train_phase/phase-{p}" in a["phases"][p]["benchmark_s"]
    assert "| 0 | 2 |" in analyze.render(a)


def test_nothing_to_do_then_forcerun_of_the_last_phase_reruns_it_and_what_follows(runs):
    _, work, _ = runs
    proc = snakemake(work, "-n", "--resources", "gpu=2")
    assert proc.returncode == 0 and planned_jobs(proc.stdout + proc.stderr) == {}, (proc.stdout + proc.stderr)[-3000:]
    last = SLICES * EPOCHS - 1
    proc = snakemake(work, "-n", "--resources", "gpu=2", "--forcerun", f"results/drafter/phases/phase-{last}.json")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert jobs == {"extract_slice": SHARDS, "merge_slice": 1, "train_phase": 1, "train": 1, "export": 1,
                    "evaluate": 1, "all": 1}, jobs
    # a phase in the middle: it, the later phases and their slices (one consumer per slice: nothing before it)
    proc = snakemake(work, "-n", "--resources", "gpu=2", "--forcerun", "results/drafter/phases/phase-2.json")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    later = SLICES * EPOCHS - 2
    assert jobs == {"extract_slice": later * SHARDS, "merge_slice": later, "train_phase": later, "train": 1,
                    "export": 1, "evaluate": 1, "all": 1}, jobs
    # and it runs: the phase resumes from the checkpoint at its first step
    before = _sha(work / "results/drafter/trained/model.safetensors")
    proc = snakemake(work, "--resources", "gpu=2", "--forcerun", f"results/drafter/phases/phase-{last}.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert _sha(work / "results/drafter/trained/model.safetensors") == before


def test_a_changed_learning_rate_reruns_every_phase(runs, tmp_path):
    _, work, _ = runs
    overlay = tmp_path / "lr.yaml"
    overlay.write_text(yaml.safe_dump({"train": {"lr": 5e-4}}))
    proc = snakemake(work, "-n", "--resources", "gpu=2", "--configfile", "config.yaml", str(overlay))
    jobs = planned_jobs(proc.stdout + proc.stderr)
    # every phase trains again, so every slice (deleted after its phase) is extracted again
    assert jobs.get("train_phase") == SLICES * EPOCHS and jobs.get("extract_slice") == SLICES * EPOCHS * SHARDS
    assert "stream_plan" not in jobs and "extract_heldout" not in jobs


def test_a_killed_phase_resumes_without_extracting_its_slice_again(inputs):
    """Snakemake killed while phase 1 trains (as a lost node or an OOM killer would): the rerun resumes phase 1 from
    its slice, still on disk (its consumer never succeeded), and extracts only the slices after it."""
    import os
    import signal
    import subprocess
    import sys

    root, config = inputs
    cfg = json.loads(json.dumps(config))
    cfg["stream"] = {"slices": SLICES, "reuse": 1, "heldout_samples": 1000}
    cfg["train"]["epochs"] = 1
    work = copy_workflow(root / "killed")
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               DRAFTSMITH_GPU_LOCK_DIR=str(work / ".gpu-locks"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=2"], cwd=work,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 900
        while not (work / "logs/train_phase/phase-1.log").exists():
            assert proc.poll() is None and time.time() < deadline, "phase 1 never started"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (work / "results/stream/phase-1/index.json").exists()  # the killed phase's slice is still there
    snakemake(work, "--unlock")
    proc = snakemake(work, "-n", "--resources", "gpu=2")
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert jobs.get("extract_slice") == SHARDS and jobs.get("train_phase") == 2, jobs  # phase 2's slice only
    proc = snakemake(work, "--resources", "gpu=2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]


def test_a_200_slice_dag_plans_in_under_a_minute(inputs):
    root, config = inputs
    cfg = json.loads(json.dumps(config))
    cfg["stream"] = {"slices": 200, "reuse": 1}
    cfg["train"]["epochs"] = 1
    work = copy_workflow(root / "wide")
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    proc = snakemake(work, "-n", "--resources", "gpu=2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert time.time() - t0 < 60
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert jobs["train_phase"] == 200 and jobs["extract_slice"] == 200 * SHARDS


def test_a_run_the_disk_cannot_hold_is_refused_before_regeneration(inputs):
    """regenerate on, a reserve larger than the disk: disk_plan stops the run before any regenerate job starts."""
    root, config = inputs
    cfg = json.loads(json.dumps(config))
    cfg["regenerate"] = {"enabled": True, "max_new_tokens": 8}
    cfg["stream"] = {"reserve_gb": 1e9}
    work = copy_workflow(root / "refused")
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = snakemake(work, "--resources", "gpu=2")
    assert proc.returncode != 0
    log = (work / "logs/disk_plan/disk_plan.log").read_text()
    assert "refused before regeneration" in log and "reserve" in log
    assert not (work / "logs/regenerate_shard").exists() and not (work / "results/regenerated").exists()
