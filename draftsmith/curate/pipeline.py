"""The curate run: sources, de-duplication, seeded sampling, the id-hash split, outputs and report."""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import ClassVar, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from draftsmith.io import (
    InputError,
    atomic_path,
    disk_full,
    is_disk_full,
    remove_dead_temporaries,
    write_json,
    writer_mark,
)
from draftsmith.settings import SectionSettings, StageSettings

from .adapters import ADAPTERS, COLUMN_FIELDS
from .normalize import normalize_conversation
from .readers import _find
from .schema import DROP_REASONS, EXAMPLES_PER_REASON, OUTPUT_SCHEMA, REPORT_FORMAT, CurateError, DropRow, Malformed

log = logging.getLogger("draftsmith.curate")

ROW_GROUP_ROWS = 4096  # rows per Parquet row group in the outputs
SPLITS = ("train", "eval", "both")
# Salt of the split hash. Changing it moves rows between splits: never change it.
_SPLIT_SALT = 0x5EED_C0FF_EE15_D1CE

# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CurateDataOptions(SectionSettings):
    """The ``data`` keys curate reads besides the sources (the rule passes those, resolved, apart).

    ``seed``: sampling seed (``max_samples``, ``weight``); ``eval_fraction``: share of ``split: both`` rows held
    out, in [0, 1] (checked by :func:`curate`); ``max_chars``: optional length limit of a conversation in
    characters (see :func:`normalize_conversation`), None for none; ``on_bad_line``: ``drop`` (a record that does
    not decode is a counted ``malformed_json`` drop) or ``stop`` (it fails the job with an
    :class:`~draftsmith.io.InputError` naming the file, line and column).
    """

    SECTION: ClassVar[str] = "data"
    seed: int
    eval_fraction: float
    max_chars: int | None
    on_bad_line: str


@dataclasses.dataclass(frozen=True)
class CurateSettings(StageSettings):
    """What rule ``curate`` reads (:func:`curate`)."""

    STAGE: ClassVar[str] = "curate"
    data: CurateDataOptions


