"""Regenerate's shards: the input cut into parts, a shard's parts regenerated (resumable), and the shards
assembled.

The input's conversations are cut into global parts of ``chunk_size`` (``P = ceil(rows / chunk_size)``,
:func:`num_parts`); shard i of n regenerates the contiguous parts :func:`shard_parts` gives it into its own parquet
(:func:`regenerate_file`), part k exactly as a one-shard run does (sampling seeds follow the global k), and
:func:`assemble_shards` concatenates the shards in order, so the output equals a one-shard run's row for row. Each
finished part is written atomically to ``<shard output>.parts/part-NNNNNN.parquet`` with a key of everything that
determines it; a rerun claims the finished parts, its own or those another shard layout left beside it
(:func:`_claim_part`), and redoes the rest.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from draftsmith.chat import tokenizer_fingerprint
from draftsmith.io import CURATED_PARQUET, atomic_path, reading, sha256_file
from draftsmith.progress import progress
from draftsmith.regenerate.report import BASE_COUNTS, META_KEY, check_counts, read_report
from draftsmith.regenerated import regenerated_schema

if TYPE_CHECKING:
    from draftsmith.regenerate.turns import Regenerator

log = logging.getLogger("draftsmith.regenerate")

FORMAT = "draftsmith.regenerate/2"  # 2: assistant turns keep the generated ids (draftsmith.regenerated)
PART_KEY = b"draftsmith.regenerate.part"


def _seed_of(*parts) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def num_parts(rows: int, chunk_size: int) -> int:
    """Global parts of ``chunk_size`` rows in an input of ``rows`` rows: ``ceil(rows / chunk_size)``."""
    return -(-rows // chunk_size)


def shard_parts(parts: int, shard: int, shards: int) -> tuple[int, int]:
    """The global parts ``[first, last)`` shard ``shard`` of ``shards`` regenerates: ``first = floor(shard x parts /
    shards)``, ``last = floor((shard + 1) x parts / shards)``; contiguous ranges that cover ``0 .. parts`` once, empty
    when there are more shards than parts.

    Raises:
        ValueError: ``shards < 1`` or ``shard`` outside ``0 .. shards - 1``.
    """
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"regenerate shard {shard} of {shards}: the shards are 0..{shards - 1} (shards >= 1)")
    return shard * parts // shards, (shard + 1) * parts // shards


def _iter_parts(pf: pq.ParquetFile, chunk_size: int, first: int, last: int, path: str | os.PathLike = ""):
    """Yield ``(k, table)`` for the global parts ``k`` in ``[first, last)`` of ``pf``: rows ``[k x chunk_size,
    min((k + 1) x chunk_size, rows))``, whatever the file's row groups; only the row groups holding them are read.
    A damaged row group raises :class:`~draftsmith.io.InputError` naming ``path``."""
    meta = pf.metadata
    start, stop = first * chunk_size, min(last * chunk_size, meta.num_rows)
    if start >= stop:
        return
    groups, pos, offset = [], None, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if offset < stop and offset + n > start:
            groups.append(g)
            pos = offset if pos is None else pos
        offset += n
    k, pending = first, []
    end = min((k + 1) * chunk_size, stop)  # the global row where part k ends
    batches = pf.iter_batches(batch_size=chunk_size, row_groups=groups)
    while True:
        with reading(path, CURATED_PARQUET):
            batch = next(batches, None)
        if batch is None:
            return
        b0, pos = pos, pos + batch.num_rows  # global rows [b0, pos) of this batch
        row = max(start, b0)
        while row < min(pos, stop):
            take = min(end, pos) - row
            pending.append(batch.slice(row - b0, take))
            row += take
            if row == end:
                yield k, pa.Table.from_batches(pending)
                pending, k = [], k + 1
                if k == last:
                    return
                end = min((k + 1) * chunk_size, stop)


def regenerate_file(input_path: str | os.PathLike, output_path: str | os.PathLike, regenerator: Regenerator, *,
                    target_key: str, chunk_size: int, shard: int = 0, shards: int = 1,
                    progress_interval: float = 30.0) -> dict:
    """Regenerate (a shard of) a curated parquet into ``output_path`` (the input's schema with the generated ids of
    :func:`draftsmith.regenerated.regenerated_schema`), resumable by parts; returns
    the report, also stored in the output's metadata (:func:`read_report`).

    The input's rows are cut into ``P = ceil(rows / chunk_size)`` global parts of ``chunk_size`` rows; shard ``shard``
    of ``shards`` regenerates the contiguous parts :func:`shard_parts` gives it, each part ``k`` exactly as an
    unsharded run does (the same rows, a sampling seed of ``seed`` and ``k``), so the shards' outputs in shard order
    (:func:`assemble_shards`) equal a one-shard run's row for row. A shard with no part (more shards than parts)
    writes an empty parquet of that schema, its counts zero. Finished parts are kept in
    ``<output>.parts/part-<k>.parquet`` (``k`` global) with a key of everything that determines them (a part does not
    depend on the shard that made it); a rerun reuses those, and those another shard layout left in the ``*.parts``
    folders beside the output (moved into this shard's folder: a killed run resumes with another
    ``regenerate.shards``), and redoes stale ones. Once the output is written this shard's parts are deleted, with
    the stale files of its folder, and the folder if nothing else is left in it (:func:`assemble_shards` removes the
    rest).

    The report holds the settings, ``input`` / ``input_sha256`` / ``input_rows``, ``chunk_size``, ``num_parts``
    (P), ``shard`` / ``num_shards`` / ``parts`` (``[first, last)``), ``counts`` (reconciled, see
    :meth:`Regenerator.regenerate`), the engine's :meth:`~draftsmith.regenerate.engines.Engine.report`, ``seconds``
    (wall clock) and ``new_tokens_per_s`` (generated tokens per second of generation in this run; ``None`` when every
    part was reused).

    Raises:
        ValueError: the input lacks the curated columns (names the file); a shard outside ``0 .. shards - 1``.
        InputError: the input is not a readable parquet (truncated, damaged), naming it.
    """
    t0 = time.perf_counter()
    output_path = Path(output_path)
    with reading(input_path, CURATED_PARQUET):
        pf = pq.ParquetFile(input_path)
    schema = pf.schema_arrow
    missing = [c for c in ("id", "messages") if c not in schema.names]
    if missing:
        raise ValueError(f"{input_path}: curated parquet lacks column(s) {', '.join(missing)}")
    n_rows = pf.metadata.num_rows
    total_parts = num_parts(n_rows, chunk_size)
    first, last = shard_parts(total_parts, shard, shards)
    settings = regenerator.settings
    s = settings.regenerate
    input_sha = sha256_file(input_path)
    key = hashlib.sha256(json.dumps({
        "format": FORMAT, "input": input_sha, "target": target_key,
        "tokenizer": tokenizer_fingerprint(regenerator.tokenizer), "kwargs": regenerator.kwargs,
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": settings.max_prompt_tokens, "max_turns": s.max_turns,
        "stop_ids": regenerator.stop_ids, "chunk_size": chunk_size, "engine": regenerator.engine.name,
        "dtype": str(next(regenerator.model.parameters()).dtype) if regenerator.model is not None else None,
        "sampling": [s.temperature, s.top_p, s.num_answers, s.seed] if s.temperature > 0 else None,
    }, sort_keys=True).encode()).hexdigest()
    parts_dir = output_path.with_name(output_path.name + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    clean_schema = regenerated_schema(schema.remove_metadata())
    total: collections.Counter = collections.Counter({k: 0 for k in BASE_COUNTS})
    part_paths = []
    shard_rows = min(last * chunk_size, n_rows) - min(first * chunk_size, n_rows)
    log.info("regenerating %d of %d conversations (shard %d of %d: parts %d..%d of the %d parts of %d rows) x %d "
             "answer(s) with engine %s", shard_rows, n_rows, shard, shards, first, last - 1, total_parts, chunk_size,
             s.num_answers, regenerator.engine.name)
    if first == last:
        log.warning("shard %d of %d has no part (%d parts of %d rows for %d shards): its output is empty and its GPU "
                    "idle; regenerate.chunk_size <= %d gives every shard work", shard, shards, total_parts,
                    chunk_size, shards, max(1, n_rows // shards))
    bar = progress(shard_rows, "regenerate" if shards == 1 else f"regenerate shard {shard}", unit="conv",
                   logger=log, interval=progress_interval)
    regenerator.progress = bar
    new_tokens, t_new = 0, 0.0
    try:
        for k, batch in _iter_parts(pf, chunk_size, first, last, input_path):
            part = parts_dir / f"part-{k:06d}.parquet"
            part_paths.append(part)
            info = _claim_part(part, key)
            if info is not None:
                total.update(info["stats"])
                bar.update(batch.num_rows)
                continue
            records = batch.to_pylist()
            if s.temperature > 0:
                torch.manual_seed(_seed_of(s.seed, k))
            t1 = time.perf_counter()
            out, stats = regenerator.regenerate(records)
            check_counts(stats)
            table = pa.Table.from_pylist(out, schema=clean_schema)
            table = table.replace_schema_metadata({PART_KEY: json.dumps({"key": key, "stats": dict(stats)}).encode()})
            with atomic_path(part, suffix=".parquet") as tmp:
                pq.write_table(table, tmp)
            total.update(stats)
            new_tokens += stats["tokens_generated"]
            t_new += time.perf_counter() - t1
            bar.update(len(records))
            log.debug("part %d: %d conversations -> %d rows, %d turns regenerated, %d tokens in %.1f s",
                      k, len(records), len(out), stats["turns_regenerated"], stats["tokens_generated"],
                      time.perf_counter() - t1)
    finally:
        bar.close()
        regenerator.progress = None
    if len(part_paths) != last - first:  # the input changed under the run
        raise AssertionError(f"{input_path}: read {len(part_paths)} parts of shard {shard}, expected {last - first}")
    check_counts(total)
    report = {
        "format": FORMAT,
        "input": str(input_path), "input_sha256": input_sha, "input_rows": n_rows,
        "chunk_size": chunk_size, "num_parts": total_parts,
        "shard": shard, "num_shards": shards, "parts": [first, last],
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": settings.max_prompt_tokens, "max_turns": s.max_turns,
        "chat_template_kwargs": regenerator.kwargs, "stop_token_ids": regenerator.stop_ids,
        "target_fingerprint": target_key, **regenerator.engine.report(),
        "fused": regenerator.fused,
        "temperature": s.temperature, "top_p": s.top_p, "num_answers": s.num_answers, "seed": s.seed,
        "counts": dict(sorted(total.items())),
        "seconds": round(time.perf_counter() - t0, 3),
        "new_tokens_per_s": round(new_tokens / t_new, 1) if t_new else None,
    }
    with atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, clean_schema.with_metadata({META_KEY: json.dumps(report).encode()})) as w:
            for part in part_paths:
                w.write_table(pq.read_table(part).replace_schema_metadata(None).cast(clean_schema))
    _clean_parts(parts_dir, part_paths, key)
    return report


def _part_key(path: Path) -> dict:
    """A finished part's ``{"key", "stats"}`` (``{}`` for a file that is not one)."""
    try:
        return json.loads((pq.read_schema(path).metadata or {}).get(PART_KEY, b"{}"))
    except (OSError, ValueError, pa.ArrowException):
        return {}


