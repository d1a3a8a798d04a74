"""GPU leases: exclusive, bounded, all-or-nothing, freed by the kernel when a job dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith import gpu

PY = sys.executable


def _env(tmp_path: Path, devices: str) -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES=devices,
                DRAFTSMITH_GPU_LOCK_DIR=str(tmp_path / "locks"))


# A fake GPU job: records which devices it got and when it held them.
JOB = r"""
import json, os, sys, time
start = time.time(); time.sleep(float(sys.argv[2])); end = time.time()
with open(sys.argv[1], "w") as fh:
    json.dump({"devices": os.environ["CUDA_VISIBLE_DEVICES"].split(","), "start": start, "end": end}, fh)
"""


def _launch(tmp_path, env, n, i, sleep=0.4):
    out = tmp_path / f"job-{i}.json"
    proc = subprocess.Popen([PY, "-m", "draftsmith.gpu", "--gpus", str(n), "--",
                             PY, "-c", JOB, str(out), str(sleep)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def test_sixteen_jobs_on_eight_devices_never_share_and_never_exceed_eight(tmp_path):
    env = _env(tmp_path, ",".join(str(i) for i in range(8)))
    jobs = [_launch(tmp_path, env, 1, i) for i in range(16)]
    for proc, _ in jobs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    records = [json.loads(out.read_text()) for _, out in jobs]
    assert all(len(r["devices"]) == 1 for r in records)
    # No device is held by two jobs at overlapping times.
    by_device: dict[str, list] = {}
    for r in records:
        by_device.setdefault(r["devices"][0], []).append((r["start"], r["end"]))
    assert set(by_device) <= {str(i) for i in range(8)}
    for dev, spans in by_device.items():
        spans.sort()
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert s1 >= e0, f"device {dev} was leased twice at once"
    # At no instant are more than 8 jobs running.
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 8
    assert peak >= 2  # they did run concurrently: the pool is not a global mutex


def test_multi_gpu_lease_is_all_or_nothing(tmp_path):
    pool = [str(i) for i in range(6)]
    os.environ["DRAFTSMITH_GPU_LOCK_DIR"] = str(tmp_path / "locks")
    try:
        holder = gpu.acquire(3, pool=pool)          # 3 of 6 busy
        with pytest.raises(TimeoutError):
            gpu.acquire(4, pool=pool, timeout_s=0.5)  # cannot get 4 ...
        # ... and while waiting it held none: the 3 free devices are still all available.
        other = gpu.acquire(3, pool=pool, timeout_s=0.5)
        assert sorted(other.devices + holder.devices) == pool
        other.release()
        holder.release()
        whole = gpu.acquire(4, pool=pool, timeout_s=0.5)
        assert len(whole.devices) == 4
        whole.release()
    finally:
        os.environ.pop("DRAFTSMITH_GPU_LOCK_DIR")


def test_killed_job_frees_its_lease_at_once(tmp_path):
    env = _env(tmp_path, "0,1,2,3")
    proc = subprocess.Popen([PY, "-m", "draftsmith.gpu", "--gpus", "4", "--", PY, "-c",
                             "import time; print('up', flush=True); time.sleep(600)"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    os.environ["DRAFTSMITH_GPU_LOCK_DIR"] = env["DRAFTSMITH_GPU_LOCK_DIR"]
    try:
        with pytest.raises(TimeoutError):
            gpu.acquire(1, pool=["0", "1", "2", "3"], timeout_s=0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        lease = gpu.acquire(4, pool=["0", "1", "2", "3"], timeout_s=2)
        assert time.monotonic() - t0 < 1.0
        assert lease.devices == ["0", "1", "2", "3"]
        lease.release()
    finally:
        os.environ.pop("DRAFTSMITH_GPU_LOCK_DIR")


def test_more_gpus_than_the_pool_is_a_clear_error(tmp_path):
    env = _env(tmp_path, "0,1")
    proc = subprocess.run([PY, "-m", "draftsmith.gpu", "--gpus", "4", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "asks for 4 GPUs but the node's pool has 2" in proc.stderr


def test_no_gpu_runs_on_cpu_with_a_warning(tmp_path):
    env = _env(tmp_path, "")
    proc = subprocess.run([PY, "-m", "draftsmith.gpu", "--gpus", "1", "--", PY, "-c",
                           "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "''"
    assert "no GPU found" in proc.stderr


def test_in_process_lease_sets_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    devices = gpu.lease_gpus(1)
    try:
        assert devices == ["5"]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
        # the lease is held: a second lease gets the other device
        second = gpu.acquire(1, pool=["5", "7"], timeout_s=0.5)
        assert second.devices == ["7"]
        second.release()
    finally:
        for lease in gpu._HELD:
            lease.release()
        gpu._HELD.clear()


# A job as the workflow's scripts run it: an in-process lease recorded in the lease log.
RECORDED_JOB = r"""
import sys, time
from draftsmith.gpu import lease_gpus
lease_gpus(1, job=sys.argv[2], record=sys.argv[1])
time.sleep(float(sys.argv[3]))
"""


def test_lease_log_shows_which_gpu_ran_which_job_and_when(tmp_path):
    """Three one-GPU jobs on a pool of two: each line names its job and device; the first two hold distinct
    devices at the same time, the third waits for one of them; every lease has its release."""
    import csv
    from datetime import datetime

    env = _env(tmp_path, "0,1")
    log_path = tmp_path / "logs" / "gpu-leases.tsv"
    procs = []
    for i, hold in enumerate([3.0, 3.0, 0.2]):
        if i == 2:  # the third job starts once the first two hold their GPUs
            deadline = time.time() + 30
            while (not log_path.exists() or log_path.read_text().count("\tleased\t") < 2) and time.time() < deadline:
                time.sleep(0.05)
        procs.append(subprocess.Popen([PY, "-c", RECORDED_JOB, str(log_path), f"extract_shard {i}", str(hold)],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    with open(log_path) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    assert len(rows) == 6 and {r["event"] for r in rows} == {"leased", "released"}
    span = {}
    for r in rows:
        t = datetime.fromisoformat(r["time_utc"]).timestamp()
        span.setdefault(r["job"], {"gpus": r["gpus"]})[r["event"]] = t
        assert span[r["job"]]["gpus"] == r["gpus"] and r["gpus"] in ("0", "1")
    a, b, c = span["extract_shard 0"], span["extract_shard 1"], span["extract_shard 2"]
    assert a["gpus"] != b["gpus"]
    assert max(a["leased"], b["leased"]) < min(a["released"], b["released"])  # both GPUs busy at once
    assert c["leased"] >= min(a["released"], b["released"]) - 0.05  # the third job waited for a free GPU
    waited = float(next(r["seconds"] for r in rows if r["job"] == "extract_shard 2" and r["event"] == "leased"))
    assert waited > 0.5


def test_capture_graph_resets_before_every_run_and_after_a_failure(monkeypatch):
    """The capture helper every CUDA graph shares (evaluate's static decoding, regenerate's decode step), with
    torch.cuda's stream and graph calls faked (no GPU here): reset, run (warm-up) twice, then reset and the captured
    run, whose output it returns; a run that raises is recorded under its key, and reset once more so the eager
    path starts from the state it expects."""
    import contextlib

    import torch

    from draftsmith.gpu import capture_graph

    calls = []

    class Stream:
        def __init__(self, device):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext(calls.append("capture")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append("sync"))

    def run():
        calls.append("run")
        return "out"

    failures = {}
    got = capture_graph(torch.device("cpu"), run, failures, 16, "a test", reset=lambda: calls.append("reset"))
    assert got == ("graph", "out") and failures == {}
    assert calls == ["reset", "run", "reset", "run", "reset", "capture", "run"]

    calls.clear()

    def broken():
        calls.append("run")
        raise RuntimeError("operation not permitted when stream is capturing")

    assert capture_graph(torch.device("cpu"), broken, failures, -3, "a test",
                         reset=lambda: calls.append("reset")) is None
    assert failures == {-3: "RuntimeError: operation not permitted when stream is capturing"}
    assert calls == ["reset", "run", "sync", "reset"]