# ----------------------------------------------------------------------------------------------
# Sources, sampling and the split
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Source:
    """One entry of ``data.sources`` (see the schema), with its resolved local ``path``."""

    name: str
    path: Path
    adapter: str
    config_path: str = ""
    columns: dict = dataclasses.field(default_factory=dict)
    options: dict = dataclasses.field(default_factory=dict)
    max_samples: int | None = None
    weight: float = 1.0
    split: str = "both"

    @classmethod
    def from_config(cls, entry: dict) -> "Source":
        """From a config entry; ``local_path`` (set by the rule) wins over ``path``."""
        path = entry.get("local_path") or entry["path"]
        return cls(name=entry["name"], path=Path(path), adapter=entry["adapter"],
                   config_path=entry.get("path", str(path)), columns=dict(entry.get("columns") or {}),
                   options=dict(entry.get("options") or {}), max_samples=entry.get("max_samples"),
                   weight=float(entry.get("weight", 1.0)), split=entry.get("split", "both"))

    def check(self) -> None:
        """Raise :class:`CurateError` naming the source for any configuration mistake."""
        where = f"data.sources[{self.name}]"
        if self.adapter not in ADAPTERS:
            raise CurateError(f"{where}: unknown adapter {self.adapter!r} (have {sorted(ADAPTERS)})")
        adapter = ADAPTERS[self.adapter]
        if self.split not in SPLITS:
            raise CurateError(f"{where}: split {self.split!r} not one of {SPLITS}")
        if adapter.prompt_only and self.split != "eval":
            raise CurateError(f"{where}: adapter {self.adapter} gives prompts without answers; "
                              "they can only feed evaluation: set split: eval")
        bad = sorted(set(self.options) - set(adapter.options))
        if bad:
            raise CurateError(f"{where}: options {bad} not understood by adapter {self.adapter} "
                              f"(accepts {list(adapter.options)})")
        if self.columns and not adapter.columns:
            raise CurateError(f"{where}: columns apply to user-data adapters only, not {self.adapter}")
        bad = sorted(set(self.columns) - set(COLUMN_FIELDS))
        if bad:
            raise CurateError(f"{where}: columns {bad} are not fields (use {list(COLUMN_FIELDS)})")
        if self.weight < 0 or (self.max_samples is not None and self.max_samples < 0):
            raise CurateError(f"{where}: weight and max_samples must be >= 0")
        tools = self.options.get("tools")
        if tools is not None and tools not in ("suite", "exact", "all"):
            raise CurateError(f"{where}: options.tools {tools!r} not one of suite, exact, all")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele, Lea & Flood, OOPSLA 2014) on a uint64 array.

    A bijective, well-mixed 64-bit hash; used for seeded sampling keys and the split hash.
    """
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def id_to_u64(row_ids: Iterable[str]) -> np.ndarray:
    """Row ids (16 hex digits) as a uint64 array."""
    return np.array([int(i, 16) for i in row_ids], dtype=np.uint64)


def eval_mask(ids_u64: np.ndarray, eval_fraction: float) -> np.ndarray:
    """Which rows of a ``split: both`` source go to eval: ``splitmix64(id ^ salt) / 2**64 < fraction``.

    Depends on the row id only (not on the seed, the source, or the other rows), so adding a
    source, changing the seed or the mix never moves an existing row between splits.
    """
    u = splitmix64(np.asarray(ids_u64, dtype=np.uint64) ^ np.uint64(_SPLIT_SALT))
    return (u >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 < eval_fraction


def sampling_keys(ids_u64: np.ndarray, seed: int, source: str) -> np.ndarray:
    """Seeded per-row sampling keys: rows with the smallest keys are kept (bottom-k sampling)."""
    salt = int.from_bytes(hashlib.sha256(f"{seed}:{source}".encode()).digest()[:8], "little")
    return splitmix64(np.asarray(ids_u64, dtype=np.uint64) ^ np.uint64(salt))


def plan_copies(ids_u64: np.ndarray, *, seed: int, source: str, max_samples: int | None,
                weight: float) -> tuple[np.ndarray, np.ndarray]:
    """How many copies of each valid, unique row to write.

    ``max_samples`` keeps the ``max_samples`` rows with the smallest seeded key; ``weight`` then
    scales that count to ``round(weight * kept)``: below 1 it keeps a smaller bottom-k subset, above
    1 every row is written ``floor(weight)`` times and the rows with the smallest keys once more.
    Deterministic for a seed, independent of the file order.

    Returns:
        ``(copies int64 [n], dropped_by int8 [n])`` with ``dropped_by`` 0 = kept,
        1 = ``max_samples``, 2 = ``weight``.
    """
    n = len(ids_u64)
    order = np.argsort(sampling_keys(ids_u64, seed, source), kind="stable")
    cap = n if max_samples is None else min(n, max_samples)
    target = int(round(weight * cap))
    copies = np.zeros(n, dtype=np.int64)
    dropped_by = np.zeros(n, dtype=np.int8)
    dropped_by[order[cap:]] = 1
    if weight <= 1:
        copies[order[:target]] = 1
        dropped_by[order[target:cap]] = 2
    else:
        base = int(math.floor(weight))
        copies[order[:cap]] = base
        copies[order[:target - base * cap]] += 1
    return copies, dropped_by


# ----------------------------------------------------------------------------------------------
# The curate run
# ----------------------------------------------------------------------------------------------


class _Stats:
    """Per-source counters for report.json."""

    def __init__(self, source: Source):
        self.source = source
        self.read = 0
        self.dropped: dict[str, int] = {}
        self.examples: dict[str, list[dict]] = {}
        self.trimmed_leading = 0
        self.trimmed_trailing = 0
        self.kept = self.train = self.eval = self.repeats = 0

    def drop(self, reason: str, origin: str, row_id: str | None = None, detail: str = "") -> None:
        """Count one dropped row; keep it as an example while the reason has fewer than 5."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES_PER_REASON:
            ex.append({"origin": origin, "id": row_id, "detail": detail})

    def report(self) -> dict:
        s = self.source
        return {
            "path": s.config_path, "local_path": str(s.path), "adapter": s.adapter, "split": s.split,
            "max_samples": s.max_samples, "weight": s.weight,
            "read": self.read, "kept": self.kept, "dropped_total": sum(self.dropped.values()),
            "dropped": dict(sorted(self.dropped.items())), "examples": self.examples,
            "train": self.train, "eval": self.eval, "repeats": self.repeats,
            "written": self.train + self.eval + self.repeats,
            "trimmed_leading_messages": self.trimmed_leading,
            "trimmed_trailing_messages": self.trimmed_trailing,
        }


