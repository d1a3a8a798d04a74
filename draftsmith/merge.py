"""merge: one verified index over all extraction shards.

Extraction runs as many independent shard jobs (often on several machines). Before training may start,
this stage proves that the shards form exactly the tokenized train set, and writes
``results/features/index.json`` (:data:`draftsmith.features.INDEX_FORMAT`), the only file training reads to
find its features. The features format (chunk tensors, header reader, index writer) is
:mod:`draftsmith.features`'s; the tokenized train set is read with :func:`draftsmith.tokenized.read_tokenized`.

What is checked (every failure names the shard, the chunk and the sample: tokenized row index and id):

* **coverage** -- every tokenized train row (``plan.json``'s rows and the tokenized parquet's row
  count) is stored exactly once, in the shard the plan assigned it to, under the tokenized id it
  has now (a stale extraction of an older tokenized set is caught); for a plan with a ``subset`` (stream mode:
  one phase's slice, or the held-out samples), exactly the plan's rows, each once, and no other row;
* **chunk files** -- each one exists, has the manifest's size, a parseable safetensors header whose
  tensors have the contract's names, dtypes and shapes for the manifest's sample/token counts, and
  whose data region ends exactly at the end of the file (a truncated file is caught even when its
  manifest was written after the truncation); with ``verify_sha256`` every byte is hashed and compared
  with the manifest, and the stored ``sample_index`` / ``offsets`` are checked against the manifest
  and the tokenized lengths;
* **token counts** -- per chunk, the manifest's token count equals the sum of the tokenized
  ``num_tokens`` of its rows; totals equal the tokenized train set's;
* **metadata** -- layer ids, layer semantics, hidden size, number of target layers, storage dtype,
  target tokens present or not, the k of the target's top-k (``target_top_k``, absent = 0), target and tokenizer
  fingerprints and chat template kwargs are equal across shards, agree with ``plan.json``, and (fingerprint,
  template kwargs) with the tokenized parquet's metadata (a thinking-on/off template mismatch between stages,
  z-lab dflash #133, is caught);
* **numeric sanity** -- the per-layer statistics the shards gathered (RMS, non-finite values,
  all-zero rows) are merged into one table; any non-finite value or all-zero row fails (the silent
  all-zero hidden states of vLLM #46301).

It is fast: it reads manifests and the safetensors headers (the first ``8 + N`` bytes of each chunk:
little-endian u64 ``N`` then ``N`` bytes of JSON, the safetensors format), never the tensors, unless
hashing is asked for. Chunk files are checked on a thread pool (it helps on network file systems).
All problems are collected and raised together in one :class:`MergeError`; ``index.json`` is written
atomically and only when there are none.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np

from draftsmith.features import (
    FEATURES_FORMAT,
    STORAGE_DTYPES,
    HeaderError,
    expected_tensors,
    index_document,
    read_chunk_samples,
    read_safetensors_header,
    write_index,
)
from draftsmith.io import read_json, sha256_file
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.shard_plan import PLAN_FORMAT, subset_label
from draftsmith.tokenized import Tokenized, read_tokenized

log = logging.getLogger("draftsmith.merge")


#: Metadata every shard must share (copied into index.json).
SHARED_FIELDS = (
    "layer_ids",
    "layer_semantics",
    "hidden_size",
    "num_target_layers",
    "storage_dtype",
    "has_target_token",
    "target_fingerprint",
    "tokenizer_fingerprint",
    "chat_template_kwargs",
)
#: Shared metadata added later, with the value every manifest before had: absent reads as that value, shards must
#: agree on it like on :data:`SHARED_FIELDS`, and index.json records it only at another value (an index of features
#: without the target's top-k is the same as before the key existed).
LATER_SHARED_FIELDS: dict[str, Any] = {"target_top_k": 0}
MANIFEST_FIELDS = ("format", "shard", "num_shards", *SHARED_FIELDS, "num_samples", "num_tokens", "bytes",
                   "chunks")
CHUNK_FIELDS = ("file", "sha256", "bytes", "num_samples", "num_tokens", "rows", "ids", "stats")

#: Problems listed in the error message at most (the count is always given).
MAX_LISTED = 50


class MergeError(ValueError):
    """The shards do not form a complete, consistent feature set.

    ``problems`` holds one line per problem, each naming shard, chunk and sample (row index and id), and the plan's
    subset (``phase 3``, ``held-out``) when it has one (``scope``).
    """

    def __init__(self, problems: Sequence[str], scope: str = ""):
        self.problems = [f"{scope}: {p}" for p in problems] if scope else list(problems)
        shown = self.problems[:MAX_LISTED]
        more = len(self.problems) - len(shown)
        of = f" ({scope})" if scope else ""
        text = f"merge found {len(self.problems)} problem(s) in the extracted features{of}:\n" + "\n".join(
            f"  - {p}" for p in shown)
        if more:
            text += f"\n  ... and {more} more"
        super().__init__(text)


# ----------------------------------------------------------------------------------------------
# per-chunk checks


@dataclass
class Chunk:
    """One chunk entry of a shard manifest, with where it lives."""

    shard: int
    file: str
    path: Path
    entry: dict[str, Any]
    meta: dict[str, Any]  # the shard manifest's shared metadata (_shared_meta)

    @property
    def where(self) -> str:
        return f"shard {self.shard} chunk {self.file}"


def check_chunk_file(chunk: Chunk, tok: Tokenized, *, verify_sha256: bool = False) -> list[str]:
    """Check one chunk file against its manifest entry; return the problems (empty when sound).

    Always: the file exists, has the manifest's size, its header parses, the tensors have the
    contract's dtypes and shapes, and the data region ends exactly at the end of the file. With
    ``verify_sha256``: the file's sha256 equals the manifest's, and the stored ``sample_index``
    equals the manifest's rows and ``offsets`` give each sample its tokenized length.
    """
    entry = chunk.entry
    rows = entry["rows"]

    def where() -> str:  # built only for a problem: most chunks are sound
        return f"{chunk.where} ({tok.describe_rows(rows)})"

    try:
        size = chunk.path.stat().st_size
    except FileNotFoundError:
        return [f"{where()}: file {chunk.path} is missing"]
    if size != int(entry["bytes"]):
        return [f"{where()}: file {chunk.path} is {size} bytes, the manifest says {entry['bytes']} "
                f"(truncated or rewritten after the manifest)"]
    try:
        header = read_safetensors_header(chunk.path)
    except HeaderError as exc:
        return [f"{where()}: unreadable safetensors header: {exc}"]
    end = 8 + header.header_bytes + header.data_bytes
    if end != size:
        return [f"{where()}: header says the data ends at byte {end} but the file has {size} bytes "
                f"({'truncated' if end > size else 'trailing bytes'})"]
    problems = []
    for name, (dtypes, shape) in expected_tensors(chunk.meta, len(rows), int(entry["num_tokens"])).items():
        info = header.tensors.get(name)
        if info is None:
            problems.append(f"{where()}: no tensor {name!r} (has {', '.join(sorted(header.tensors))})")
        elif info["dtype"] not in dtypes or list(info["shape"]) != shape:
            problems.append(f"{where()}: tensor {name!r} is {info['dtype']} {list(info['shape'])}, the manifest "
                            f"implies {'/'.join(dtypes)} {shape}")
    if problems or not verify_sha256:
        return problems

    digest = sha256_file(chunk.path)
    if digest != entry["sha256"]:
        return [f"{where()}: sha256 {digest} differs from the manifest's {entry['sha256']}"]
    sample_index, offsets = read_chunk_samples(chunk.path, header)
    for k, (stored, row) in enumerate(zip(sample_index.tolist(), rows)):
        if stored != row:
            problems.append(f"{chunk.where}: sample {k} is stored as {tok.describe(stored)} but the manifest "
                            f"lists {tok.describe(row)}")
            break
    lengths = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != int(entry["num_tokens"]):
        problems.append(f"{where()}: offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to "
                        f"{entry['num_tokens']}")
    for k, row in enumerate(rows):
        if 0 <= row < tok.num_rows and lengths[k] != tok.num_tokens[row]:
            problems.append(f"{chunk.where}: {tok.describe(row)} has {lengths[k]} tokens stored, "
                            f"{tok.num_tokens[row]} in the tokenized train set")
            break
    return problems


def _locate_token_mismatch(chunk: Chunk, tok: Tokenized) -> str:
    """On a chunk whose token count disagrees with the tokenized set, name the first bad sample.

    Reads the (small) ``offsets`` tensor; falls back to naming the chunk's samples when it cannot.
    """
    rows = [int(r) for r in chunk.entry["rows"]]
    try:
        header = read_safetensors_header(chunk.path)
        lengths = np.diff(read_chunk_samples(chunk.path, header)[1])
    except (OSError, KeyError, HeaderError):
        return tok.describe_rows(rows)
    for k, row in enumerate(rows[:len(lengths)]):
        if 0 <= row < tok.num_rows and lengths[k] != tok.num_tokens[row]:
            return f"{tok.describe(row)} has {lengths[k]} tokens stored, {tok.num_tokens[row]} tokenized"
    return tok.describe_rows(rows)


# ----------------------------------------------------------------------------------------------
# statistics


def merge_layer_stats(chunks: Sequence[Chunk], layer_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Combine the shards' per-chunk statistics into one row per tapped layer.

    RMS is combined token-weighted, ``sqrt(sum_c t_c * rms_c^2 / sum_c t_c)`` (each chunk's RMS is over
    its ``t_c`` tokens x ``H`` values of that layer), which equals the RMS over all stored tokens.
    ``nonfinite`` / ``zero_rows`` are summed; the manifests may give them per layer (a list) or for
    all layers together (an int: then the per-layer entries are ``None`` and the totals are in the
    index's ``stats``).

    Returns:
        ``[{"layer_id", "rms", "rms_min", "rms_max", "nonfinite", "zero_rows"}]`` (rms_min / rms_max:
        the smallest / largest chunk RMS), one per layer id, in order.
    """
    n = len(layer_ids)
    sum_sq = np.zeros(n)
    tokens = 0
    rms_min = np.full(n, np.inf)
    rms_max = np.full(n, -np.inf)
    per_layer = {"nonfinite": np.zeros(n, dtype=np.int64), "zero_rows": np.zeros(n, dtype=np.int64)}
    has_per_layer = {"nonfinite": True, "zero_rows": True}
    for chunk in chunks:
        stats, t = chunk.entry["stats"], int(chunk.entry["num_tokens"])
        rms = np.asarray(stats["rms"], dtype=np.float64)
        if t > 0:
            sum_sq += t * rms**2
            tokens += t
            rms_min = np.minimum(rms_min, rms)
            rms_max = np.maximum(rms_max, rms)
        for key in per_layer:
            if isinstance(stats.get(key), list):
                per_layer[key] += np.asarray(stats[key], dtype=np.int64)
            else:
                has_per_layer[key] = False
    rms_all = np.sqrt(sum_sq / tokens) if tokens else np.full(n, np.nan)
    return [{"layer_id": int(layer_ids[i]), "rms": float(rms_all[i]),
             "rms_min": float(rms_min[i]) if tokens else None,
             "rms_max": float(rms_max[i]) if tokens else None,
             "nonfinite": int(per_layer["nonfinite"][i]) if has_per_layer["nonfinite"] else None,
             "zero_rows": int(per_layer["zero_rows"][i]) if has_per_layer["zero_rows"] else None}
            for i in range(n)]


