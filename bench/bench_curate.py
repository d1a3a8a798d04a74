"""Benchmark of the curate stage: conversations/s and peak RSS on ~1M synthetic ShareGPT-like rows.

Writes one ShareGPT JSON array (``[{id, conversations: [{from, value}]}]``, 2-6 turns of random
words, ~2% exact duplicates, ~1% rows without an assistant turn, optionally a truncated tail) and
measures, each in a fresh subprocess so peak RSS is its own:

* baseline -- decode the same array record by record (``iter_json_array``) and do nothing else: the
  floor set by JSON parsing;
* ``curate`` -- the full stage (convert, normalise, validate, hash, de-duplicate, spool, sample,
  split, write train/eval Parquet and the report).

Printed: rows/s of each (wall clock, and per CPU second of the process, which a busy machine
disturbs less), curate / baseline ratio, peak RSS of each, and the reconciled counts. Run
at two sizes (``--rows`` and a tenth of it) to show that memory does not grow with the input beyond
the ids kept for de-duplication (~100 bytes per unique row).

    python bench/bench_curate.py                     # 1,000,000 rows (~0.6 GB of JSON, ~1-2 minutes)
    python bench/bench_curate.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

WORDS = ("the of and to in is that for it as with was on be by this are from at an or have not "
         "model token draft target block anchor layer hidden state cache speculative decoding "
         "python function return value list dict error file data train eval loss mask").split()


def write_sharegpt(path: Path, rows: int, seed: int = 0) -> int:
    """Stream ``rows`` synthetic ShareGPT records into a JSON array file; returns its size in bytes."""
    rng = random.Random(seed)
    previous: list[str] = []
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("[\n")
        for i in range(rows):
            r = rng.random()
            if r < 0.02 and previous:  # exact duplicate of a recent conversation
                conv = json.loads(rng.choice(previous))["conversations"]
            else:
                turns = rng.randint(1, 3) * 2
                conv = []
                for t in range(turns):
                    n = rng.randint(8, 60) if t % 2 == 0 else rng.randint(20, 120)
                    conv.append({"from": "human" if t % 2 == 0 else "gpt",
                                 "value": " ".join(rng.choices(WORDS, k=n))})
                if r > 0.99:  # no assistant turn
                    conv = [m for m in conv if m["from"] == "human"]
            rec = json.dumps({"id": f"syn_{i}", "conversations": conv}, ensure_ascii=False)
            if len(previous) < 256:
                previous.append(rec)
            elif rng.random() < 0.01:
                previous[rng.randrange(256)] = rec
            fh.write(("  " if i == 0 else ",\n  ") + rec)
        fh.write("\n]\n")
    return path.stat().st_size


BASELINE = """
import resource, sys, time
from draftsmith.curate import iter_json_array
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
n = sum(1 for _ in iter_json_array(sys.argv[1]))
ru = resource.getrusage(resource.RUSAGE_SELF)
print(n, time.perf_counter() - t, ru.ru_maxrss, ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime)
"""

CURATE = """
import json, resource, sys, time
from draftsmith.curate import CurateSettings, curate
out = sys.argv[2]
ru0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
r = curate([{"name": "synthetic", "path": sys.argv[1], "adapter": "sharegpt", "split": "both"}],
           out + "/train.parquet", out + "/eval.parquet", out + "/report.json",
           CurateSettings.from_config(data={"seed": 0, "eval_fraction": 0.05}))
ru = resource.getrusage(resource.RUSAGE_SELF)
cpu_s = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
print(r["totals"]["read"], time.perf_counter() - t, ru.ru_maxrss, cpu_s)
print(json.dumps(r["sources"]["synthetic"]["dropped"]), r["rows"]["train"], r["rows"]["eval"])
"""


def run_child(code: str, *args: str) -> list[str]:
    """Run ``code`` in a fresh interpreter (it prints its own peak RSS); returns its stdout lines."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    return proc.stdout.split("\n")


def measure(rows: int, workdir: Path) -> dict:
    data = workdir / f"sharegpt-{rows}.json"
    size = write_sharegpt(data, rows)
    out = workdir / f"out-{rows}"
    out.mkdir()
    base_lines = run_child(BASELINE, str(data))
    n_base, t_base, base_rss, base_cpu = base_lines[0].split()
    cur_lines = run_child(CURATE, str(data), str(out))
    n_cur, t_cur, cur_rss, cur_cpu = cur_lines[0].split()
    dropped, n_train, n_eval = cur_lines[1].rsplit(" ", 2)
    return {"rows": rows, "bytes": size, "baseline_s": float(t_base), "curate_s": float(t_cur),
            "baseline_rows": int(n_base), "read": int(n_cur), "dropped": json.loads(dropped),
            "train": int(n_train), "eval": int(n_eval),
            "baseline_rss": int(base_rss) / 1024, "curate_rss": int(cur_rss) / 1024,  # KiB -> MiB
            "baseline_cpu": float(base_cpu), "curate_cpu": float(cur_cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rows in (max(args.rows // 10, 1), args.rows):
            m = measure(rows, Path(tmp))
            kept = m["train"] + m["eval"]
            assert m["read"] == kept + sum(m["dropped"].values()), m
            print(f"rows {m['rows']:,} ({m['bytes'] / 2**20:,.0f} MiB JSON)")
            print(f"  baseline (JSON decode only): {m['baseline_rows'] / m['baseline_s']:10,.0f} rows/s "
                  f"in {m['baseline_s']:.1f} s wall ({m['baseline_cpu']:.1f} CPU s), "
                  f"peak RSS {m['baseline_rss']:,.0f} MiB")
            print(f"  curate (full stage):         {m['read'] / m['curate_s']:10,.0f} rows/s "
                  f"in {m['curate_s']:.1f} s wall ({m['curate_cpu']:.1f} CPU s, "
                  f"{m['read'] / m['curate_cpu']:,.0f} rows per CPU s), peak RSS {m['curate_rss']:,.0f} MiB")
            print(f"  curate / baseline: throughput x{m['baseline_s'] / m['curate_s']:.2f} wall, "
                  f"x{m['baseline_cpu'] / m['curate_cpu']:.2f} per CPU s; "
                  f"RSS x{m['curate_rss'] / m['baseline_rss']:.2f}")
            print(f"  kept {kept:,} (train {m['train']:,}, eval {m['eval']:,}), dropped {m['dropped']}")


if __name__ == "__main__":
    main()