class _RowGroupWriter:
    """A ParquetWriter that buffers tables and writes row groups of ~``rows`` rows."""

    def __init__(self, path: Path, schema: pa.Schema, rows: int = ROW_GROUP_ROWS):
        self.writer = pq.ParquetWriter(path, schema, compression="zstd")
        self.schema, self.rows = schema, rows
        self.pending: list[pa.Table] = []
        self.n_pending = 0
        self.n_rows = 0

    def write(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self.pending.append(table)
        self.n_pending += table.num_rows
        if self.n_pending >= self.rows:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            table = pa.concat_tables(self.pending)
            self.writer.write_table(table, row_group_size=max(self.rows, table.num_rows))
            self.n_rows += table.num_rows
            self.pending, self.n_pending = [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


@contextlib.contextmanager
def _read_errors_name(source: Source, spool: Path):
    """Turn an I/O or decoding failure while reading a source into a CurateError naming it (a full disk while
    writing the ``spool`` is a :class:`~draftsmith.io.DiskFullError` naming it instead)."""
    try:
        yield
    except CurateError:
        raise
    except (OSError, EOFError, zlib.error, pa.ArrowException, SyntaxError) as exc:
        if is_disk_full(exc):
            raise disk_full(spool, exc) from exc
        raise CurateError(f"data.sources[{source.name}]: {source.path}: read error "
                          f"({type(exc).__name__}: {exc})") from exc


def _spool_source(source: Source, stats: _Stats, spool: Path, max_chars: int | None,
                  warn_limit: int = 20, on_bad_line: str = "drop") -> array.array:
    """Pass 1: read, convert, normalise and validate; spool every valid row as one JSON line.

    The spool line is the compact JSON already built for the row id, so pass 1 serialises each row
    once; pass 2 de-duplicates and samples on the ids and parses only the kept lines, in C++
    (``pyarrow.json``).

    A record that does not decode (:class:`Malformed`) is a counted drop, or with ``on_bad_line="stop"`` raises
    :class:`~draftsmith.io.InputError` naming its file, line and column.

    Returns the uint64 ids of the spooled rows, in spool order (8 bytes per row).
    """
    adapter = ADAPTERS[source.adapter]
    options = dict(source.options, _columns=source.columns)
    if source.adapter == "tooltalk":
        apis = _find(source.path, "apis/api.py", "ToolTalk apis/api.py") if source.path.is_dir() else []
        if not apis:
            raise CurateError(f"data.sources[{source.name}]: {source.path}: ToolTalk needs the "
                              "package folder with apis/*.py (tool schemas)")
        options["_apis_dir"] = str(apis[0].parent)
    ids = array.array("Q")
    malformed = 0
    first_malformed = ""
    with _read_errors_name(source, spool), open(spool, "wb", buffering=1 << 20) as out:
        for origin, rec in adapter.read(source.path, options):
            stats.read += 1
            if isinstance(rec, Malformed):
                if on_bad_line == "stop":
                    raise InputError(origin, rec.detail.removeprefix(f"{origin}: "),
                                     expected=f"one JSON record per line or array element (data.sources[{source.name}],"
                                              f" adapter {source.adapter})",
                                     action="fix or delete that record, or set data.on_bad_line: drop to count it "
                                            "as a dropped row of report.json")
                malformed += 1
                first_malformed = first_malformed or rec.detail
                if malformed <= warn_limit:
                    log.warning("%s: %s", source.name, rec.detail)
                stats.drop(rec.reason, origin, None, rec.detail)
                continue
            try:
                messages, tools = adapter.convert(rec, options)
                conv = normalize_conversation(messages, tools, prompt_only=adapter.prompt_only,
                                              max_chars=max_chars)
            except DropRow as drop:
                stats.drop(drop.reason, origin, None, drop.detail)
                continue
            except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
                # a record of an unexpected shape deep inside (e.g. a list where an object was
                # expected): dropped and reported, never a crash of the whole run
                stats.drop("bad_record", origin, None, f"{type(exc).__name__}: {exc}")
                continue
            ids.append(int(conv.id, 16))
            stats.trimmed_leading += conv.trimmed_leading
            stats.trimmed_trailing += conv.trimmed_trailing
            out.write(conv.json_line(source.name, origin))
    if malformed > warn_limit:
        log.warning("%s: %d malformed records in all (first %d logged; examples in the report)",
                    source.name, malformed, warn_limit)
    if stats.read == 0:
        raise CurateError(f"data.sources[{source.name}]: {source.path}: no records found")
    if malformed == stats.read:
        raise CurateError(f"data.sources[{source.name}]: {source.path}: no readable record "
                          f"({malformed} malformed; first: {first_malformed})")
    invalid = stats.read - len(ids)
    if ids and invalid * 2 >= stats.read:  # kept going, but most of the file did not fit the adapter
        reason, count = max(stats.dropped.items(), key=lambda kv: kv[1])
        log.warning("%s: %d of %d rows (%.0f%%) are invalid for adapter %s, mostly %s (%d): %s; examples in "
                    "report.json", source.name, invalid, stats.read, 100 * invalid / stats.read, source.adapter,
                    reason, count, DROP_REASONS.get(reason, reason))
    return ids


def check_some_kept(source: Source, stats: "_Stats") -> None:
    """Raise unless a source that was read kept at least one row (or was sampled to none on purpose).

    A source whose every row is dropped is a mistake, most often a file in another format than its adapter
    (an alpaca file under ``adapter: openai``): rc 0 and "kept 0" would hide it.

    Raises:
        CurateError: naming the source, its path, its adapter and the main drop reason with a count and an
            example (file:line and detail).
    """
    if stats.kept or not stats.read or source.max_samples == 0 or source.weight == 0:
        return
    reason, count = max(stats.dropped.items(), key=lambda kv: kv[1])
    example = (stats.examples.get(reason) or [{}])[0]
    where = f" e.g. {example.get('origin')}: {example.get('detail')}" if example else ""
    others = {k: v for k, v in sorted(stats.dropped.items()) if k != reason}
    raise CurateError(
        f"data.sources[{source.name}]: {source.path}: every one of its {stats.read} rows was dropped (adapter "
        f"{source.adapter}); main reason: {reason} × {count} ({DROP_REASONS.get(reason, reason)}),{where}"
        + (f"; other reasons: {others}" if others else "")
        + f". Is the file in the format adapter {source.adapter} reads (schemas/config.schema.yaml, "
          "data.sources.adapter)?")


def _with_suffix(ids: pa.Array, copy_index: np.ndarray) -> pa.Array:
    """Ids of repeated rows get ``~k`` for copy k >= 1 so ids stay unique."""
    if not copy_index.any():
        return ids
    suffix = pa.array(["" if k == 0 else f"~{k}" for k in copy_index.tolist()], pa.string())
    return pc.binary_join_element_wise(ids, suffix, "")


def _read_json_lines(lines: list[bytes]) -> pa.Table:
    """Parse spooled JSON lines into a table of :data:`OUTPUT_SCHEMA` (Arrow's C++ JSON reader)."""
    data = b"".join(lines)
    table = pa_json.read_json(
        io.BytesIO(data),
        read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
        parse_options=pa_json.ParseOptions(explicit_schema=OUTPUT_SCHEMA,
                                           unexpected_field_behavior="ignore"))
    return table.select(OUTPUT_SCHEMA.names).cast(OUTPUT_SCHEMA)


def _emit_source(source: Source, stats: _Stats, spool: Path, ids: array.array, writers: dict,
                 *, kept_before: np.ndarray, seed: int, eval_fraction: float,
                 batch_rows: int = 4096, batch_bytes: int = 32 << 20) -> np.ndarray:
    """Pass 2: de-duplicate, sample (max_samples, weight), split by id hash, write the kept rows.

    A row whose id was kept from an earlier source (``kept_before``, sorted uint64) is
    ``duplicate_across_sources``; a later occurrence of an id within the source is ``duplicate``.
    Only the spool lines of kept rows are parsed, ``batch_rows`` / ``batch_bytes`` at a time.

    Returns:
        The uint64 ids of the kept rows.
    """
    ids_u64 = np.frombuffer(ids, dtype=np.uint64) if len(ids) else np.zeros(0, np.uint64)
    n = len(ids_u64)
    across = np.isin(ids_u64, kept_before)
    first = np.zeros(n, dtype=bool)
    first[np.unique(ids_u64, return_index=True)[1]] = True
    dup = ~first & ~across
    unique = np.flatnonzero(first & ~across)
    copies = np.zeros(n, dtype=np.int64)
    dropped_by = np.zeros(n, dtype=np.int8)
    copies[unique], dropped_by[unique] = plan_copies(
        ids_u64[unique], seed=seed, source=source.name, max_samples=source.max_samples,
        weight=source.weight)
    dropped_by[across], dropped_by[dup] = 3, 4
    if source.split == "both":
        to_eval = eval_mask(ids_u64, eval_fraction)
    else:
        to_eval = np.full(n, source.split == "eval")
    copies = np.where(to_eval & (copies > 0), 1, copies)  # repeats go to training only
    kept = copies > 0
    reasons = {1: ("max_samples", f"not sampled (max_samples {source.max_samples})"),
               2: ("weight", f"not sampled (weight {source.weight})"),
               3: ("duplicate_across_sources", "same as a row kept from an earlier source"),
               4: ("duplicate", "same as an earlier row of this source")}
    examples: dict[int, int] = {}  # spool line -> reason code, for the report's examples
    for code, (reason, _) in reasons.items():
        idx = np.flatnonzero(dropped_by == code)
        if len(idx):
            stats.dropped[reason] = stats.dropped.get(reason, 0) + int(len(idx))
            examples.update((int(i), code) for i in idx[:EXAMPLES_PER_REASON])
    stats.kept = int(kept.sum())
    stats.eval = int((kept & to_eval).sum())
    stats.train = stats.kept - stats.eval
    stats.repeats = int(copies[~to_eval].sum()) - stats.train

    def flush(lines: list[bytes], rows: list[int]) -> None:
        table = _read_json_lines(lines)
        rows_np = np.array(rows, dtype=np.int64)
        parsed = np.array([int(i, 16) for i in table.column("id").to_pylist()], dtype=np.uint64)
        if not np.array_equal(parsed, ids_u64[rows_np]):
            raise RuntimeError(f"{source.name}: spool {spool} out of step with its ids")
        for split, in_split in (("train", ~to_eval[rows_np]), ("eval", to_eval[rows_np])):
            counts = np.where(in_split, copies[rows_np], 0)
            if not counts.any():
                continue
            take = np.repeat(np.arange(len(rows_np)), counts)
            copy_index = np.arange(len(take)) - np.repeat(np.cumsum(counts) - counts, counts)
            part = table.take(pa.array(take))
            part = part.set_column(0, OUTPUT_SCHEMA.field("id"),
                                   _with_suffix(part.column("id").combine_chunks(), copy_index))
            writers[split].write(part)

    n_lines = 0
    lines: list[bytes] = []
    rows: list[int] = []
    size = 0
    with open(spool, "rb") as fh:
        for i, line in enumerate(fh):
            n_lines += 1
            if i in examples:
                reason, detail = reasons[examples[i]]
                stats.examples.setdefault(reason, []).append(
                    {"origin": json.loads(line)["origin"], "id": f"{int(ids_u64[i]):016x}",
                     "detail": detail})
            if not kept[i]:
                continue
            lines.append(line)
            rows.append(i)
            size += len(line)
            if len(lines) >= batch_rows or size >= batch_bytes:
                flush(lines, rows)
                lines, rows, size = [], [], 0
    if lines:
        flush(lines, rows)
    if n_lines != n:
        raise RuntimeError(f"{source.name}: spool holds {n_lines} rows, expected {n}")
    return ids_u64[kept]


def check_sources(sources: list[dict | Source]) -> list[Source]:
    """Check the ``data.sources`` configuration without reading any data (Snakemake parse time).

    Returns:
        The :class:`Source` objects.

    Raises:
        CurateError: no source, a name used twice, or a source's configuration error
            (:meth:`Source.check`), naming the source.
    """
    srcs = [s if isinstance(s, Source) else Source.from_config(s) for s in sources]
    if not srcs:
        raise CurateError("data.sources is empty: nothing to curate")
    names = [s.name for s in srcs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CurateError(f"data.sources: names {dupes} are used more than once")
    for s in srcs:
        s.check()
    return srcs


def curate(sources: list[dict | Source], train_path: str | Path, eval_path: str | Path,
           report_path: str | Path, settings: CurateSettings) -> dict:
    """Curate every source into the train / eval Parquet files and write the report.

    Sources are processed in config order; a conversation already kept from an earlier source is
    dropped as ``duplicate_across_sources``. Rows of ``split: both`` sources go to eval when
    :func:`eval_mask` says so; ``train`` / ``eval`` sources go all to one split.

    Args:
        sources: ``data.sources`` entries (dicts as in config, with ``local_path``) or
            :class:`Source` objects.
        train_path, eval_path, report_path: outputs (written atomically; nothing is renamed into
            place unless every source succeeded).
        settings: ``data.seed`` (sampling seed of max_samples, weight), ``data.eval_fraction`` (share of
            ``split: both`` rows held out, in [0, 1]), ``data.max_chars`` (optional length limit, see
            :func:`normalize_conversation`) and ``data.on_bad_line`` (``drop`` or ``stop``).

    Returns:
        The report dict (also written to ``report_path``).

    Raises:
        CurateError: bad source configuration; a missing path; a source with no readable record, or
            whose every row was dropped (the message names the source, path, adapter and main reason).
        InputError: with ``data.on_bad_line: stop``, the first record that does not decode (file, line, column).
    """
    seed, eval_fraction, max_chars = settings.data.seed, settings.data.eval_fraction, settings.data.max_chars
    srcs = check_sources(sources)
    for s in srcs:
        if not s.path.exists():
            raise CurateError(f"data.sources[{s.name}]: {s.path}: no such file or folder")
    if not 0 <= eval_fraction <= 1:
        raise CurateError(f"data.eval_fraction {eval_fraction} not in [0, 1]")

    train_path, eval_path, report_path = Path(train_path), Path(eval_path), Path(report_path)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    # spool folders and temporary parquet files left by a killed run (the next writes of train / eval / report
    # remove their own temporaries as well; these are named in the log)
    remove_dead_temporaries(train_path.parent, [".curate-spool-", f".{train_path.name}.", f".{eval_path.name}."],
                            what="curate")
    spool_dir = Path(tempfile.mkdtemp(prefix=".curate-spool-", suffix=f".{writer_mark()}", dir=train_path.parent))
    meta = {b"draftsmith.curate": json.dumps({
        "format": "draftsmith.curated/1", "seed": seed, "eval_fraction": eval_fraction,
        "max_chars": max_chars, "sources": [s.name for s in srcs]}).encode()}
    schema = OUTPUT_SCHEMA.with_metadata(meta)
    all_stats = []
    try:
        with contextlib.ExitStack() as stack:
            tmp_train = stack.enter_context(atomic_path(train_path, suffix=".parquet"))
            tmp_eval = stack.enter_context(atomic_path(eval_path, suffix=".parquet"))
            writers = {"train": _RowGroupWriter(tmp_train, schema),
                       "eval": _RowGroupWriter(tmp_eval, schema)}
            try:
                kept_ids = np.zeros(0, dtype=np.uint64)  # sorted
                for s in srcs:
                    stats = _Stats(s)
                    spool = spool_dir / f"{len(all_stats)}.jsonl"
                    log.info("%s: reading %s (adapter %s)", s.name, s.path, s.adapter)
                    ids = _spool_source(s, stats, spool, max_chars, on_bad_line=settings.data.on_bad_line)
                    kept = _emit_source(s, stats, spool, ids, writers, kept_before=kept_ids,
                                        seed=seed, eval_fraction=eval_fraction)
                    check_some_kept(s, stats)
                    kept_ids = np.sort(np.concatenate([kept_ids, kept]))
                    spool.unlink()
                    all_stats.append(stats)
                    log.info("%s: read %d, kept %d (train %d, eval %d, +%d repeats), dropped %s%s",
                             s.name, stats.read, stats.kept, stats.train, stats.eval,
                             stats.repeats, stats.dropped or "none",
                             f" (each with its file and line: {report_path})" if stats.dropped else "")
            finally:
                for w in writers.values():
                    w.close()
            report = _build_report(all_stats, writers, seed=seed, eval_fraction=eval_fraction,
                                   max_chars=max_chars)
        write_json(report_path, report)
    finally:
        shutil.rmtree(spool_dir, ignore_errors=True)
    return report


def _build_report(all_stats: list[_Stats], writers: dict, **settings) -> dict:
    sources = {st.source.name: st.report() for st in all_stats}
    for name, r in sources.items():
        if r["read"] != r["kept"] + r["dropped_total"]:
            raise RuntimeError(f"{name}: counts do not reconcile: read {r['read']} != kept "
                               f"{r['kept']} + dropped {r['dropped_total']}")
        if r["kept"] != r["train"] + r["eval"]:
            raise RuntimeError(f"{name}: kept {r['kept']} != train {r['train']} + eval {r['eval']}")
    totals = {k: sum(r[k] for r in sources.values())
              for k in ("read", "kept", "dropped_total", "train", "eval", "repeats", "written")}
    dropped: dict[str, int] = {}
    for r in sources.values():
        for reason, n in r["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
    totals["dropped"] = dict(sorted(dropped.items()))
    rows = {"train": writers["train"].n_rows, "eval": writers["eval"].n_rows}
    if rows["train"] + rows["eval"] != totals["written"]:
        raise RuntimeError(f"rows written {rows} != {totals['written']} counted")
    return {
        "format": REPORT_FORMAT,
        "settings": settings,
        "sources": sources,
        "totals": totals,
        "rows": rows,
        "reconciled": True,
        "drop_reasons": DROP_REASONS,
    }
