"""The tokenized parquet: the contract between tokenize and the stages that read its rows.

``results/tokenized/{train,eval}.parquet``: ``id`` string, ``source`` string, ``input_ids`` list<int32>,
``loss_mask`` list<int8>, ``num_tokens`` int32 (:data:`TOKENIZED_SCHEMA`), with schema metadata
``draftsmith.chat_template_kwargs``, ``draftsmith.tokenizer_fingerprint``, ``draftsmith.max_length`` (JSON values):
tokenize writes it (:func:`tokenized_metadata`), extract and merge read the rows (:func:`read_tokenized`), evaluate
renders its prompts with the recorded template kwargs (:func:`read_tokenized_metadata`).

Readers see the metadata one way: a dict keyed by the short names of :data:`TOKENIZED_META`
(``chat_template_kwargs``, ``tokenizer_fingerprint``, ``max_length``), JSON-decoded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from draftsmith.io import TOKENIZED_PARQUET, reading

META_CHAT_TEMPLATE_KWARGS = b"draftsmith.chat_template_kwargs"
META_TOKENIZER_FINGERPRINT = b"draftsmith.tokenizer_fingerprint"
META_MAX_LENGTH = b"draftsmith.max_length"
#: parquet schema metadata key -> the short name readers give it
TOKENIZED_META = {
    META_CHAT_TEMPLATE_KWARGS: "chat_template_kwargs",
    META_TOKENIZER_FINGERPRINT: "tokenizer_fingerprint",
    META_MAX_LENGTH: "max_length",
}

TOKENIZED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
])


@dataclass
class TokenizedRow:
    """One training row: ``input_ids`` int32 [T] and ``loss_mask`` int8 [T] (1 = target-generated token)."""

    id: str
    source: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


def rows_table(rows: list[TokenizedRow], schema: pa.Schema = TOKENIZED_SCHEMA) -> pa.Table:
    """The rows as one table of :data:`TOKENIZED_SCHEMA` (``schema``: the same with its file's metadata)."""
    lengths = np.fromiter((len(r.input_ids) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate([r.input_ids for r in rows]).astype(np.int32, copy=False) if rows else np.zeros(0, np.int32)
    masks = np.concatenate([r.loss_mask for r in rows]).astype(np.int8, copy=False) if rows else np.zeros(0, np.int8)
    return pa.Table.from_arrays([
        pa.array([r.id for r in rows], pa.string()),
        pa.array([r.source for r in rows], pa.string()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids, pa.int32())),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks, pa.int8())),
        pa.array(lengths, pa.int32()),
    ], schema=schema)


def tokenized_metadata(chat_template_kwargs: dict, fingerprint: str, max_length: int) -> dict[bytes, bytes]:
    """Parquet schema metadata of a tokenized file (bytes keys, JSON values)."""
    return {
        META_CHAT_TEMPLATE_KWARGS: json.dumps(chat_template_kwargs, sort_keys=True).encode(),
        META_TOKENIZER_FINGERPRINT: json.dumps(fingerprint).encode(),
        META_MAX_LENGTH: json.dumps(int(max_length)).encode(),
    }


def decode_metadata(path: str | os.PathLike, raw: dict[bytes, bytes] | None, *, required: bool) -> dict:
    """The :data:`TOKENIZED_META` entries of a parquet's schema metadata ``raw``, JSON-decoded, by short name.

    Args:
        path: the file (named in errors).
        required: every key must be there; else absent keys are left out of the result.
    Raises:
        ValueError: a key missing while ``required`` (not a draftsmith tokenized file?), or a value that is not
            JSON (the file and the key named).
    """
    raw = raw or {}
    out = {}
    for key, name in TOKENIZED_META.items():
        if key not in raw:
            if required:
                raise ValueError(f"{path}: parquet metadata lacks {key.decode()} (not a draftsmith tokenized file?)")
            continue
        try:
            out[name] = json.loads(raw[key])
        except ValueError:
            raise ValueError(f"{path}: parquet metadata {key.decode()} is not JSON: {raw[key][:80]!r}") from None
    return out


def read_tokenized_metadata(path: str | os.PathLike) -> dict:
    """``{"chat_template_kwargs": dict, "tokenizer_fingerprint": str, "max_length": int}`` of a tokenized parquet.

    Raises:
        ValueError: a key is missing (names the file): not written by this stage; or a value is not JSON.
        InputError: the file is not a readable parquet (truncated, damaged).
    """
    with reading(path, TOKENIZED_PARQUET):
        schema = pq.read_schema(path)
    return decode_metadata(path, schema.metadata, required=True)


