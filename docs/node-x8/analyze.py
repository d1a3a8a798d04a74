#!/usr/bin/env python3
"""What a sliced-training run on a GPU node measured, from its logs (issue 35's table; docs/node-x8/README.md).

    python docs/node-x8/analyze.py RUN [--json OUT.json]

RUN is the folder the run left (or the unpacked tarball of `docs/stream/run.sh wait`): `logs/` (each job's log and
`gpu-leases.tsv`), `benchmarks/`, `results/stream/plan.json`, and beside them, when sampled, `disk-samples.txt`
(`time bytes-under-results bytes-under-results/stream free-bytes`, run.sh every 2 s) and `gpu-samples.csv`
(`nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2`). It prints Markdown:

* every rule's and every phase's wall time (Snakemake's benchmark files, seconds);
* per slice, its extraction shards: how many, on how many distinct GPUs, how many held a lease at once, and their
  aggregate tokens/s (all the slice's tokens over the span from the first shard's first forward to the last shard's
  end) against one shard's own (its tokens over its forward-and-write seconds), the ratio the issue asks >= 7x for;
* per phase, its wall time from the first extraction lease to the training phase's release, with the parts that
  are work (the slowest shard's forwards, the training steps) and the rest, the phase's fixed cost;
* each GPU job's peak GPU memory: nvidia-smi's samples of the GPUs it leased, while it held them (the whole
  process), and the peak torch allocated as the job logged it;
* the disk: the most bytes sampled under results/stream/ (the slices and held-out features) and under results/,
  against the plan's feature budget (free bytes at stream_plan minus the reserve).

Only the standard library: it runs where the run ran.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
SHARD_DONE = re.compile(r"phase (\d+) shard (\d+): (\d+) tokens in ([\d.]+) s = [\d,.]+ tok/s "
                        r"\((\d+) forwards, compute ([\d.]+) s")
PHASE_STEPS = re.compile(r"phase (\d+) done: steps (\d+)\.\.(\d+)")
PEAK_LINE = re.compile(r"peak GPU memory( per rank)?: (.*)")
STEP_RATE = re.compile(r"train: (\d+)/(\d+) step .*?([\d.]+)(s/step|step/s)")


def _log_time(line: str) -> float | None:
    m = LOG_TIME.match(line)
    if not m:
        return None
    t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)
    return t.timestamp() + int(m.group(2)) / 1000


def benchmarks(run: Path) -> dict[str, float]:
    """Job (benchmark path without .tsv) -> wall seconds."""
    out = {}
    for f in sorted((run / "benchmarks").rglob("*.tsv")):
        rows = list(csv.DictReader(f.open(), delimiter="\t"))
        if rows:
            out[str(f.relative_to(run / "benchmarks"))[:-4]] = float(rows[-1]["s"])
    return out


def leases(run: Path) -> list[dict]:
    """Held leases: ``{job, gpus, start, end}`` (epoch seconds), from logs/gpu-leases.tsv."""
    path = run / "logs" / "gpu-leases.tsv"
    if not path.is_file():
        return []
    open_, out = {}, []
    for row in csv.DictReader(path.open(), delimiter="\t"):
        t = dt.datetime.fromisoformat(row["time_utc"]).timestamp()
        key = (row["job"], row["pid"])
        if row["event"] == "leased":
            open_[key] = t
        elif row["event"] == "released" and key in open_:
            out.append({"job": row["job"], "gpus": row["gpus"].split(","), "start": open_.pop(key), "end": t})
    return out


def max_concurrent(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def extraction(run: Path, held: list[dict]) -> dict[int, dict]:
    """Per phase: its extraction shards' tokens, times, GPUs and the aggregate / single-shard rates."""
    shards: dict[int, list[dict]] = {}
    for log in sorted((run / "logs" / "extract_slice").glob("phase-*/shard-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = SHARD_DONE.search(line)
            if m and _log_time(line) is not None:
                end, seconds = _log_time(line), float(m.group(4))
                shards.setdefault(int(m.group(1)), []).append(
                    {"shard": int(m.group(2)), "tokens": int(m.group(3)), "seconds": seconds,
                     "compute_s": float(m.group(6)), "start": end - seconds, "end": end})
    out = {}
    for phase, rows in sorted(shards.items()):
        lease_rows = [x for x in held if x["job"].startswith(f"extract_slice {phase}/")]
        tokens = sum(r["tokens"] for r in rows)
        span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        one = statistics.mean(r["tokens"] / r["seconds"] for r in rows if r["seconds"] > 0)
        out[phase] = {
            "shards": len(rows), "tokens": tokens,
            "gpus": sorted({g for x in lease_rows for g in x["gpus"]}),
            "leases_at_once": max_concurrent([(x["start"], x["end"]) for x in lease_rows]),
            "aggregate_tok_s": tokens / span if span > 0 else None, "one_shard_tok_s": one,
            "ratio": (tokens / span) / one if span > 0 and one else None,
            "slowest_forwards_s": max(r["seconds"] for r in rows),
        }
    return out


def training_steps(run: Path) -> dict[int, dict]:
    """Per phase: its steps and the seconds they took (steps x the last logged s/step)."""
    out = {}
    for log in sorted((run / "logs" / "train_phase").glob("phase-*.log")):
        text = log.read_text(errors="replace")
        done = PHASE_STEPS.search(text)
        rates = STEP_RATE.findall(text)
        if not done:
            continue
        steps = int(done.group(3)) - int(done.group(2)) + 1
        per_step = None
        if rates:
            value, unit = float(rates[-1][2]), rates[-1][3]
            per_step = value if unit == "s/step" else 1 / value
        out[int(done.group(1))] = {"steps": steps, "s_per_step": per_step,
                                   "steps_s": steps * per_step if per_step else None}
    return out


def logged_peaks(run: Path) -> dict[str, float]:
    """Log file (under logs/, without .log) -> the largest peak GiB torch allocated that the job logged
    (``peak GPU memory: cuda:0 61.2 GiB of 140`` from draftsmith.gpu.log_peak_memory, or the trainer's ``peak GPU
    memory per rank: 62.2, 62.1 GiB``)."""
    out = {}
    for log in sorted((run / "logs").rglob("*.log")):
        peaks = []
        for m in PEAK_LINE.finditer(log.read_text(errors="replace")):
            peaks += [float(x) for x in (re.findall(r"([\d.]+) GiB of", m.group(2)) if m.group(1) is None
                                         else re.findall(r"[\d.]+", m.group(2)))]
        if peaks:
            out[str(log.relative_to(run / "logs"))[:-4]] = max(peaks)
    return out


def gpu_peaks(run: Path, held: list[dict]) -> dict[str, float]:
    """Job -> peak memory.used (MiB) over its leased GPUs while it held them."""
    path = next((p for p in (run / "gpu-samples.csv", run / "logs" / "gpu-samples.csv") if p.is_file()), None)
    if path is None:
        return {}
    samples = []
    for row in csv.reader(path.open()):
        if not row or row[0].startswith("timestamp"):
            continue
        try:
            t = dt.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, row[1].strip(), float(row[2].strip().split()[0])))
        except (ValueError, IndexError):
            continue
    out = {}
    for x in held:
        mem = [m for t, i, m in samples if x["start"] <= t <= x["end"] and i in x["gpus"]]
        if mem:
            out[x["job"]] = max(mem + [out.get(x["job"], 0.0)])
    return out


