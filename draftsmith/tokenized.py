"""The tokenized parquet: the contract between tokenize and the stages that read its rows.

``results/tokenized/{train,eval}.parquet``: ``id`` string, ``source`` string, ``input_ids`` list<int32>,
``loss_mask`` list<int8>, ``num_tokens`` int32 (:data:`TOKENIZED_SCHEMA`), with schema metadata
``draftsmith.chat_template_kwargs``, ``draftsmith.tokenizer_fingerprint``, ``draftsmith.max_length`` (JSON values):
tokenize writes it (:func:`tokenized_metadata`), extract reads the rows (:func:`read_tokenized`), evaluate
renders its prompts with the recorded template kwargs (:func:`read_tokenized_metadata`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

META_CHAT_TEMPLATE_KWARGS = b"draftsmith.chat_template_kwargs"
META_TOKENIZER_FINGERPRINT = b"draftsmith.tokenizer_fingerprint"
META_MAX_LENGTH = b"draftsmith.max_length"
#: the metadata keys as strings (read_tokenized decodes each, None when absent)
TOKENIZED_META = tuple(key.decode() for key in (META_CHAT_TEMPLATE_KWARGS, META_TOKENIZER_FINGERPRINT, META_MAX_LENGTH))

TOKENIZED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
])


def tokenized_metadata(chat_template_kwargs: dict, fingerprint: str, max_length: int) -> dict[bytes, bytes]:
    """Parquet schema metadata of a tokenized file (bytes keys, JSON values)."""
    return {
        META_CHAT_TEMPLATE_KWARGS: json.dumps(chat_template_kwargs, sort_keys=True).encode(),
        META_TOKENIZER_FINGERPRINT: json.dumps(fingerprint).encode(),
        META_MAX_LENGTH: json.dumps(int(max_length)).encode(),
    }


def read_tokenized_metadata(path: str | os.PathLike) -> dict:
    """``{"chat_template_kwargs": dict, "tokenizer_fingerprint": str, "max_length": int}`` of a tokenized parquet.

    Raises:
        ValueError: a key is missing (names the file): not written by this stage.
    """
    meta = pq.read_schema(path).metadata or {}
    out = {}
    for key in (META_CHAT_TEMPLATE_KWARGS, META_TOKENIZER_FINGERPRINT, META_MAX_LENGTH):
        if key not in meta:
            raise ValueError(f"{path}: parquet metadata lacks {key.decode()} (not a draftsmith tokenized file?)")
        out[key.decode().split(".", 1)[1]] = json.loads(meta[key])
    return out


@dataclass
class Tokenized:
    """The columns of a tokenized parquet that extraction needs, as flat numpy arrays.

    ``input_ids[offsets[r]:offsets[r + 1]]`` (int32) and the same slice of ``loss_mask`` (int8) are
    row r; ``num_tokens`` is int64 [rows]. ``metadata`` holds the decoded ``draftsmith.*`` schema
    metadata (JSON values).
    """

    path: str
    ids: list[str]
    num_tokens: np.ndarray
    offsets: np.ndarray | None = None
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    metadata: dict = field(default_factory=dict)

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]


def _flat_list(table, name: str, path: str) -> tuple[np.ndarray, np.ndarray]:
    col = table.column(name).combine_chunks()
    if col.null_count:
        bad = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
        raise ValueError(f"{path}: row {bad}: field {name!r} is null")
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.flatten().to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


def read_tokenized(path: str | os.PathLike, *, with_tokens: bool = True) -> Tokenized:
    """Read a tokenized parquet (``id``, ``num_tokens`` and, with tokens, ``input_ids``/``loss_mask``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a missing column, a null field, duplicate ids, a row with no tokens, or
            ``num_tokens`` disagreeing with the list lengths -- naming the file, row, id and field.
    """
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenized parquet {path} does not exist")
    columns = ["id", "num_tokens"] + (["input_ids", "loss_mask"] if with_tokens else [])
    schema = pq.read_schema(path)
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (have {schema.names})")
    table = pq.read_table(path, columns=columns, memory_map=True)
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
    meta = {}
    for key in TOKENIZED_META:
        raw = (schema.metadata or {}).get(key.encode())
        meta[key] = json.loads(raw) if raw is not None else None
    tok = Tokenized(path=path, ids=ids, num_tokens=num_tokens.astype(np.int64), metadata=meta)
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