def _claim_part(part: Path, key: str) -> dict | None:
    """Part ``part`` finished with ``key``: in this shard's folder, or in a sibling ``*.parts`` folder (another shard
    layout's), then moved here (``os.replace``: atomic; shards of one layout own disjoint parts). Its ``{"key",
    "stats"}``, or None when it must be regenerated (missing, or stale: logged)."""
    k = part.name
    here = part.parent
    for candidate in [part] + sorted(d / k for d in here.parent.glob("*.parts") if d != here):
        if not candidate.is_file():
            continue
        info = _part_key(candidate)
        if info.get("key") != key:
            if candidate == part:
                log.info("%s: stale (other input or settings): redone", part)
            continue
        if candidate != part:
            os.replace(candidate, part)
            log.info("%s: reused, finished by a run of another shard layout (%s)", part, candidate.parent.name)
        else:
            log.info("%s: reused (finished earlier)", part)
        return info
    return None


def _clean_parts(parts_dir: Path, part_paths: list[Path], key: str) -> None:
    """After the shard's output is written: delete its parts, the stale files and temporaries of its folder, and
    the folder when empty. Parts of other shards finished with ``key`` (another layout's) stay for them."""
    for path in part_paths:
        path.unlink(missing_ok=True)
    for path in parts_dir.iterdir():
        if path.name.startswith(".") or _part_key(path).get("key") != key:
            path.unlink(missing_ok=True)
    try:
        parts_dir.rmdir()
    except OSError:
        log.info("%s: kept, it holds parts of other shards", parts_dir)