@dataclass
class Tokenized:
    """The columns of a tokenized parquet that extraction and merge need, as flat numpy arrays.

    ``ids`` has one id per row (row index = position in the file); ``num_tokens`` is int64 [rows];
    ``input_ids[offsets[r]:offsets[r + 1]]`` (int32) and the same slice of ``loss_mask`` (int8) are
    row r (``None`` when read without tokens). ``metadata`` holds the schema metadata that is there, as
    :func:`decode_metadata` gives it (short names, JSON values).
    """

    path: str
    ids: list[str]
    num_tokens: np.ndarray
    offsets: np.ndarray | None = None
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids [n] int32, loss_mask [n] int8)`` of row ``r``."""
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def describe(self, row: int) -> str:
        """``row 7 (id 'abc')``, or ``row 7 (not a tokenized train row)`` when out of range."""
        if 0 <= row < len(self.ids):
            return f"row {row} (id {self.ids[row]!r})"
        return f"row {row} (not a tokenized train row: the set has {len(self.ids)})"

    def describe_rows(self, rows: Iterable[int], limit: int = 3) -> str:
        """A few rows named with their ids, and how many there are in all."""
        rows = list(rows)
        if not rows:
            return "no samples"
        head = ", ".join(self.describe(int(r)) for r in rows[:limit])
        return f"{len(rows)} sample(s): {head}" + (", ..." if len(rows) > limit else "")


def _flat_list(table, name: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    col = table.column(name).combine_chunks()
    if col.null_count:
        bad = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
        raise ValueError(f"{path}: row {bad}: field {name!r} is null")
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.flatten().to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


def read_tokenized(path: str | os.PathLike, *, with_tokens: bool = True) -> Tokenized:
    """Read a tokenized parquet (``id``, ``num_tokens`` and, with tokens, ``input_ids``/``loss_mask``) and its
    schema metadata (:func:`decode_metadata`; keys that are not there are left out).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a missing column, a null field, duplicate ids, a row with no tokens, ``num_tokens``
            disagreeing with the list lengths -- naming the file, row, id and field -- or a metadata value
            that is not JSON.
        InputError: the file is not a readable parquet (truncated, damaged), naming it.
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenized parquet {path} does not exist")
    columns = ["id", "num_tokens"] + (["input_ids", "loss_mask"] if with_tokens else [])
    with reading(path, TOKENIZED_PARQUET):
        schema = pq.read_schema(path)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing} (have {schema.names})")
        table = pq.ParquetFile(path, memory_map=True).read(columns=columns)  # (read_table would import pandas)
    ids = table.column("id").to_pylist()
    num_tokens = table.column("num_tokens").to_numpy(zero_copy_only=False)
    for r, (i, n) in enumerate(zip(ids, num_tokens)):
        if i is None:
            raise ValueError(f"{path}: row {r}: field 'id' is null")
        if not n or n < 1:
            raise ValueError(f"{path}: row {r} (id {i}): field 'num_tokens' is {n}; "
                             "a sample needs at least one token")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next((r, i) for r, i in enumerate(ids) if i in seen or seen.add(i))
        raise ValueError(f"{path}: row {dup[0]}: duplicate id {dup[1]!r}")
    tok = Tokenized(path=path, ids=ids, num_tokens=num_tokens.astype(np.int64),
                    metadata=decode_metadata(path, schema.metadata, required=False))
    if with_tokens:
        off, values = _flat_list(table, "input_ids", path)
        loff, lvalues = _flat_list(table, "loss_mask", path)
        lengths, llengths = np.diff(off), np.diff(loff)
        for name, got in (("input_ids", lengths), ("loss_mask", llengths)):
            bad = np.nonzero(got != tok.num_tokens)[0]
            if bad.size:
                r = int(bad[0])
                raise ValueError(f"{path}: row {r} (id {ids[r]}): num_tokens is {tok.num_tokens[r]} "
                                 f"but field {name!r} has {got[r]} values")
        tok.offsets = off
        tok.input_ids = values.astype(np.int32, copy=False)
        tok.loss_mask = lvalues.astype(np.int8, copy=False)
    return tok
