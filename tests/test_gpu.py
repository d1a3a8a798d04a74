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
    """Only with --cpu-fallback (without it the command stops: the next test)."""
    env = _env(tmp_path, "")
    proc = subprocess.run([PY, "-m", "draftsmith.gpu", "--gpus", "1", "--cpu-fallback", "--", PY, "-c",
                           "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "''"
    assert "no GPU found" in proc.stderr


def test_no_gpu_stops_the_command_with_the_reason(tmp_path):
    env = _env(tmp_path, "")
    proc = subprocess.run([PY, "-m", "draftsmith.gpu", "--gpus", "1", "--", PY, "-c", "print('ran')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert "asks for 1 GPU(s) but the pool has none: CUDA_VISIBLE_DEVICES is '', which names no device" in proc.stderr


def test_in_process_lease_sets_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    devices = gpu.lease_gpus(1, cpu_fallback=True)  # torch here is built without CUDA
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
lease_gpus(1, job=sys.argv[2], record=sys.argv[1], cpu_fallback=True)
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


# -- a job's processes: they hold its lease and none outlives it -------------------------------------------------

# A job as rule train runs one: a lease of GPUs 0 and 1, then run_trainer with a stand-in for torchrun that starts its
# "trainer" in a session of its own (as torchrun does) and the trainer asks to die with it (as python -m
# draftsmith.train does under torchrun). Each writes its pid to argv[2]-<name> once it is set up.
TREE_JOB = r"""
import sys
from draftsmith.io import setup_logging
from draftsmith.train.launch import run_trainer

TRAINER = ("import os, sys, time; from draftsmith.gpu import die_with_parent; die_with_parent(); "
           "open(sys.argv[1] + '-trainer', 'w').write(str(os.getpid())); time.sleep(600)")
TORCHRUN = ("import os, subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {TRAINER!r}, sys.argv[1]], start_new_session=True); "
            "open(sys.argv[1] + '-torchrun', 'w').write(str(os.getpid())); time.sleep(600)")
log = setup_logging(sys.argv[1])
run_trainer([], gpus=2, threads=1, log=log, job="train", cpu_fallback=True,  # this torch is built without CUDA
            command=[sys.executable, "-c", TORCHRUN, sys.argv[2]])
"""


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_job_leaves_no_process_and_no_lease(tmp_path, monkeypatch, sig):
    """SIGTERM: the job ends torchrun's process group and the trainer it finds under it (another session), then
    exits 143. SIGKILL (no handler runs): torchrun gets the kernel's SIGKILL as its parent dies, the trainer as
    torchrun dies. Either way no process of the job is left and both GPUs can be leased at once; while the job
    runs, they cannot."""
    env = _env(tmp_path, "0,1")
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", env["DRAFTSMITH_GPU_LOCK_DIR"])
    pids_at = tmp_path / "pid"
    job = subprocess.Popen([PY, "-c", TREE_JOB, str(tmp_path / "train.log"), str(pids_at)], env=env, cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)
    names = ("torchrun", "trainer")
    deadline = time.time() + 120
    while not all(Path(f"{pids_at}-{n}").exists() for n in names) and time.time() < deadline:
        assert job.poll() is None, job.stderr.read()
        time.sleep(0.1)
    pids = {n: int(Path(f"{pids_at}-{n}").read_text()) for n in names}
    assert all(_pid_alive(p) for p in pids.values())
    with pytest.raises(TimeoutError):
        gpu.acquire(1, pool=["0", "1"], timeout_s=0.3)
    job.send_signal(sig)
    assert job.wait(timeout=60) == (128 + sig if sig == signal.SIGTERM else -sig)
    deadline = time.time() + 10
    while any(_pid_alive(p) for p in pids.values()) and time.time() < deadline:
        time.sleep(0.05)
    assert {n: _pid_alive(p) for n, p in pids.items()} == {"torchrun": False, "trainer": False}
    t0 = time.monotonic()
    lease = gpu.acquire(2, pool=["0", "1"], timeout_s=2)
    assert time.monotonic() - t0 < 1.0 and lease.devices == ["0", "1"]
    lease.release()


CHILD_HOLDS = r"""
import subprocess, sys
from draftsmith import gpu
lease = gpu.acquire(1, pool=["0"])
gpu._HELD.append(lease)
child = gpu.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                  stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "up\n"
lease.release()  # the job lets go of its own fds: the child still holds the device
print(child.pid, flush=True)
sys.stdin.readline()
"""


def test_a_child_holds_the_lease_it_was_started_with(tmp_path, monkeypatch):
    """gpu.spawn passes the lease's lock fds: after the job closes its own, the device stays leased until the child
    exits (a child the job could not end would keep it from the next job)."""
    env = _env(tmp_path, "0")
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", env["DRAFTSMITH_GPU_LOCK_DIR"])
    job = subprocess.Popen([PY, "-c", CHILD_HOLDS], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    child = int(job.stdout.readline())
    with pytest.raises(TimeoutError):
        gpu.acquire(1, pool=["0"], timeout_s=0.3)
    os.kill(child, signal.SIGKILL)
    lease = gpu.acquire(1, pool=["0"], timeout_s=2)
    assert lease.devices == ["0"]
    lease.release()
    job.communicate("\n", timeout=30)
    assert job.returncode == 0


# -- a GPU job that gets no usable GPU stops ------------------------------------------------------------------------

def test_gpu_job_with_a_cpu_torch_stops_with_the_reason(tmp_path, monkeypatch, caplog):
    """CUDA_VISIBLE_DEVICES names a device but this torch is built without CUDA: the lease stops, naming the torch
    build, and gives the device back; gpu.cpu_fallback runs it on the CPU with the reason; gpus 0 asks for
    nothing."""
    import torch

    assert torch.version.cuda is None  # the tests' torch
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(gpu, "_HELD", [])
    with pytest.raises(gpu.GpuUnavailableError) as err:
        gpu.lease_gpus(1, job="extract_shard 0")
    assert str(err.value).startswith(f"extract_shard 0 asks for 1 GPU(s) but can use none: torch {torch.__version__}"
                                     " is built without CUDA (torch.version.cuda is None) although "
                                     "CUDA_VISIBLE_DEVICES=0")
    assert str(err.value).endswith("Run on the CPU on purpose with gpu.cpu_fallback: true (the CPU default's; "
                                   "extract_shard 0 always asks for one GPU)")  # extraction has no gpus key
    back = gpu.acquire(1, pool=["0"], timeout_s=0.5)  # given back
    assert back.devices == ["0"]
    back.release()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with caplog.at_level("WARNING", logger="draftsmith.gpu"):
        assert gpu.lease_gpus(1, cpu_fallback=True) == ["0"]
    assert "no usable GPU (torch" in caplog.text and "runs on the CPU" in caplog.text
    for lease in gpu._HELD:
        lease.release()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu.lease_gpus(0) == [] and os.environ["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("visible, reason", [("", "CUDA_VISIBLE_DEVICES is '', which names no device"),
                                             ("-1", "CUDA_VISIBLE_DEVICES is '-1', which names no device")])
def test_gpu_job_without_devices_stops_with_the_reason(tmp_path, monkeypatch, visible, reason):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("DRAFTSMITH_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(gpu, "_HELD", [])
    with pytest.raises(gpu.GpuUnavailableError, match=f"evaluate asks for 2 GPU\\(s\\) but can use none: {reason}. "
                       "Run on the CPU on purpose with evaluate.gpus: 0, or gpu.cpu_fallback: true"):
        gpu.lease_gpus(2, job="evaluate", gpus_key="evaluate.gpus")


def test_devices_torch_cannot_see_are_a_reason(monkeypatch):
    """CUDA_VISIBLE_DEVICES names more devices than a CUDA torch sees (a wrong id): the reason says so."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu.unusable_reason(["0", "7"]) == ("CUDA_VISIBLE_DEVICES=0,7 but torch sees 1 CUDA device(s) (ids the "
                                               "driver does not know, or a driver that does not start)")
    assert gpu.unusable_reason(["3"]) is None


# Every GPU rule's script run as Snakemake runs it (a stand-in for the `snakemake` object: the schema's defaults, the
# rule's params, inputs that do not exist): with CUDA_VISIBLE_DEVICES=0 and this CPU torch it stops at the lease,
# naming the torch build, before reading anything; with the rule's gpus 0, or gpu.cpu_fallback, it gets past the
# lease (and then fails on its missing inputs).
RULE_SCRIPTS = r"""
import json, os, runpy, sys
from types import SimpleNamespace as NS

import yaml

from draftsmith import gpu
from draftsmith.config import schema_defaults
from draftsmith.stages import rule_params

class Out(NS):  # Snakemake's named output list: by name, by key, and iterated as its paths

    def __getitem__(self, key):
        return getattr(self, key)

    def __iter__(self):
        return iter(vars(self).values())


schema = yaml.safe_load(open("schemas/config.schema.yaml"))
cases, tmp = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for rule, n, fallback in cases:
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # a lease of 0 GPUs exported ""
    config = {section: schema_defaults(section) for section in schema["properties"]}
    config["gpu"]["cpu_fallback"] = fallback
    missing = f"{tmp}/missing"
    files = NS(index=missing, target=missing, train=missing, plan=missing, conversations=missing, drafter=missing,
               eval=missing, tokenized=missing, trainer_state=missing, state=f"{tmp}/out/trained/state.json",
               marker=f"{tmp}/out/phases/phase-0.json")
    files.__dict__.update({"0": missing})
    snakemake = NS(log=[f"{tmp}/{rule}.log"], config=config, resources=NS(gpu=n), threads=1,
                   params=NS(settings=rule_params(config, rule), sources=[]), wildcards=NS(shard="0", phase="0"),
                   input=NS(**{k: v for k, v in vars(files).items() if k not in ("state", "marker")}),
                   output=[f"{tmp}/out/{rule}"])
    if rule == "train":
        snakemake.output = Out(state=files.state)
    if rule == "train_phase":
        snakemake.output = Out(marker=files.marker)
    if rule == "evaluate":
        snakemake.output = Out(**{k: f"{tmp}/out/{k}" for k in ("json", "md", "tau", "positions", "histogram")})
    try:
        runpy.run_path(f"scripts/{rule}.py", init_globals={"snakemake": snakemake})
        results[f"{rule} {n} {fallback}"] = "ran"
    except gpu.GpuUnavailableError as exc:
        results[f"{rule} {n} {fallback}"] = str(exc)
    except BaseException as exc:
        results[f"{rule} {n} {fallback}"] = type(exc).__name__
    for lease in gpu._HELD:
        lease.release()
    gpu._HELD.clear()
print(json.dumps(results))
"""

GPU_RULES = ("regenerate_shard", "extract_shard", "extract_slice", "extract_heldout", "train", "train_phase",
             "evaluate")


def test_every_gpu_rule_with_a_cpu_torch_stops_unless_the_config_asks_for_the_cpu(tmp_path):
    import torch

    cases = [[rule, 1, False] for rule in GPU_RULES]
    cases += [["regenerate_shard", 0, False], ["evaluate", 0, False], ["extract_shard", 1, True]]
    env = dict(_env(tmp_path, "0"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([PY, "-c", RULE_SCRIPTS, json.dumps(cases), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    jobs = {"regenerate_shard": "regenerate shard 0", "extract_shard": "extract_shard 0",
            "extract_slice": "extract_slice 0/0", "extract_heldout": "extract_heldout", "train": "train",
            "train_phase": "train_phase 0", "evaluate": "evaluate"}
    for rule, job in jobs.items():
        assert results[f"{rule} 1 False"].startswith(
            f"{job} asks for 1 GPU(s) but can use none: torch {torch.__version__} is built without CUDA "
            "(torch.version.cuda is None) although CUDA_VISIBLE_DEVICES=0"), (rule, results)
        key = {"regenerate_shard": "regenerate.gpus", "train": "train.gpus", "train_phase": "train.gpus",
               "evaluate": "evaluate.gpus"}.get(rule)  # extraction always asks for one GPU: no key to name
        way = f"with {key}: 0, or gpu.cpu_fallback" if key else "with gpu.cpu_fallback: true (the CPU default's; "
        assert way in results[f"{rule} 1 False"], (rule, results[f"{rule} 1 False"])
    # the CPU on purpose: past the lease, stopped by the missing inputs
    for case in ("regenerate_shard 0 False", "evaluate 0 False", "extract_shard 1 True"):
        assert "GPU" not in results[case] and results[case] != "ran", (case, results[case])