#: Report keys every shard of one regenerate run agrees on (:func:`assemble_shards` refuses a shard that does not).
SHARD_AGREE = ("format", "input", "input_sha256", "input_rows", "chunk_size", "num_parts", "num_shards",
               "target_fingerprint", "max_new_tokens", "max_prompt_tokens", "max_turns", "chat_template_kwargs",
               "stop_token_ids", "temperature", "top_p", "num_answers", "seed")
#: Report keys of one shard's run only: kept under the assembled report's ``shards``.
_PER_SHARD = ("shard", "parts", "engine", "cuda_graphs", "memory_budget_gib", "rows_capped_batches", "counts",
              "seconds", "new_tokens_per_s")


def assemble_shards(shard_paths: Sequence[str | os.PathLike], output_path: str | os.PathLike) -> dict:
    """Concatenate the regenerated shard parquets of one run (:func:`regenerate_file` with ``shard`` = 0 .. n - 1),
    in shard order, into ``output_path`` atomically; returns its report, also stored in its metadata.

    The output equals a one-shard run's row for row (same schema, rows in global part order). Its report holds the
    shards' common settings (:data:`SHARD_AGREE`), ``counts`` summed over the shards (reconciled as one run's),
    ``seconds`` of the longest shard and ``new_tokens_per_s`` summed over the shards (they run at the same time;
    ``None`` if no shard generated anything), ``engine`` (the shards' engines, comma-separated when they differ),
    ``cuda_graphs`` / ``rows_capped_batches`` summed and ``memory_budget_gib`` the largest (``None`` where no shard
    has one), and each shard's own report under ``shards``. The ``shard-*.parquet.parts`` folders beside the shards
    (parts of an earlier shard layout that none of this run's shards needed) are removed.

    Args:
        shard_paths: the shard files, shard 0 first.
        output_path: the assembled parquet (``results/regenerated/train.parquet``).

    Raises:
        FileNotFoundError: a shard file does not exist.
        ValueError: (naming the file) no shard given; a file without a regenerate shard report; a shard whose report
            disagrees with shard 0's on the input file, its rows, the settings or the target fingerprint; a shard
            given out of order, or from a run of another shard count; shards whose part ranges do not follow each
            other from part 0 to the input's last part (a shard missing); a shard whose rows are not its counts'.
        AssertionError: the summed counts do not reconcile.
    """
    paths = [Path(p) for p in shard_paths]
    if not paths:
        raise ValueError(f"{output_path}: no regenerate shard to assemble")
    reports = []
    for i, path in enumerate(paths):
        if not path.exists():
            raise FileNotFoundError(f"{path}: regenerate shard {i} does not exist")
        rep = read_report(path)
        if "shard" not in rep or "parts" not in rep:
            raise ValueError(f"{path}: its regenerate report names no shard and part range (written by another "
                             "version of draftsmith): rerun the regenerate_shard jobs")
        reports.append(rep)
    head = reports[0]
    for path, rep in zip(paths, reports):
        differ = [k for k in SHARD_AGREE if rep.get(k) != head.get(k)]
        if differ:
            raise ValueError(f"{path}: a shard of another regenerate run than {paths[0]}: "
                             + "; ".join(f"{k} {rep.get(k)!r} != {head.get(k)!r}" for k in differ))
    nxt = 0
    for i, (path, rep) in enumerate(zip(paths, reports)):
        first, last = rep["parts"]
        if rep["shard"] != i:
            raise ValueError(f"{path}: is shard {rep['shard']} of {rep['num_shards']}, given as shard {i}: a shard is "
                             "missing or out of order")
        if first != nxt or last < first:
            raise ValueError(f"{path}: holds parts [{first}, {last}) but the parts before it end at {nxt}: a shard "
                             "is missing or out of order")
        rows = pq.ParquetFile(path).metadata.num_rows
        c = rep["counts"]
        if rows != c.get("regenerated", 0) + c.get("kept_original", 0):
            raise ValueError(f"{path}: holds {rows} rows, its counts {c.get('regenerated', 0)} regenerated + "
                             f"{c.get('kept_original', 0)} kept original")
        nxt = last
    if nxt != head["num_parts"]:
        raise ValueError(f"{paths[-1]}: the shards end at part {nxt} of the input's {head['num_parts']}: a shard is "
                         "missing")
    if head["num_shards"] != len(paths):
        raise ValueError(f"{paths[-1]}: {len(paths)} shard file(s) given for a run of {head['num_shards']} shards: a "
                         "shard is missing")
    total: collections.Counter = collections.Counter()
    for rep in reports:
        total.update(rep["counts"])
    check_counts(total)
    if total["records_in"] != head["input_rows"]:
        raise AssertionError(f"regenerate shards read {total['records_in']} records of {head['input_rows']}")

    def summed(values):
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    rates = [r["new_tokens_per_s"] for r in reports]
    graphs = [r["cuda_graphs"] for r in reports if r.get("cuda_graphs") is not None]
    budgets = [r["memory_budget_gib"] for r in reports if r.get("memory_budget_gib") is not None]
    report = {k: v for k, v in head.items() if k not in _PER_SHARD}
    report.update({
        "engine": ",".join(sorted({r["engine"] for r in reports})),
        "cuda_graphs": ({"captured": sum(g["captured"] for g in graphs), "failed": sum(g["failed"] for g in graphs)}
                        if graphs else None),
        "memory_budget_gib": max(budgets) if budgets else None,
        "rows_capped_batches": summed(r.get("rows_capped_batches") for r in reports),
        "counts": dict(sorted(total.items())),
        "seconds": max(r["seconds"] for r in reports),
        "new_tokens_per_s": round(summed(rates), 1) if summed(rates) is not None else None,
        "shards": reports,
    })
    schema = pq.read_schema(paths[0]).remove_metadata()
    with atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, schema.with_metadata({META_KEY: json.dumps(report).encode()})) as w:
            for path in paths:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                    w.write_table(pa.Table.from_batches([batch]).replace_schema_metadata(None).cast(schema))
    for folder in {p.parent for p in paths}:  # parts an earlier shard layout left and no shard of this one took
        for parts in folder.glob("shard-*.parquet.parts"):
            shutil.rmtree(parts, ignore_errors=True)
    return report
