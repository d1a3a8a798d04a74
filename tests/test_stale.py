"""draftsmith.stale on Snakemake-format records written by the test: which outputs a starting job removes, which
outputs the check at planning calls stale, and which it leaves alone (the end-to-end cases, through Snakemake, are in
tests/test_workflow.py)."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest

from draftsmith.stale import (
    StaleOutputsError,
    check_no_stale_outputs,
    invalidate_consumers,
    read_records,
    stale_outputs,
)


def _record_path(folder: Path, key: str, max_len: int = 255) -> Path:
    """Where Snakemake's FilePersistence keeps the record of ``key`` (url-safe base64, split in folders)."""
    b64 = base64.urlsafe_b64encode(key.encode()).decode()
    parts = [b64[i:i + max_len - 1] for i in range(0, len(b64), max_len - 1)]
    return folder.joinpath(*(["@" + p for p in parts[:-1]] + [parts[-1]]))


def record(work: Path, output: str, rule: str, inputs: list[str], started: float, *, exists: bool = True,
           made: float | None = None) -> None:
    """A record as Snakemake writes it for ``output``; the file itself (``exists``) with mtime ``made``."""
    path = _record_path(work / ".snakemake" / "metadata", output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"record_format_version": 6, "rule": rule, "input": inputs, "starttime": started,
                                "endtime": made or started, "incomplete": False}))
    if exists:
        (work / output).parent.mkdir(parents=True, exist_ok=True)
        (work / output).write_text(rule)
        if made is not None:
            os.utime(work / output, (made, made))


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A finished offline chain: curated -> tokenized -> index -> trained -> final -> report (an hour ago)."""
    monkeypatch.chdir(tmp_path)
    t = time.time() - 3600
    record(tmp_path, "results/curated/train.parquet", "curate", ["/data/chat.jsonl"], t, made=t + 1)
    record(tmp_path, "results/tokenized/train.parquet", "tokenize", ["results/curated/train.parquet"], t + 2,
           made=t + 3)
    record(tmp_path, "results/features/index.json", "merge", ["results/tokenized/train.parquet"], t + 4, made=t + 5)
    for name in ("model.safetensors", "trainer_state.json"):
        record(tmp_path, f"results/drafter/trained/{name}", "train", ["results/features/index.json", "/models/t"],
               t + 6, made=t + 7)
    record(tmp_path, "results/drafter/final/model.safetensors", "export",
           ["results/drafter/trained/model.safetensors"], t + 8, made=t + 9)
    for name in ("report.json", "report.md"):
        record(tmp_path, f"results/eval/{name}", "evaluate",
               ["results/drafter/final/model.safetensors", "results/drafter/trained/trainer_state.json",
                "results/curated/eval.parquet"], t + 10, made=t + 11)
    return tmp_path


def test_records_are_read_from_snakemakes_layout_including_long_keys(project):
    long = "results/" + "/".join(["x" * 60] * 5) + "/out.json"  # its base64 spans two folders
    record(project, long, "curate", ["a"], 5.0, exists=False)
    records = read_records()
    assert records[long].rule == "curate" and records[long].inputs == ("a",)
    assert records["results/drafter/final/model.safetensors"].inputs == ("results/drafter/trained/model.safetensors",)


def test_a_starting_job_removes_what_was_made_from_its_outputs_transitively(project):
    removed = invalidate_consumers(["results/drafter/trained/model.safetensors",
                                    "results/drafter/trained/trainer_state.json"])
    assert set(removed) == {"results/drafter/final/model.safetensors", "results/eval/report.json",
                            "results/eval/report.md"}
    assert removed[0] == "results/drafter/final/model.safetensors"  # nearest first
    for kept in ("results/drafter/trained/model.safetensors", "results/features/index.json",
                 "results/curated/train.parquet"):
        assert (project / kept).exists(), kept


def test_a_starting_upstream_job_removes_the_whole_chain_but_not_its_inputs(project):
    removed = invalidate_consumers(["results/tokenized/train.parquet"])
    assert set(removed) == {"results/features/index.json", "results/drafter/trained/model.safetensors",
                            "results/drafter/trained/trainer_state.json", "results/drafter/final/model.safetensors",
                            "results/eval/report.json", "results/eval/report.md"}
    assert (project / "results/curated/train.parquet").exists()
    assert (project / "results/tokenized/train.parquet").exists()  # its own outputs: Snakemake's business


def test_order_only_inputs_and_outside_paths_are_never_removed(project):
    t = time.time()
    record(project, "results/stream/disk-plan.json", "disk_plan", ["results/curated/train.parquet"], t, made=t)
    record(project, "results/regenerated/shard-0.parquet", "regenerate_shard",
           ["results/curated/train.parquet", "results/stream/disk-plan.json"], t, made=t)
    record(project, "results/drafter/phases/phase-0.json", "train_phase", ["results/stream/phase-0/index.json"], t,
           made=t)
    record(project, "results/drafter/phases/phase-1.json", "train_phase",
           ["results/drafter/phases/phase-0.json", "results/stream/phase-1/index.json"], t, made=t)
    (project / "results/stream/phase-2/shard-0").mkdir(parents=True)
    record(project, "results/stream/phase-2/shard-0", "extract_slice",
           ["results/drafter/phases/phase-0.json", "results/stream/plans/phase-2.json"], t, exists=False)
    outside = project.parent / f"{project.name}-assets" / "targets" / "t"
    outside.mkdir(parents=True)
    record(project, str(outside), "materialize_target", ["results/stream/disk-plan.json"], t, exists=False)

    assert invalidate_consumers(["results/stream/disk-plan.json"]) == []  # regenerate waits for it, reads nothing
    removed = invalidate_consumers(["results/drafter/phases/phase-0.json"])
    assert removed == ["results/drafter/phases/phase-1.json"]  # the next phase; not the slice it only orders
    assert (project / "results/stream/phase-2/shard-0").is_dir() and outside.is_dir()


def test_an_interrupted_rerun_is_stale_at_planning_and_named_with_the_command_that_fixes_it(project):
    """train started again after export and evaluate ran, and did not finish (its outputs gone, its record newer)."""
    again = time.time()
    for name in ("model.safetensors", "trainer_state.json"):
        record(project, f"results/drafter/trained/{name}", "train", ["results/features/index.json"], again,
               exists=False)
        (project / "results/drafter/trained" / name).unlink()
    stale = {s.output for s in stale_outputs()}
    assert stale == {"results/drafter/final/model.safetensors", "results/eval/report.json", "results/eval/report.md"}
    with pytest.raises(StaleOutputsError) as err:
        check_no_stale_outputs()
    message = str(err.value)
    assert "rule train was started again at" in message and "did not finish" in message
    assert ("rm -r results/drafter/final/model.safetensors results/eval/report.json results/eval/report.md"
            in message)
    for path in stale:  # following the advice clears it
        os.unlink(path)
    check_no_stale_outputs()


def test_an_intermediate_the_user_deleted_is_not_stale(project):
    """The features removed after training (to free the disk): their record is older than what was made from them,
    so nothing is stale and nothing is rerun (Snakemake's own behaviour)."""
    os.unlink(project / "results/features/index.json")
    os.unlink(project / "results/tokenized/train.parquet")
    assert stale_outputs() == []
    check_no_stale_outputs()


def test_a_job_killed_with_snakemake_is_seen_through_its_incomplete_marker(project):
    """Snakemake killed with its job: no new record, only the incomplete marker written when the job started."""
    os.unlink(project / "results/tokenized/train.parquet")
    marker = _record_path(project / ".snakemake" / "incomplete", "results/tokenized/train.parquet")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"external_jobid": None}))
    stale = {s.output for s in stale_outputs()}
    assert "results/features/index.json" in stale and "results/eval/report.json" in stale
    assert all(s.rule == "tokenize" for s in stale_outputs())


def test_no_records_no_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_records() == {} and stale_outputs() == [] and invalidate_consumers(["a"]) == []
    check_no_stale_outputs()
