"""Extracted features on disk: the contract between extract (writes), merge (checks, indexes) and train (reads).

This module owns the format: the other stages write and read features only through it.

Files under ``results/features/``: ``plan.json`` (its format: :mod:`draftsmith.shard_plan`),
``shard-{i}/manifest.json`` (:data:`FEATURES_FORMAT`: the shard's chunks with sha256, rows and statistics),
``shard-{i}/progress.json`` (:data:`PROGRESS_FORMAT`: finished chunks, for resuming), ``index.json``
(:data:`INDEX_FORMAT`, rule merge: every chunk of every shard; :func:`write_index`, read by :class:`FeatureIndex`).

Chunk file (``shard-{i}/chunk-{j:05d}.safetensors``), samples concatenated without padding; declared once in
:data:`CHUNK_TENSORS`, written by :func:`write_chunk`, read by :class:`ChunkFile` / :func:`read_chunk` (and, without
torch, :func:`read_safetensors_header` / :func:`read_chunk_samples`):

========================  =========================  ================================================
name                      shape                      dtype
========================  =========================  ================================================
``hidden_states``         [tokens, n_layers * H]     bfloat16 | float32 | float8_e4m3fn
``scales``                [tokens, n_layers]         float32 (fp8 storage only; x = q * scale)
``input_ids``             [tokens]                   int32
``loss_mask``             [tokens]                   int8
``offsets``               [samples + 1]              int64 (sample s = rows offsets[s]:offsets[s+1])
``sample_index``          [samples]                  int64 (row index in the tokenized train parquet)
``target_token``          [tokens]                   int32 (optional; argmax of the target's logits
                                                     at position t = its prediction for t + 1)
``target_topk_ids``       [tokens, k]                int32 (optional, ``extract.store_target_topk`` = k;
                                                     the target's k most likely next tokens at t,
                                                     most likely first; column 0 = ``target_token``
                                                     up to exact ties)
``target_topk_logprobs``  [tokens, k]                float16 (with ``target_topk_ids``: their
                                                     log-probabilities under the target's full
                                                     softmax, not renormalised over the k)
========================  =========================  ================================================

The shard manifests and the index record k as ``target_top_k`` only when k > 0 (:func:`target_top_k`: absent
reads as 0, as in every folder written before the key existed), so features without top-k are unchanged.

Layer ids: see :data:`LAYER_SEMANTICS`. ``storage_dtype`` is one of :data:`STORAGE_DTYPES`; float8 stores one
float32 scale per token and tapped layer (:func:`quantize_fp8`).

Importing this module does not import torch (merge checks files without it); the functions that handle tensors
import it when called.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import safe_open

if TYPE_CHECKING:
    import torch

from draftsmith.io import InputError, atomic_path, read_json, reading, sha256_file

FEATURES_FORMAT = "draftsmith.features/1"
PROGRESS_FORMAT = "draftsmith.progress/1"
INDEX_FORMAT = "draftsmith.index/1"
LAYER_SEMANTICS = ("id i = output of decoder layer i = HF output_hidden_states[i + 1]; "
                   "the last layer includes the final norm")
#: ``extract.storage_dtype`` -> the safetensors dtype of ``hidden_states`` (the torch dtype has the same name)
STORAGE_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32"}
#: Bytes per element of the safetensors dtypes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def storage_torch_dtype(storage_dtype: str):
    """The torch dtype of a ``storage_dtype`` name.

    Raises:
        ValueError: not one of :data:`STORAGE_DTYPES`.
    """
    import torch

    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"extract.storage_dtype {storage_dtype!r} not in {list(STORAGE_DTYPES)}")
    return getattr(torch, storage_dtype)


def check_target_topk(store_target_topk: int, store_target_tokens: bool) -> None:
    """Refuse an ``extract.store_target_topk`` that extraction cannot honour (the bound by the vocabulary is checked
    with the target loaded, :class:`draftsmith.extract.FeatureExtractor`).

    Raises:
        ValueError: a negative k, or k > 0 without ``extract.store_target_tokens`` (both keys named).
    """
    if store_target_topk < 0 or (store_target_topk and not store_target_tokens):
        raise ValueError(f"extract.store_target_topk {store_target_topk} must be 0, or > 0 with "
                         f"extract.store_target_tokens: true (it is {store_target_tokens})")


# --------------------------------------------------------------------------------------------------
# the chunk file's tensors


@dataclass(frozen=True)
class ChunkTensor:
    """One tensor of a chunk file.

    Attributes:
        name: the tensor's name in the file.
        dtype: the torch dtype name written; ``None`` for ``hidden_states``, stored in ``extract.storage_dtype``.
        shape: dimensions, each one of ``"tokens"``, ``"samples"``, ``"samples + 1"``, ``"layers"`` (tapped
            layers n), ``"layers * H"`` (n x the target's hidden size) and ``"topk"`` (the manifest's
            ``target_top_k``).
        when: ``"always"``, ``"float8"`` (float8 storage only), ``"target_token"`` (when the shard stores
            target tokens) or ``"target_topk"`` (when it stores the target's top-k, ``target_top_k`` > 0).
        also_accepted: further safetensors dtypes a reader accepts.
    """

    name: str
    dtype: str | None
    shape: tuple[str, ...]
    when: str = "always"
    also_accepted: tuple[str, ...] = ()


#: The tensors of a chunk file, in the order checks report them.
CHUNK_TENSORS = (
    ChunkTensor("hidden_states", None, ("tokens", "layers * H")),
    ChunkTensor("input_ids", "int32", ("tokens",)),
    ChunkTensor("loss_mask", "int8", ("tokens",), also_accepted=("U8", "BOOL")),
    ChunkTensor("offsets", "int64", ("samples + 1",)),
    ChunkTensor("sample_index", "int64", ("samples",)),
    ChunkTensor("scales", "float32", ("tokens", "layers"), when="float8"),
    ChunkTensor("target_token", "int32", ("tokens",), when="target_token"),
    ChunkTensor("target_topk_ids", "int32", ("tokens", "topk"), when="target_topk"),
    ChunkTensor("target_topk_logprobs", "float16", ("tokens", "topk"), when="target_topk"),
)
_SPEC = {t.name: t for t in CHUNK_TENSORS}


def target_top_k(meta: Mapping[str, Any]) -> int:
    """k of the target's top-k a shard manifest or an index records (``target_top_k``); 0 when absent (features
    without top-k, and every folder written before the key existed)."""
    return int(meta.get("target_top_k") or 0)


def chunk_tensors(storage_dtype: str, has_target_token: bool, top_k: int = 0) -> list[ChunkTensor]:
    """The tensors a chunk of this storage dtype holds (``scales`` with float8, ``target_token`` when stored,
    ``target_topk_ids`` / ``target_topk_logprobs`` when ``top_k`` > 0)."""
    present = {"always": True, "float8": storage_dtype == "float8_e4m3fn", "target_token": bool(has_target_token),
               "target_topk": top_k > 0}
    return [t for t in CHUNK_TENSORS if present[t.when]]


def expected_tensors(meta: dict[str, Any], num_samples: int, num_tokens: int
                     ) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """Tensor name -> (allowed safetensors dtypes, shape) a chunk must hold (the extraction contract).

    Args:
        meta: the shard manifest's ``layer_ids``, ``hidden_size``, ``storage_dtype``, ``has_target_token`` and
            ``target_top_k`` (absent: 0, :func:`target_top_k`).
        num_samples / num_tokens: the chunk's samples and tokens.
    Returns:
        ``{name: (dtypes, shape)}`` for :func:`chunk_tensors` (an unknown storage dtype gives ``"?"``).
    """
    n_layers, hidden = len(meta["layer_ids"]), int(meta["hidden_size"])
    top_k = target_top_k(meta)
    dims = {"tokens": num_tokens, "samples": num_samples, "samples + 1": num_samples + 1, "layers": n_layers,
            "layers * H": n_layers * hidden, "topk": top_k}
    want = {}
    for t in chunk_tensors(meta["storage_dtype"], meta["has_target_token"], top_k):
        written = _ST_DTYPES[t.dtype][0] if t.dtype else STORAGE_DTYPES.get(meta["storage_dtype"], "?")
        want[t.name] = ((written, *t.also_accepted), [dims[d] for d in t.shape])
    return want


# --------------------------------------------------------------------------------------------------
# float8 storage


def row_absmax(hidden: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Per token and tapped layer, max |x| over the hidden dim.

    Args:
        hidden: ``[tokens, num_layers * H]`` any float dtype.
    Returns:
        ``[tokens, num_layers]`` float32; NaN where a row holds a NaN, inf where it holds an inf,
        0 where the row is all zero.
    """
    import torch

    t = hidden.shape[0]
    return torch.linalg.vector_norm(hidden.view(t, num_layers, -1), ord=math.inf, dim=-1,
                                    dtype=torch.float32)