def disk(run: Path) -> dict | None:
    """The sampled high-water marks against the plan's feature budget."""
    path = next((p for p in (run / "disk-samples.txt", run / "logs" / "disk-samples.txt") if p.is_file()), None)
    plan_path = run / "results" / "stream" / "plan.json"
    if path is None or not plan_path.is_file():
        return None
    rows = [line.split() for line in path.read_text().splitlines()]
    rows = [[int(v) for v in r] for r in rows if len(r) >= 4 and all(v.isdigit() for v in r[:4])]
    d = json.loads(plan_path.read_text())["disk"]
    budget = d["free_bytes"] - d["reserve_bytes"]
    return {"samples": len(rows), "max_stream_bytes": max((r[2] for r in rows), default=None),
            "max_results_bytes": max((r[1] for r in rows), default=None),
            "min_free_bytes": min((r[3] for r in rows), default=None),
            "feature_budget_bytes": budget, "largest_slice_bytes": d["largest_slice_bytes"],
            "heldout_bytes": d["heldout_bytes"], "slices_on_disk": d["slices_on_disk"]}


def analyze(run: Path) -> dict:
    """Everything above for the run folder ``run``."""
    held = leases(run)
    bench = benchmarks(run)
    ext, steps = extraction(run, held), training_steps(run)
    phases = {}
    for p in sorted(set(ext) | set(steps)):
        rows = [x for x in held if x["job"].startswith(f"extract_slice {p}/") or x["job"] == f"train_phase {p}"]
        wall = max(x["end"] for x in rows) - min(x["start"] for x in rows) if rows else None
        work = (ext.get(p, {}).get("slowest_forwards_s") or 0) + (steps.get(p, {}).get("steps_s") or 0)
        phases[p] = {"wall_s": wall, "extract_slice_s": ext.get(p, {}).get("slowest_forwards_s"),
                     "train_steps_s": steps.get(p, {}).get("steps_s"), "steps": steps.get(p, {}).get("steps"),
                     "fixed_s": wall - work if wall is not None else None,
                     "benchmark_s": {k: v for k, v in bench.items() if f"phase-{p}" in k.split("/")}}
    return {"benchmarks": bench, "extraction": ext, "phases": phases, "gpu_peak_mib": gpu_peaks(run, held),
            "logged_peak_gib": logged_peaks(run), "disk": disk(run)}