def _count(value: Any) -> int:
    """A stats count that is an int (all layers) or a per-layer list."""
    return int(sum(value)) if isinstance(value, list) else int(value)


def format_layer_stats(index: dict[str, Any]) -> str:
    """The per-layer statistics of an index as a fixed-width text table (for the log)."""
    lines = [f"{'layer id':>8}  {'RMS':>10}  {'chunk RMS min':>13}  {'chunk RMS max':>13}  "
             f"{'non-finite':>10}  {'zero rows':>9}"]

    def num(x, fmt):
        return format("-", f">{fmt.rstrip('dg').split('.')[0]}") if x is None else format(x, fmt)

    for row in index["layer_stats"]:
        lines.append(f"{row['layer_id']:>8}  {num(row['rms'], '10.4g')}  {num(row['rms_min'], '13.4g')}  "
                     f"{num(row['rms_max'], '13.4g')}  {num(row['nonfinite'], '10d')}  "
                     f"{num(row['zero_rows'], '9d')}")
    stats = index["stats"]
    lines.append(f"{'all':>8}  {'':>10}  {'':>13}  {'':>13}  {stats['nonfinite']:>10d}  "
                 f"{stats['zero_rows']:>9d}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the merge


def _missing_fields(obj: Any, fields: Sequence[str]) -> list[str]:
    if not isinstance(obj, dict):
        return list(fields)
    return [f for f in fields if f not in obj]


def _check_plan(plan: dict[str, Any], plan_path: str, tok: Tokenized) -> tuple[list[str], dict[int, list[int]]]:
    """Plan against the tokenized set; returns (problems, shard -> planned rows). A plan without subset partitions
    the tokenized rows; one with a subset lists each of its rows once and states their totals."""
    missing = _missing_fields(plan, ("format", "num_shards", "layer_ids", "hidden_size", "num_target_layers",
                                     "tokenized_rows", "tokenized_tokens", "shards"))
    if missing:
        raise MergeError([f"{plan_path}: no field(s) {', '.join(missing)} (not a {PLAN_FORMAT} plan)"])
    if plan["format"] != PLAN_FORMAT:
        raise MergeError([f"{plan_path}: format {plan['format']!r}, expected {PLAN_FORMAT!r}"])
    try:
        subset_label(plan.get("subset"))
    except ValueError as exc:
        raise MergeError([f"{plan_path}: {exc}"]) from None
    problems = []
    total_tokens = int(tok.num_tokens.sum())
    if plan["tokenized_rows"] != tok.num_rows or plan["tokenized_tokens"] != total_tokens:
        problems.append(f"{plan_path} was made for {plan['tokenized_rows']} tokenized rows / "
                        f"{plan['tokenized_tokens']} tokens but {tok.path} has {tok.num_rows} rows / "
                        f"{total_tokens} tokens (the tokenized set changed after planning: rerun extraction)")
    planned: dict[int, list[int]] = {}
    for k, spec in enumerate(plan["shards"]):
        if not isinstance(spec, dict) or "shard" not in spec or "rows" not in spec:
            problems.append(f"{plan_path}: shards[{k}] has no 'shard' or 'rows'")
            continue
        if spec["shard"] in planned or not 0 <= spec["shard"] < plan["num_shards"]:
            problems.append(f"{plan_path}: shards[{k}] is shard {spec['shard']}, duplicated or outside "
                            f"0..{plan['num_shards'] - 1}")
            continue
        planned[int(spec["shard"])] = [int(r) for r in spec["rows"]]
    for s in range(plan["num_shards"]):
        if s not in planned:
            problems.append(f"{plan_path}: shard {s} is not in the plan's shard list")
    counts = np.zeros(tok.num_rows, dtype=np.int64)
    for s, rows in planned.items():
        arr = np.asarray(rows, dtype=np.int64)
        bad = arr[(arr < 0) | (arr >= tok.num_rows)]
        if bad.size:
            problems.append(f"{plan_path}: shard {s} plans {tok.describe(int(bad[0]))}")
        np.add.at(counts, arr[(arr >= 0) & (arr < tok.num_rows)], 1)
    if plan.get("subset") is None:
        if (counts != 1).any() and not problems:
            rows = np.flatnonzero(counts != 1)
            problems.append(f"{plan_path}: the shards do not partition the tokenized rows: "
                            f"{tok.describe_rows(rows.tolist())} planned {counts[rows[0]]} time(s)")
        return problems, planned
    if (counts > 1).any() and not problems:
        rows = np.flatnonzero(counts > 1)
        problems.append(f"{plan_path}: {tok.describe_rows(rows.tolist())} planned {counts[rows[0]]} times")
    totals = {"num_samples": int((counts > 0).sum()), "num_tokens": int(tok.num_tokens[counts > 0].sum())}
    for key, value in totals.items():
        if plan.get(key) != value:
            problems.append(f"{plan_path}: {key} {plan.get(key)!r} but its shards hold {value}")
    return problems, planned


def _subset_name(subset: Any) -> str:
    try:
        return subset_label(subset) or "the whole train set"
    except ValueError:
        return f"subset {subset!r}"


def _read_manifests(manifest_paths: Sequence[str | os.PathLike], num_shards: int, subset: Any, problems: list[str]
                    ) -> dict[int, tuple[Path, dict[str, Any]]]:
    """The shard manifests that are there and well formed, by shard; every other one becomes a problem (one made for
    another plan's ``subset`` too)."""
    manifests: dict[int, tuple[Path, dict[str, Any]]] = {}
    for mpath in map(Path, manifest_paths):
        if not mpath.exists():
            continue  # reported below as a missing shard
        try:
            manifest = read_json(mpath)
        except ValueError as exc:
            problems.append(f"{exc}")
            continue
        missing = _missing_fields(manifest, MANIFEST_FIELDS)
        if missing:
            problems.append(f"{mpath}: no field(s) {', '.join(missing)} (not a {FEATURES_FORMAT} manifest)")
            continue
        s = manifest["shard"]
        if manifest["format"] != FEATURES_FORMAT:
            problems.append(f"{mpath}: format {manifest['format']!r}, expected {FEATURES_FORMAT!r}")
        elif not isinstance(s, int) or not 0 <= s < num_shards:
            problems.append(f"{mpath}: shard {s!r} is outside the plan's 0..{num_shards - 1}")
        elif s in manifests:
            problems.append(f"shard {s}: two manifests, {manifests[s][0]} and {mpath}")
        elif manifest["num_shards"] != num_shards:
            problems.append(f"shard {s} ({mpath}): extracted as one of {manifest['num_shards']} shards, the plan "
                            f"has {num_shards} (stale shard from another plan)")
        elif manifest.get("subset") != subset:
            problems.append(f"shard {s} ({mpath}): extracted for {_subset_name(manifest.get('subset'))}, the plan is "
                            f"{_subset_name(subset)}'s (stale shard from another plan)")
        else:
            manifests[s] = (mpath, manifest)
    return manifests


def _shared_meta(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's shared metadata: :data:`SHARED_FIELDS`, then :data:`LATER_SHARED_FIELDS` (their earlier value
    when absent)."""
    return {**{k: manifest[k] for k in SHARED_FIELDS},
            **{k: manifest.get(k, before) for k, before in LATER_SHARED_FIELDS.items()}}


def _check_shared_metadata(manifests: dict, plan: dict, plan_path: str, tok: Tokenized,
                           problems: list[str]) -> dict[str, Any]:
    """The metadata every shard must share (:func:`_shared_meta`), checked across shards, against the plan and
    against the tokenized set's (tokenizer, chat template); empty without manifests."""
    meta: dict[str, Any] = {}
    if manifests:
        ref_shard = min(manifests)
        meta = _shared_meta(manifests[ref_shard][1])
        for s, (mpath, manifest) in sorted(manifests.items()):
            chunks = manifest["chunks"]
            context = (f"chunk {chunks[0].get('file')} ({tok.describe_rows(chunks[0].get('rows', []))})"
                       if chunks else "no chunks")
            for key, value in _shared_meta(manifest).items():
                if value != meta[key]:
                    problems.append(f"shard {s}: {key} {value!r} differs from shard {ref_shard}'s "
                                    f"{meta[key]!r} (shard {s} {context})")
        for key in ("layer_ids", "hidden_size", "num_target_layers"):
            if meta[key] != plan[key]:
                problems.append(f"shard {ref_shard}: {key} {meta[key]!r} differs from {plan_path}'s {plan[key]!r}")
        for key in ("tokenizer_fingerprint", "chat_template_kwargs"):
            if key in tok.metadata and meta[key] != tok.metadata[key]:
                problems.append(f"shard {ref_shard}: {key} {meta[key]!r} differs from {tok.path}'s "
                                f"{tok.metadata[key]!r} (features made with another tokenizer or template)")
        for s, (mpath, manifest) in sorted(manifests.items()):
            if manifest["storage_dtype"] not in STORAGE_DTYPES:
                problems.append(f"shard {s}: storage_dtype {manifest['storage_dtype']!r} is not one of "
                                f"{', '.join(STORAGE_DTYPES)}")
            if not _valid_top_k(manifest):
                problems.append(f"shard {s}: target_top_k {manifest['target_top_k']!r} is not a positive integer "
                                f"stored with target tokens (has_target_token {manifest['has_target_token']!r})")
    return meta


def _valid_top_k(meta: dict[str, Any]) -> bool:
    """Whether a manifest's ``target_top_k`` is absent, or a positive integer beside target tokens."""
    k = meta.get("target_top_k", 0)
    return k == 0 or (isinstance(k, int) and not isinstance(k, bool) and k > 0 and meta["has_target_token"] is True)


def _check_chunks(manifests: dict, owner: np.ndarray, tok: Tokenized, problems: list[str]
                  ) -> tuple[list[Chunk], np.ndarray]:
    """Each manifest's chunks: fields, file names, arithmetic, ids and planned shard of every row. Returns the
    well-formed chunks and how many times each tokenized row is stored."""
    chunks: list[Chunk] = []
    counts = np.zeros(tok.num_rows, dtype=np.int64)
    for s, (mpath, manifest) in sorted(manifests.items()):
        sums = {"num_samples": 0, "num_tokens": 0, "bytes": 0}
        for j, entry in enumerate(manifest["chunks"]):
            missing = _missing_fields(entry, CHUNK_FIELDS)
            if missing:
                problems.append(f"shard {s} chunks[{j}] ({mpath}): no field(s) {', '.join(missing)}")
                continue
            name = str(entry["file"])
            if os.path.basename(name) != name or name in ("", ".", ".."):
                problems.append(f"shard {s} chunks[{j}]: file {name!r} must be a plain file name")
                continue
            chunk = Chunk(shard=s, file=name, path=mpath.parent / name, entry=entry, meta=_shared_meta(manifest))
            rows = np.asarray(entry["rows"], dtype=np.int64)
            for key in sums:
                sums[key] += int(entry[key])
            if not (len(rows) == len(entry["ids"]) == entry["num_samples"]):
                problems.append(f"{chunk.where}: {len(rows)} rows, {len(entry['ids'])} ids, num_samples "
                                f"{entry['num_samples']} (must be equal)")
                continue
            bad = rows[(rows < 0) | (rows >= tok.num_rows)]
            if bad.size:
                problems.append(f"{chunk.where}: sample {tok.describe(int(bad[0]))}")
                continue
            chunks.append(chunk)
            np.add.at(counts, rows, 1)
            for k, row in enumerate(rows.tolist()):
                if entry["ids"][k] != tok.ids[row]:
                    problems.append(f"{chunk.where}: sample row {row} has id {entry['ids'][k]!r} in the manifest "
                                    f"but {tok.ids[row]!r} in {tok.path} (extracted from another tokenized set)")
                    break
            foreign = rows[(owner[rows] != s)]
            if foreign.size:
                r = int(foreign[0])
                problems.append(f"{chunk.where}: sample {tok.describe(r)} is not one of the plan's samples"
                                if owner[r] < 0 else
                                f"{chunk.where}: sample {tok.describe(r)} is planned for shard {owner[r]}, "
                                f"not shard {s}")
            expected_tokens = int(tok.num_tokens[rows].sum())
            if expected_tokens != int(entry["num_tokens"]):
                problems.append(f"{chunk.where}: {entry['num_tokens']} tokens in the manifest, the tokenized "
                                f"lengths of its rows sum to {expected_tokens}: "
                                f"{_locate_token_mismatch(chunk, tok)}")
        for key, total in sums.items():
            if int(manifest[key]) != total:
                problems.append(f"shard {s} ({mpath}): {key} {manifest[key]} but its chunks sum to {total}")
    return chunks, counts


def _check_coverage(counts: np.ndarray, chunks: list[Chunk], owner: np.ndarray, missing_shards: list[int],
                    tok: Tokenized, problems: list[str], subset: bool = False) -> None:
    """Every planned row stored exactly once (rows of missing shards are reported with the shard): every tokenized
    train row, or with a ``subset`` plan its rows (rows outside it are reported per chunk)."""
    duplicated = np.flatnonzero(counts > 1)
    if duplicated.size:
        dup = set(duplicated[:MAX_LISTED].tolist())
        places: dict[int, list[str]] = {r: [] for r in dup}
        for chunk in chunks:
            for row in chunk.entry["rows"]:
                if row in dup:
                    places[row].append(chunk.where)
        for row in sorted(dup):
            problems.append(f"sample {tok.describe(row)} is stored {counts[row]} times: {'; '.join(places[row])}")
        if duplicated.size > len(dup):
            problems.append(f"... {duplicated.size} duplicated samples in all")
    absent = np.flatnonzero((counts == 0) & (owner >= 0)) if subset else np.flatnonzero(counts == 0)
    absent = absent[~np.isin(owner[absent], missing_shards)]  # missing shards are reported above
    for row in absent[:MAX_LISTED].tolist():
        problems.append(f"sample {tok.describe(row)}, planned for shard {owner[row]}, is in no chunk of "
                        f"shard {owner[row]}'s manifest")
    if absent.size > MAX_LISTED:
        problems.append(f"... {absent.size} tokenized train samples are in no chunk")


def _check_stats(chunks: list[Chunk], tok: Tokenized, problems: list[str]) -> list[Chunk]:
    """Numeric sanity from the shards' own statistics; returns the chunks whose statistics are complete."""
    stat_chunks = []
    for chunk in chunks:
        stats, n_layers = chunk.entry["stats"], len(chunk.meta["layer_ids"])
        if (not isinstance(stats, dict) or len(stats.get("rms", [])) != n_layers
                or "nonfinite" not in stats or "zero_rows" not in stats):
            problems.append(f"{chunk.where}: stats {stats!r} lack rms for {n_layers} layers, nonfinite, zero_rows")
            continue
        stat_chunks.append(chunk)
        nonfinite, zero_rows = _count(stats["nonfinite"]), _count(stats["zero_rows"])
        rms = np.asarray(stats["rms"], dtype=np.float64)
        if nonfinite or zero_rows or not np.isfinite(rms).all():
            problems.append(f"{chunk.where} ({tok.describe_rows(chunk.entry['rows'])}): {nonfinite} non-finite "
                            f"values, {zero_rows} all-zero rows, RMS {stats['rms']} (broken target features)")
    return stat_chunks


def _check_chunk_files(chunks: list[Chunk], tok: Tokenized, verify_sha256: bool, threads: int,
                       problems: list[str]) -> None:
    """The chunk files themselves (headers; with ``verify_sha256`` every byte), ``threads`` at a time."""
    checkable = [c for c in chunks if c.meta["storage_dtype"] in STORAGE_DTYPES and _valid_top_k(c.meta)]

    def check_batch(batch: list[Chunk]) -> list[str]:
        return [p for c in batch for p in check_chunk_file(c, tok, verify_sha256=verify_sha256)]

    batches = [checkable[i:i + 64] for i in range(0, len(checkable), 64)]
    if threads <= 1:
        problems.extend(p for batch in batches for p in check_batch(batch))
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for found in pool.map(check_batch, batches):
                problems.extend(found)


def _build_index(manifests: dict, chunks: list[Chunk], stat_chunks: list[Chunk], meta: dict[str, Any],
                 num_shards: int, verify_sha256: bool, base: Path, subset: Any = None) -> dict[str, Any]:
    """The index document (:func:`draftsmith.features.index_document`): chunk paths relative to ``base``, totals,
    shared metadata (:data:`LATER_SHARED_FIELDS` only at another value than their earlier one), stats (and the plan's
    ``subset`` when it has one)."""
    folders = {s: os.path.relpath(mpath.parent, base) for s, (mpath, _) in manifests.items()}
    index_chunks = [{"path": os.path.join(folders[c.shard], c.file), "shard": c.shard,
                     "sha256": c.entry["sha256"], "num_samples": int(c.entry["num_samples"]),
                     "num_tokens": int(c.entry["num_tokens"]), "bytes": int(c.entry["bytes"]),
                     "rows": [int(r) for r in c.entry["rows"]]}
                    for c in chunks]
    return index_document({
        "num_shards": num_shards,
        **({"subset": subset} if subset is not None else {}),
        "num_samples": sum(c["num_samples"] for c in index_chunks),
        "num_tokens": sum(c["num_tokens"] for c in index_chunks),
        "bytes": sum(c["bytes"] for c in index_chunks),
        **{k: v for k, v in meta.items() if k not in LATER_SHARED_FIELDS or v != LATER_SHARED_FIELDS[k]},
        "sha256_verified": bool(verify_sha256),
        "layer_stats": merge_layer_stats(stat_chunks, meta["layer_ids"]),
        "stats": {"nonfinite": sum(_count(c.entry["stats"]["nonfinite"]) for c in stat_chunks),
                  "zero_rows": sum(_count(c.entry["stats"]["zero_rows"]) for c in stat_chunks)},
        "chunks": index_chunks,
    })


@dataclass(frozen=True)
class MergeOptions(SectionSettings):
    """The ``merge`` keys the merge stage reads.

    Attributes:
        verify_sha256: hash every chunk file and compare with the manifest (reads every byte), and check the
            stored ``sample_index`` / ``offsets`` against the manifest and tokenized lengths.
    """

    SECTION: ClassVar[str] = "merge"
    verify_sha256: bool


@dataclass(frozen=True)
class MergeSettings(StageSettings):
    """Everything rule merge reads from the config."""

    STAGE: ClassVar[str] = "merge"
    merge: MergeOptions


@dataclass(frozen=True)
class MergeSliceSettings(MergeSettings):
    """Everything rule merge_slice (a stream-mode slice's shards) reads: rule merge's keys."""

    STAGE: ClassVar[str] = "merge_slice"


def merge_features(plan_path: str | os.PathLike, manifest_paths: Sequence[str | os.PathLike],
                   tokenized_path: str | os.PathLike, index_path: str | os.PathLike | None = None, *,
                   settings: MergeSettings, threads: int = 1, logger: logging.Logger | None = None) -> dict[str, Any]:
    """Verify the extraction shards against the plan and the tokenized train set; write ``index.json``.

    A plan with a ``subset`` (stream mode: a phase's slice, the held-out samples; see
    :func:`draftsmith.shard_plan.shard_plan`) is merged the same way, its coverage being exactly the plan's rows
    (each once) and its totals the plan's; every problem then names the subset (``phase 3: shard 1 chunk ...``), and
    the index records it.

    Args:
        plan_path: ``results/features/plan.json`` (:data:`draftsmith.shard_plan.PLAN_FORMAT`).
        manifest_paths: every ``shard-{i}/manifest.json`` (:data:`draftsmith.features.FEATURES_FORMAT`); chunk
            files are found beside their manifest.
        tokenized_path: ``results/tokenized/train.parquet``; only ``id``, ``num_tokens`` and the schema
            metadata are read.
        index_path: where to write the index (atomically, :func:`draftsmith.features.write_index`), anywhere;
            ``None`` only returns it. Chunk paths in the index are relative to this file's folder
            (``results/features``); with ``None``, relative to the plan's folder.
        settings: the stage's keys (``merge.verify_sha256``, see :class:`MergeOptions`).
        threads: chunk files checked in parallel.
        logger: where the summary and the per-layer table go (default ``draftsmith.merge``).

    Returns:
        The index (:data:`draftsmith.features.INDEX_FORMAT`): ``chunks`` (``path``, ``shard``, ``sha256``,
        ``num_samples``, ``num_tokens``, ``bytes``, ``rows``) in shard order, totals
        ``num_samples`` / ``num_tokens`` / ``bytes`` (equal to the tokenized train set's rows and
        tokens, or to the subset's), the shared metadata (:data:`SHARED_FIELDS`, and ``target_top_k`` when the
        shards store the target's top-k: :data:`LATER_SHARED_FIELDS`), ``num_shards`` (and ``subset``
        when the plan has one), ``layer_stats`` (see
        :func:`merge_layer_stats`) and ``stats`` (total non-finite values and zero rows).

    Raises:
        MergeError: any problem; the message lists each one with its shard, chunk and sample.
        FileNotFoundError / ValueError: the plan or the tokenized set cannot be read.
    """
    logger = logger or log
    plan_path = str(plan_path)
    verify_sha256 = settings.merge.verify_sha256
    tok = read_tokenized(tokenized_path, with_tokens=False)
    plan = read_json(plan_path)
    problems, planned = _check_plan(plan, plan_path, tok)
    subset, scope = plan.get("subset"), subset_label(plan.get("subset"))
    num_shards = int(plan["num_shards"])
    owner = np.full(tok.num_rows, -1, dtype=np.int64)  # planned shard of each row
    for s, rows in planned.items():
        rows_arr = np.asarray(rows, dtype=np.int64)
        owner[rows_arr[(rows_arr >= 0) & (rows_arr < tok.num_rows)]] = s

    manifests = _read_manifests(manifest_paths, num_shards, subset, problems)
    features_dir = Path(plan_path).parent
    missing_shards = [s for s in range(num_shards) if s not in manifests]
    for s in missing_shards:
        expected = next((Path(p) for p in manifest_paths if Path(p).parent.name == f"shard-{s}"),
                        features_dir / f"shard-{s}" / "manifest.json")
        problems.append(f"shard {s}: no manifest (expected {expected}); "
                        f"no chunk holds its planned {tok.describe_rows(planned.get(s, []))}")

    meta = _check_shared_metadata(manifests, plan, plan_path, tok, problems)
    chunks, counts = _check_chunks(manifests, owner, tok, problems)
    _check_coverage(counts, chunks, owner, missing_shards, tok, problems, subset is not None)
    stat_chunks = _check_stats(chunks, tok, problems)
    _check_chunk_files(chunks, tok, verify_sha256, threads, problems)
    if problems:
        raise MergeError(problems, scope)

    base = Path(index_path).parent if index_path is not None else features_dir
    index = _build_index(manifests, chunks, stat_chunks, meta, num_shards, verify_sha256, base, subset)
    # Follows from the checks above; kept as the stage's contract, stated once more.
    if subset is None:
        want, of = (tok.num_rows, int(tok.num_tokens.sum())), f"{tok.path}'s"
    else:
        want, of = (plan["num_samples"], plan["num_tokens"]), f"{plan_path}'s ({scope})"
    if (index["num_samples"], index["num_tokens"]) != want:
        raise MergeError([f"totals {index['num_samples']} samples / {index['num_tokens']} tokens differ from "
                          f"{of} {want[0]} / {want[1]}"], scope)
    logger.info("merged %s%d shards, %d chunks: %d samples, %d tokens, %.3f GB (%s, layers %s%s)",
                f"{scope}: " if scope else "", num_shards, len(index["chunks"]), index["num_samples"],
                index["num_tokens"], index["bytes"] / 1e9, meta["storage_dtype"], meta["layer_ids"],
                ", sha256 verified" if verify_sha256 else "")
    logger.info("per-layer statistics of the target features:\n%s", format_layer_stats(index))
    if index_path is not None:
        write_index(index_path, index)
    return index