def quantize_fp8(hidden: torch.Tensor, num_layers: int, absmax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn storage with one float32 scale per token and tapped layer.

    ``scale = max|x| / 448`` over the layer's H values of that token; ``q = x / scale`` rounded to
    e4m3 (3 mantissa bits) and clamped to +-448. Dequantise with :func:`dequantize_fp8`.

    Round-trip error (e4m3 rounds to nearest with 3 mantissa bits; values below 2^-6 in scaled units
    are subnormal with step 2^-9): elementwise ``|x_hat - x| <= max(2^-4 |x|, 2^-10 * scale)``, i.e.
    at most 6.25 % of the value for values within ~2^15 of the row's max; measured on Gaussian-like
    rows, the relative RMS error per row is ~2-3 % (tested in tests/test_extract.py). It halves the
    disk of bf16 storage (1 byte per value + 4 bytes per token and layer).

    Args:
        hidden: ``[tokens, num_layers * H]`` float (finite).
        absmax: optional precomputed :func:`row_absmax`.
    Returns:
        ``(q [tokens, num_layers * H] float8_e4m3fn, scales [tokens, num_layers] float32)``.
    """
    import torch

    t = hidden.shape[0]
    if absmax is None:
        absmax = row_absmax(hidden, num_layers)
    scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    view = hidden.view(t, num_layers, -1)
    q = torch.empty(view.shape, dtype=torch.float8_e4m3fn, device=hidden.device)
    for j in range(num_layers):  # one layer at a time bounds the float32 temporary
        x = view[:, j, :].float() / scales[:, j:j + 1]
        q[:, j, :] = x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, -1), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``[tokens, n * H]`` fp8 x ``[tokens, n]`` -> ``[tokens, n * H]`` in
    ``dtype`` (default float32)."""
    import torch

    dtype = dtype or torch.float32
    t, n = scales.shape
    return (q.view(t, n, -1).to(torch.float32) * scales[:, :, None]).to(dtype).view(t, -1)


# --------------------------------------------------------------------------------------------------
# writing chunk files


# safetensors dtype names and their rank in the format's tensor order (safetensors sorts tensors by
# dtype, largest enum value first, then by name; matching it makes our files byte-identical to
# ``safetensors.torch.save_file`` -- tested)
_ST_DTYPES = {"int64": ("I64", 7), "float32": ("F32", 6), "int32": ("I32", 5), "bfloat16": ("BF16", 4),
              "float16": ("F16", 3), "float8_e4m3fn": ("F8_E4M3", 2), "int8": ("I8", 1)}


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write CPU tensors as a safetensors file and return the file's sha256, hashing while writing.

    The bytes are exactly those of ``safetensors.torch.save_file(tensors, path, metadata)`` (header
    ``{"__metadata__", name: {dtype, shape, data_offsets}}`` padded with spaces to 8 bytes, tensors by
    dtype then name); files load with ``safetensors.torch.load_file``. Hashing runs in a second thread
    over the same in-memory bytes (both release the GIL), so a chunk costs max(write, hash) instead of
    write + re-read + hash.

    Args:
        tensors: contiguous CPU tensors of dtypes int64, float32, int32, bfloat16, float16, float8_e4m3fn, int8.
    Raises:
        ValueError: an unsupported dtype or a non-CPU tensor.
    """
    import torch

    items = []
    for name, t in tensors.items():
        if _dtype_name(t) not in _ST_DTYPES or t.device.type != "cpu":
            raise ValueError(f"write_safetensors: tensor {name!r} is {t.dtype} on {t.device}")
        items.append((name, t.contiguous()))
    items.sort(key=lambda kv: (-_ST_DTYPES[_dtype_name(kv[1])][1], kv[0]))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[_dtype_name(t)][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + 8) % 8)
    views = [struct.pack("<Q", len(head)) + head]
    views += [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for _, t in items if t.numel()]
    digest = hashlib.sha256()

    def hash_all() -> None:
        for v in views:
            digest.update(v)

    hasher = threading.Thread(target=hash_all, name="chunk-sha256")
    hasher.start()
    try:
        with open(path, "wb") as fh:
            for v in views:
                fh.write(v)
    finally:
        hasher.join()
    return digest.hexdigest()


def write_chunk(path: str | os.PathLike, *, features: torch.Tensor, lengths: Sequence[int],
                sample_index: Sequence[int], input_ids, loss_mask, storage_dtype: str,
                target_token: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                num_layers: int | None = None, metadata: dict[str, str] | None = None,
                target_topk_ids: torch.Tensor | None = None, target_topk_logprobs: torch.Tensor | None = None) -> str:
    """Write one chunk file (samples concatenated, :data:`CHUNK_TENSORS`) atomically; return its sha256.

    Args:
        path: the chunk file; written through a temporary file beside it (``.{name}.*.tmp.safetensors``)
            renamed onto it, with :func:`write_safetensors`.
        features: ``[tokens, n_layers * H]`` CPU: float values (converted to ``storage_dtype``; for float8,
            encoded here with :func:`quantize_fp8`, which needs ``num_layers``), or float8_e4m3fn values already
            encoded, with their ``scales``.
        lengths: tokens of each sample (the offsets are their running sum).
        sample_index: the tokenized train row of each sample.
        input_ids / loss_mask: ``[tokens]`` integer tensors or numpy arrays (stored int32 / int8).
        storage_dtype: one of :data:`STORAGE_DTYPES`.
        target_token: ``[tokens]`` the target's argmax per position (stored int32), or ``None``.
        scales: ``[tokens, n_layers]`` float32 of already encoded float8 ``features``.
        num_layers: n, the tapped layers (float8 encoding only).
        metadata: the safetensors ``__metadata__`` string map.
        target_topk_ids / target_topk_logprobs: ``[tokens, k]`` the target's k most likely next tokens per position
            (stored int32) and their log-probabilities (stored float16), both or neither.

    Raises:
        ValueError: an unknown storage dtype, float8 values without scales (or scales with another storage
            dtype), float8 encoding without ``num_layers``, tensors whose lengths disagree with ``lengths``, or
            one of the top-k tensors without the other, or the two of other shapes or not ``[tokens, k]``.
    """
    import torch

    storage = storage_torch_dtype(storage_dtype)
    if storage == torch.float8_e4m3fn and features.dtype != storage:
        if scales is not None or num_layers is None:
            raise ValueError("write_chunk: float8 encoding needs num_layers and float values without scales")
        features, scales = quantize_fp8(features, num_layers)
    elif (scales is not None) != (storage == torch.float8_e4m3fn):
        raise ValueError(f"write_chunk: scales go with float8_e4m3fn storage only, not {storage_dtype}")
    tensors = {"hidden_states": features.to(storage)}
    if scales is not None:
        tensors["scales"] = scales.to(torch.float32)
    tensors["input_ids"] = torch.as_tensor(input_ids).to(torch.int32)
    tensors["loss_mask"] = torch.as_tensor(loss_mask).to(torch.int8)
    tensors["offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
    tensors["sample_index"] = torch.as_tensor(sample_index, dtype=torch.int64)
    if target_token is not None:
        tensors["target_token"] = torch.as_tensor(target_token).to(torch.int32)
    if (target_topk_ids is None) != (target_topk_logprobs is None):
        raise ValueError(f"write_chunk {path}: target_topk_ids and target_topk_logprobs go together")
    if target_topk_ids is not None:
        tensors["target_topk_ids"] = torch.as_tensor(target_topk_ids).to(torch.int32)
        tensors["target_topk_logprobs"] = torch.as_tensor(target_topk_logprobs).to(torch.float16)
        shapes = {tuple(tensors[n].shape) for n in ("target_topk_ids", "target_topk_logprobs")}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"write_chunk {path}: target_topk_ids / target_topk_logprobs have shapes "
                             f"{sorted(shapes)}, expected one [tokens, k]")
    num_tokens = int(tensors["offsets"][-1])
    rows = {"offsets": len(lengths) + 1, "sample_index": len(lengths)}
    for name, t in tensors.items():
        if t.shape[0] != rows.get(name, num_tokens):
            raise ValueError(f"write_chunk {path}: tensor {name!r} has {t.shape[0]} rows, {len(lengths)} samples "
                             f"of {num_tokens} tokens need {rows.get(name, num_tokens)}")
    with atomic_path(path, suffix=".safetensors") as tmp:
        digest = write_safetensors(tmp, tensors, metadata=metadata)
    return digest


# --------------------------------------------------------------------------------------------------
# reading chunk files


#: Largest header accepted (safetensors itself refuses headers over 100 MB).
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """A chunk file whose safetensors header is missing, cut off or not valid JSON."""


@dataclass
class SafetensorsHeader:
    """The parsed header of a safetensors file.

    Attributes:
        header_bytes: ``N``, the JSON header's length (the data region starts at ``8 + N``).
        tensors: name -> ``{"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}``
            (offsets relative to the data region, in bytes).
        metadata: the ``__metadata__`` string map, ``{}`` when absent.
    """

    header_bytes: int
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        """Bytes the tensors need after the header: the largest end offset."""
        return max((int(t["data_offsets"][1]) for t in self.tensors.values()), default=0)


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse a safetensors header without touching the tensor data (and without torch).

    Format (huggingface/safetensors README): u64 little-endian ``N``, then ``N`` bytes of UTF-8 JSON
    mapping tensor names to ``{dtype, shape, data_offsets}``, then the data region.

    Raises:
        HeaderError: the file is shorter than its header, the JSON does not parse, or a tensor entry
            is malformed (bad dtype, offsets that do not match dtype x shape).
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise HeaderError(f"file is {len(head)} bytes long, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"header length {n} is implausible (not a safetensors file?)")
        raw = fh.read(n)
    if len(raw) < n:
        raise HeaderError(f"header of {n} bytes is cut off after {len(raw)} bytes (truncated file)")
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise HeaderError("header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    for name, info in parsed.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"tensor {name!r}: malformed header entry {info!r}") from None
        if dtype not in DTYPE_BYTES:
            raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if end - begin != numel * DTYPE_BYTES[dtype] or begin < 0:
            raise HeaderError(f"tensor {name!r}: data_offsets {[begin, end]} do not hold {dtype} {shape}")
    return SafetensorsHeader(header_bytes=n, tensors=parsed, metadata=metadata)


def read_header_tensor(path: str | os.PathLike, header: SafetensorsHeader, name: str) -> np.ndarray:
    """Read one small integer tensor by seeking to its bytes (no torch).

    Returns a 1-D numpy array of the stored dtype (``I64`` -> int64, ``I32`` -> int32).

    Raises:
        KeyError: the tensor is not in the header.
        HeaderError: its dtype is not a little-endian integer type, or the file ends early.
    """
    info = header.tensors[name]
    np_dtype = {"I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}.get(info["dtype"])
    if np_dtype is None:
        raise HeaderError(f"tensor {name!r} has dtype {info['dtype']}, expected an integer type")
    begin, end = info["data_offsets"]
    with open(path, "rb") as fh:
        fh.seek(8 + header.header_bytes + begin)
        raw = fh.read(end - begin)
    if len(raw) != end - begin:
        raise HeaderError(f"tensor {name!r} is cut off (truncated file)")
    return np.frombuffer(raw, dtype=np_dtype)


def read_chunk_samples(path: str | os.PathLike, header: SafetensorsHeader) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's ``(sample_index [samples], offsets [samples + 1])`` read through its parsed header (no torch).

    Raises:
        KeyError: a chunk without one of them.
        HeaderError: see :func:`read_header_tensor`.
    """
    return read_header_tensor(path, header, "sample_index"), read_header_tensor(path, header, "offsets")


class ChunkFile:
    """A chunk file opened for reading with ``safetensors.safe_open`` (a memory map): samples are read as row
    ranges, so only their bytes are touched and nothing is copied into RAM up front.

    Tensors read from it stay backed by the file's memory map: do not rewrite the file in place while they live
    (:func:`write_chunk` replaces a file by renaming, which is safe).

    Raises:
        FileNotFoundError: no such file (constructor).
        InputError: the file cannot be opened or is not a whole safetensors file (truncated, damaged; constructor:
            the file named).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with reading(self.path, "a whole safetensors chunk file written by rule extract_shard",
                     "the chunk is truncated or damaged: delete its shard folder and rerun extract (or restore "
                     "the file)"):
            self._fh = safe_open(str(self.path), framework="pt")
        self.names = set(self._fh.keys())

    def check(self, *, storage_dtype: str, has_target_token: bool, width: int, context: str = "", top_k: int = 0
              ) -> tuple[list[int], list[int]]:
        """Check the tensors are there, ``hidden_states`` is ``[tokens, width]``, the top-k tensors (``top_k`` > 0)
        ``[tokens, top_k]``, and ``offsets`` partition the tokens; return ``(offsets, sample_index)`` as lists.

        Raises:
            ValueError: a missing tensor, another width (the file named, then ``context``) or k, offsets that do
                not partition the tokens.
        """
        for t in chunk_tensors(storage_dtype, has_target_token, top_k):
            if t.name not in self.names:
                raise ValueError(f"{self.path}: tensor {t.name!r} is missing")
        shape = self._fh.get_slice("hidden_states").get_shape()
        if len(shape) != 2 or shape[1] != width:
            raise ValueError(f"{self.path}: hidden_states has shape {shape}, expected [tokens, {width}]{context}")
        for name in ("target_topk_ids", "target_topk_logprobs") if top_k > 0 else ():
            got = self._fh.get_slice(name).get_shape()
            if list(got) != [shape[0], top_k]:
                raise ValueError(f"{self.path}: {name} has shape {got}, expected [tokens, k] = [{shape[0]}, {top_k}] "
                                 "(the index's target_top_k)")
        offsets = self._fh.get_tensor("offsets").tolist()
        rows = self._fh.get_tensor("sample_index").tolist()
        if (len(offsets) != len(rows) + 1 or offsets[0] != 0 or offsets[-1] != shape[0]
                or any(b < a for a, b in zip(offsets, offsets[1:]))):
            raise ValueError(f"{self.path}: offsets {offsets[:4]}... do not partition {shape[0]} tokens into "
                             f"{len(rows)} samples")
        return offsets, rows

    def read(self, start: int = 0, end: int | None = None, dtype: torch.dtype | None = None, *,
             dequantize: bool = True, topk: bool = True) -> dict[str, torch.Tensor]:
        """Tokens ``start:end`` (default all): ``features [T, n*H]`` in ``dtype`` (default float32; float8 decoded
        with :func:`dequantize_fp8`, or with ``dequantize=False`` left float8 as stored, with ``scales [T, n]``
        float32), ``input_ids [T]`` int32, ``loss_mask [T]`` int8 and, when stored, ``target_token [T]`` int32,
        ``target_topk_ids [T, k]`` int32 and ``target_topk_logprobs [T, k]`` float16 (those two only with
        ``topk``)."""
        import torch

        dtype = dtype or torch.float32
        if end is None:
            end = self._fh.get_slice("hidden_states").get_shape()[0]
        hidden = self._fh.get_slice("hidden_states")[start:end]
        scales = None
        if hidden.dtype == torch.float8_e4m3fn:
            scales = self._fh.get_slice("scales")[start:end]
            if dequantize:
                hidden, scales = dequantize_fp8(hidden, scales, dtype), None
        out = {"features": hidden if scales is not None else hidden.to(dtype),
               "input_ids": self._fh.get_slice("input_ids")[start:end],
               "loss_mask": self._fh.get_slice("loss_mask")[start:end]}
        for name in ("target_token", "target_topk_ids", "target_topk_logprobs") if topk else ("target_token",):
            if name in self.names:
                out[name] = self._fh.get_slice(name)[start:end]
        if scales is not None:
            out["scales"] = scales
        return out

    def samples(self) -> dict[str, torch.Tensor]:
        """``offsets [samples + 1]`` and ``sample_index [samples]`` int64."""
        return {"offsets": self._fh.get_tensor("offsets"), "sample_index": self._fh.get_tensor("sample_index")}


def read_chunk(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a chunk file, decoded: ``features [tokens, n*H]`` in ``dtype`` (default float32),
    ``input_ids`` / ``loss_mask`` / ``target_token`` (when stored) ``[tokens]``, ``target_topk_ids`` /
    ``target_topk_logprobs`` (when stored) ``[tokens, k]``, ``offsets [samples + 1]`` and
    ``sample_index [samples]`` (see :meth:`ChunkFile.read`; the tensors are backed by the file's memory map)."""
    chunk = ChunkFile(path)
    return {**chunk.read(dtype=dtype), **chunk.samples()}


# --------------------------------------------------------------------------------------------------
# the merged index (written by merge, read by train)


def index_document(fields: dict[str, Any]) -> dict[str, Any]:
    """The index document (:data:`INDEX_FORMAT`): the format id first, then ``fields`` in their order (merge's
    ``num_shards``, totals, shared metadata, statistics and ``chunks``: ``[{"path" relative to the index's folder,
    "shard", "sha256", "num_samples", "num_tokens", "bytes", "rows"}]``)."""
    return {"format": INDEX_FORMAT, **fields}


def write_index(path: str | os.PathLike, index: dict[str, Any]) -> None:
    """Write an index document atomically: metadata indented, one compact line per chunk (rows stay one line).

    Raises:
        ValueError: ``index`` is not an :data:`INDEX_FORMAT` document (see :func:`index_document`).
    """
    if index.get("format") != INDEX_FORMAT:
        raise ValueError(f"write_index {path}: format is {index.get('format')!r}, expected {INDEX_FORMAT!r}")
    head = json.dumps({k: v for k, v in index.items() if k != "chunks"}, indent=2, ensure_ascii=False)
    lines = ",\n".join("    " + json.dumps(c, ensure_ascii=False) for c in index["chunks"])
    with atomic_path(path) as tmp:
        tmp.write_text(f'{head[:-2]},\n  "chunks": [\n{lines}\n  ]\n}}\n', encoding="utf-8")


#: What every chunk entry of an index carries; :class:`FeatureIndex` holds each to its chunk file.
INDEX_CHUNK_FIELDS = ("path", "num_samples", "num_tokens", "bytes", "rows")
_REMERGE = "delete it and rerun merge (snakemake rewrites it from the shards' manifests)"


def index_content_sha256(meta: Mapping[str, Any], where: str | os.PathLike = "index") -> str:
    """sha256 (hex) of what an index's samples hold: of its chunk files' sha256 (merge records each one, computed by
    extract while writing the chunk), sorted, so the digest does not depend on the chunks' order or paths; one
    changed byte in any chunk file gives another digest. ``where`` names the index in errors.

    Raises:
        ValueError: a chunk entry without a sha256 (the index, the chunk's number and path named).
    """
    digests = []
    for ci, chunk in enumerate(meta.get("chunks") or []):
        digest = chunk.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError(f"{where}: chunk {ci} ({chunk.get('path')}) has no sha256 (merge records one per "
                             "chunk): rerun merge")
        digests.append(digest)
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


def verify_chunk_sha256(index: FeatureIndex, *, threads: int = 1, share: tuple[int, int] = (0, 1),
                        chunks: Sequence[int] | None = None) -> int:
    """Hash chunk files ``share[0]::share[1]`` of ``index`` (a rank's share: ``(rank, world)``) on ``threads``
    threads and compare each with the sha256 the index records; returns the bytes hashed. ``chunks`` (chunk numbers)
    hashes only those (the rank's share is taken of them); default every chunk.

    Reads every byte of those files (hashlib releases the GIL, so threads hash files in parallel; one core hashes
    about 0.7 GB/s, docs/measurements.md).

    Raises:
        ValueError: a chunk file whose sha256 differs from the index's (the index, the chunk, its file and both
            digests named); a chunk entry without a sha256.
    """
    from concurrent.futures import ThreadPoolExecutor

    index_content_sha256(index.meta, index.path)  # every entry has a sha256
    todo = list(range(len(index.files))) if chunks is None else list(chunks)
    mine = todo[share[0]::share[1]]

    def check(ci: int) -> int:
        digest, recorded = sha256_file(index.files[ci]), index.meta["chunks"][ci]["sha256"]
        if digest != recorded:
            raise ValueError(f"{index.path}: chunk {ci} file {index.files[ci]} has sha256 {digest}, the index records "
                             f"{recorded}: the file changed after merge (rerun extract and merge)")
        return index.files[ci].stat().st_size

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return sum(pool.map(check, mine))


@dataclass(frozen=True)
class SampleRef:
    """Where one tokenized row's features live: chunk ``chunk``, tokens ``start:end`` of that chunk."""

    chunk: int
    start: int
    end: int
    row: int  # tokenized train row index

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class FeatureIndex:
    """The merged feature index (``results/features/index.json``) and its chunk files, memory-mapped.

    Each chunk is a :class:`ChunkFile` (``safetensors.safe_open``, a memory map); samples are read as row ranges,
    so only the bytes of the requested samples are touched and nothing is copied into RAM up front. Only the small
    ``offsets`` / ``sample_index`` tensors are read at open time.

    Samples are named by their tokenized train row: :meth:`ref` / :meth:`has_row` (an index may hold any subset of
    the rows, e.g. one slice of a stream-mode run).

    Attributes:
        meta: the index JSON. samples: one :class:`SampleRef` per stored sample, in index order.
        layer_ids, hidden_size, num_target_layers, storage_dtype, has_target_token: from the index.
        target_top_k: the index's ``target_top_k``, 0 when absent (:func:`target_top_k`).

    The index is held to what it describes at open time, from what is cheap: each chunk entry's ``bytes`` against
    the file's size, ``num_samples`` / ``num_tokens`` / ``rows`` against the chunk header's ``offsets`` and
    ``sample_index`` (read anyway), the totals ``num_samples`` / ``num_tokens`` (and ``bytes`` when present)
    against the chunks'. Chunk sha256s are not recomputed here (that reads every byte; merge does it with
    ``merge.verify_sha256``).

    Raises:
        FileNotFoundError: the index or a chunk file is missing.
        InputError: an entry or total that disagrees with the chunk files (the field named, e.g.
            ``chunks[3].num_samples``), an unreadable chunk file.
        ValueError: wrong format, a chunk lacking a tensor or with inconsistent shapes, a tokenized row stored twice
            (file and field named).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta = read_json(self.path)
        if self.meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"{self.path}: format is {self.meta.get('format')!r}, expected {INDEX_FORMAT!r}")
        for key in ("chunks", "layer_ids", "hidden_size", "num_target_layers", "storage_dtype", "has_target_token"):
            if key not in self.meta:
                raise ValueError(f"{self.path}: field {key!r} is missing")
        self.layer_ids = [int(i) for i in self.meta["layer_ids"]]
        self.hidden_size = int(self.meta["hidden_size"])
        self.num_target_layers = int(self.meta["num_target_layers"])
        self.storage_dtype = self.meta["storage_dtype"]
        self.has_target_token = bool(self.meta["has_target_token"])
        self.target_top_k = target_top_k(self.meta)
        self.width = len(self.layer_ids) * self.hidden_size
        self.files: list[Path] = []
        self.chunks: list[ChunkFile] = []
        self.samples: list[SampleRef] = []
        self._by_row: dict[int, int] = {}  # tokenized row -> position in samples
        for ci, chunk in enumerate(self.meta["chunks"]):
            missing = [k for k in INDEX_CHUNK_FIELDS if not isinstance(chunk, dict) or k not in chunk]
            if missing:
                raise InputError(self.path, f"chunk {ci} lacks {missing}", field=f"chunks[{ci}]",
                                 expected=f"the fields {list(INDEX_CHUNK_FIELDS)} merge writes", action=_REMERGE)
            file = self.path.parent / chunk["path"]
            if not file.is_file():
                raise FileNotFoundError(f"{self.path}: chunk {ci} file {file} does not exist")
            self.files.append(file)
            self.chunks.append(ChunkFile(file))
            offsets, rows = self.chunks[ci].check(
                storage_dtype=self.storage_dtype, has_target_token=self.has_target_token, width=self.width,
                context=f" ({len(self.layer_ids)} layers x {self.hidden_size})", top_k=self.target_top_k)
            self._check_entry(ci, chunk, file, offsets, rows)
            for i, row in enumerate(rows):
                if int(row) in self._by_row:
                    raise ValueError(f"{self.path}: tokenized row {row} is stored twice (chunk "
                                     f"{self.samples[self._by_row[int(row)]].chunk} and chunk {ci})")
                self._by_row[int(row)] = len(self.samples)
                self.samples.append(SampleRef(ci, offsets[i], offsets[i + 1], int(row)))
        if not self.samples:
            raise ValueError(f"{self.path}: the index holds no samples")
        totals = {"num_samples": len(self.samples), "num_tokens": sum(r.num_tokens for r in self.samples),
                  "bytes": sum(f.stat().st_size for f in self.files)}
        for key, value in totals.items():
            if (key != "bytes" or key in self.meta) and self.meta.get(key) != value:
                raise InputError(self.path, f"says {self.meta.get(key)!r} but its chunks hold {value}", field=key,
                                 expected=f"the sum of the chunks' {key}", action=_REMERGE)

    def _check_entry(self, ci: int, entry: dict, file: Path, offsets: list[int], rows: list[int]) -> None:
        """Hold chunk ``ci``'s index entry to its file: size on disk, samples, tokens and rows of its header's
        ``offsets`` / ``sample_index`` (already read). Its sha256 is not recomputed (every byte; merge's
        ``merge.verify_sha256`` does that).

        Raises:
            InputError: the first field that disagrees (the index, the chunk and the field named).
        """
        found = {"bytes": file.stat().st_size, "num_samples": len(rows), "num_tokens": offsets[-1],
                 "rows": [int(r) for r in rows]}
        for key, value in found.items():
            if entry[key] != value:
                shown = entry[key] if key != "rows" else f"{entry[key][:4]}..."
                have = value if key != "rows" else f"{value[:4]}..."
                raise InputError(self.path, f"says {shown} but {file} holds {have}", field=f"chunks[{ci}].{key}",
                                 expected="the index merge wrote for these chunk files (was it edited by hand, or "
                                          "a chunk rewritten after merge?)", action=_REMERGE)

    def has_row(self, row: int) -> bool:
        """Whether the features of tokenized train row ``row`` are in this index."""
        return row in self._by_row

    def ref(self, row: int) -> SampleRef:
        """Where the features of tokenized train row ``row`` live.

        Raises:
            KeyError: the index does not hold that row (the index named).
        """
        try:
            return self.samples[self._by_row[row]]
        except KeyError:
            raise KeyError(f"{self.path}: no features of tokenized row {row} (the index holds "
                           f"{len(self.samples)} samples)") from None

    def read(self, ref: SampleRef, length: int | None = None, dtype: torch.dtype | None = None, *,
             dequantize: bool = True, topk: bool = True) -> dict[str, torch.Tensor]:
        """Tensors of one sample (first ``length`` tokens): ``features [T, n*H]`` in ``dtype`` (default bfloat16;
        fp8 dequantised as ``fp8 * scale`` per token and layer, or with ``dequantize=False`` left float8 with
        ``scales [T, n]`` float32, for decoding on the GPU), ``input_ids`` / ``target_token`` ``[T]`` int64,
        ``loss_mask`` ``[T]`` bool and, with ``target_top_k`` = k > 0 and ``topk``, ``target_topk_ids [T, k]``
        int32 and ``target_topk_logprobs [T, k]`` float16 as stored (``topk=False``: not read, for a run that
        trains on the greedy token)."""
        import torch

        end = ref.start + (ref.num_tokens if length is None else min(length, ref.num_tokens))
        part = self.chunks[ref.chunk].read(ref.start, end, dtype or torch.bfloat16, dequantize=dequantize,
                                           topk=topk)
        out = {"features": part["features"], "input_ids": part["input_ids"].long(),
               "loss_mask": part["loss_mask"].bool()}
        if self.has_target_token:
            out["target_token"] = part["target_token"].long()
        if self.target_top_k and topk:  # as stored (6k bytes a token): widened on the device, rows in use only
            out["target_topk_ids"] = part["target_topk_ids"]
            out["target_topk_logprobs"] = part["target_topk_logprobs"]
        if "scales" in part:
            out["scales"] = part["scales"]
        return out