def _f(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def render(a: dict) -> str:
    """The analysis as Markdown."""
    out = ["## Wall time per job (Snakemake benchmarks)", "", "| job | s |", "|---|---|"]
    out += [f"| {k} | {_f(v)} |" for k, v in a["benchmarks"].items()]
    out += ["", "## Extraction per slice", "",
            "| phase | shards | distinct GPUs | leases at once | tokens | aggregate tok/s | one shard tok/s | ratio |",
            "|---|---|---|---|---|---|---|---|"]
    for p, e in a["extraction"].items():
        out.append(f"| {p} | {e['shards']} | {len(e['gpus'])} ({','.join(e['gpus'])}) | {e['leases_at_once']} | "
                   f"{e['tokens']:,} | {_f(e['aggregate_tok_s'], 0)} | {_f(e['one_shard_tok_s'], 0)} | "
                   f"{_f(e['ratio'], 2)}x |")
    out += ["", "## Phases", "", "| phase | wall s | slowest shard's forwards s | steps | steps s | fixed s |",
            "|---|---|---|---|---|---|"]
    for p, x in a["phases"].items():
        out.append(f"| {p} | {_f(x['wall_s'])} | {_f(x['extract_slice_s'])} | {x['steps'] or '-'} | "
                   f"{_f(x['train_steps_s'])} | {_f(x['fixed_s'])} |")
    out += ["", "## Peak GPU memory per job", "", "nvidia-smi (the whole process, MiB, sampled inside the lease):", ""]
    out += [f"- {k}: {_f(v, 0)}" for k, v in a["gpu_peak_mib"].items()] or ["- no GPU samples"]
    out += ["", "What torch allocated at most, as the job logged it (GiB):", ""]
    out += [f"- {k}: {_f(v)}" for k, v in a["logged_peak_gib"].items()] or ["- none logged (no job used CUDA)"]
    d = a["disk"]
    out += ["", "## Disk", ""]
    if d is None:
        out.append("- no disk samples or no stream plan")
    else:
        gb = 1e9
        out += [f"- features' budget (free at stream_plan - reserve): {_f(d['feature_budget_bytes'] / gb, 2)} GB; "
                f"largest slice {_f(d['largest_slice_bytes'] / gb, 2)} GB x {d['slices_on_disk']} on disk + "
                f"held-out {_f(d['heldout_bytes'] / gb, 2)} GB",
                f"- most sampled under results/stream/: {_f((d['max_stream_bytes'] or 0) / gb, 2)} GB; under "
                f"results/: {_f((d['max_results_bytes'] or 0) / gb, 2)} GB; least free: "
                f"{_f((d['min_free_bytes'] or 0) / gb, 2)} GB ({d['samples']} samples)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="the run's folder (logs/, benchmarks/, results/stream/plan.json)")
    parser.add_argument("--json", type=Path, help="also write the analysis as JSON here")
    args = parser.parse_args(argv)
    if not (args.run / "logs").is_dir():
        print(f"error: {args.run}/logs is not a folder: give the run's folder", file=sys.stderr)
        return 2
    a = analyze(args.run)
    print(render(a), end="")
    if args.json:
        args.json.write_text(json.dumps(a, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
