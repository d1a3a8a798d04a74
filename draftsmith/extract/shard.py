"""Rule extract_shard: one shard of the plan -> chunk files of the target's tapped-layer features + ``manifest.json``.

Reading order: the batches and chunks of a shard (:func:`make_batches`, :func:`make_chunks`), the stage's settings
(:class:`ExtractShardSettings`), then :func:`extract_shard` and the compute/write pipeline it runs
(:class:`_ShardRunner`). The forward: :mod:`draftsmith.extract.extractor`; the files' format:
:mod:`draftsmith.features`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch
from torch import nn

from draftsmith import fused
from draftsmith.disk import DiskSpaceError, bytes_per_token, disk_fit, measure_room, needed_bytes, projected_bytes
from draftsmith.extract.extractor import FeatureExtractor, logit_transform  # noqa: F401 (re-exported)
from draftsmith.extract.folders import bytes_left, open_staging, publish, shard_folders
from draftsmith.features import (
    FEATURES_FORMAT,
    LAYER_SEMANTICS,
    PROGRESS_FORMAT,
    check_target_topk,
    quantize_fp8,
    row_absmax,
    storage_torch_dtype,
    write_chunk,
)
from draftsmith.gpu import GpuOptions
from draftsmith.io import read_json, remove_dead_temporaries, sha256_file, target_fingerprint, write_json
from draftsmith.progress import progress
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.shard_plan import PLAN_FORMAT, subset_label
from draftsmith.target import (
    default_device,
    fla_available,
    is_hybrid,
    load_target,
    resolve_dtype,
    target_dims,
    text_config,
)
from draftsmith.target_layers import validate_layer_ids
from draftsmith.tokenized import Tokenized, read_tokenized

log = logging.getLogger("draftsmith.extract")



class FeatureSanityError(RuntimeError):
    """Non-finite values or all-zero feature rows in the target's hidden states (names the sample)."""


# --------------------------------------------------------------------------------------------------
# batches and chunks


@dataclass(frozen=True)
class Batch:
    """One forward: tokenized rows (longest first) and their lengths in tokens."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * max(self.lengths)


def make_batches(rows: list[int], lengths: list[int] | np.ndarray, token_budget: int) -> list[Batch]:
    """Length-sorted batches whose padded size (batch x longest) stays within ``token_budget``.

    Rows are ordered by length descending (ties by row index), so each batch's first row is its
    longest and padding is small. A row of ``token_budget`` tokens or more runs alone (a batch of one
    is run without an attention mask). Deterministic.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(rows)), key=lambda k: (-int(lengths[k]), rows[k]))
    batches: list[Batch] = []
    cur: list[int] = []
    for k in order:
        if cur and (len(cur) + 1) * int(lengths[cur[0]]) > token_budget:
            batches.append(Batch(tuple(rows[j] for j in cur), tuple(int(lengths[j]) for j in cur)))
            cur = []
        cur.append(k)
    if cur:
        batches.append(Batch(tuple(rows[j] for j in cur), tuple(int(lengths[j]) for j in cur)))
    return batches


def make_chunks(batches: list[Batch], chunk_tokens: int) -> list[list[Batch]]:
    """Group consecutive batches into chunks of at least ``chunk_tokens`` real tokens (the last one
    may be smaller; a chunk always ends on a batch boundary)."""
    chunks: list[list[Batch]] = []
    cur: list[Batch] = []
    size = 0
    for b in batches:
        cur.append(b)
        size += b.real_tokens
        if size >= chunk_tokens:
            chunks.append(cur)
            cur, size = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def chunk_name(index: int) -> str:
    return f"chunk-{index:05d}.safetensors"


# --------------------------------------------------------------------------------------------------
# the shard job


@dataclass(frozen=True)
class ShardExtractOptions(SectionSettings):
    """The ``extract`` keys rule extract_shard reads: what the chunks hold (``storage_dtype``,
    ``store_target_tokens``, ``store_target_topk``, ``chunk_tokens``) and how the forwards run (the others).

    Raises:
        ValueError: a ``storage_dtype`` not in :data:`draftsmith.features.STORAGE_DTYPES`; ``store_target_topk``
            > 0 without ``store_target_tokens`` (or negative).
    """

    SECTION: ClassVar[str] = "extract"
    storage_dtype: str
    store_target_tokens: bool
    store_target_topk: int
    chunk_tokens: int
    token_budget: int
    padding_mask: bool
    require_fla: bool
    disk_headroom: float
    fuse: bool | str

    def __post_init__(self) -> None:
        storage_torch_dtype(self.storage_dtype)  # refuses an unknown name
        check_target_topk(self.store_target_topk, self.store_target_tokens)


@dataclass(frozen=True)
class ShardTargetOptions(SectionSettings):
    """The ``target`` keys rule extract_shard reads (how the target is loaded)."""

    SECTION: ClassVar[str] = "target"
    dtype: str
    attn_implementation: str
    trust_remote_code: bool


@dataclass(frozen=True)
class ExtractShardSettings(StageSettings):
    """Everything rule extract_shard reads from the config."""

    STAGE: ClassVar[str] = "extract_shard"
    extract: ShardExtractOptions
    target: ShardTargetOptions
    gpu: GpuOptions


@dataclass(frozen=True)
class ExtractSliceSettings(ExtractShardSettings):
    """Everything rule extract_slice (one shard of a stream-mode slice) reads: rule extract_shard's keys."""

    STAGE: ClassVar[str] = "extract_slice"


@dataclass(frozen=True)
class ExtractHeldoutSettings(ExtractShardSettings):
    """Everything rule extract_heldout (the held-out samples of stream mode) reads: rule extract_shard's keys."""

    STAGE: ClassVar[str] = "extract_heldout"


@dataclass
class _ChunkWork:
    index: int
    batches: list[Batch]
    rows: list[int]
    ids: list[str]
    num_tokens: int


def _layout_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _verify_record(folder: Path, rec: dict) -> str | None:
    """None when the chunk file matches its progress record (size and sha256), else the reason."""
    path = folder / rec["file"]
    if not path.is_file():
        return "file missing"
    size = path.stat().st_size
    if size != rec["bytes"]:
        return f"size {size} != recorded {rec['bytes']} (truncated or foreign)"
    digest = sha256_file(path)
    if digest != rec["sha256"]:
        return "sha256 mismatch"
    return None


def _shard_stats(records: list[dict], hidden: int, num_layers: int) -> dict:
    tokens = sum(r["num_tokens"] for r in records)
    rms = []
    for j in range(num_layers):
        ss = sum(r["stats"]["rms"][j] ** 2 * r["num_tokens"] * hidden for r in records)
        rms.append(math.sqrt(ss / (tokens * hidden)) if tokens else 0.0)
    return {"rms": rms, "nonfinite": sum(r["stats"]["nonfinite"] for r in records),
            "zero_rows": sum(r["stats"]["zero_rows"] for r in records)}


def _read_shard_inputs(plan_path, tokenized_path, target_dir, shard: int, trust_remote_code: bool
                       ) -> tuple[dict, list[int], Tokenized]:
    """The plan, this shard's rows and the tokenized set, checked against each other and the target.

    Raises:
        ValueError: another plan format, a shard outside the plan, a stale plan, a target of another shape,
            token ids outside the target's vocabulary (file, row, field and position named).
    """
    plan = read_json(plan_path)
    if plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"{plan_path}: format {plan.get('format')!r}, expected {PLAN_FORMAT!r}")
    if not 0 <= shard < plan["num_shards"]:
        raise ValueError(f"{plan_path}: shard {shard} outside 0..{plan['num_shards'] - 1}")
    layer_ids, hidden, num_target_layers = plan["layer_ids"], plan["hidden_size"], plan["num_target_layers"]
    rows = list(plan["shards"][shard]["rows"])

    tok = read_tokenized(tokenized_path)
    if len(tok.ids) != plan["tokenized_rows"] or int(tok.num_tokens.sum()) != plan["tokenized_tokens"]:
        raise ValueError(f"{plan_path} is stale: it was made for {plan['tokenized_rows']} rows / "
                         f"{plan['tokenized_tokens']} tokens but {tokenized_path} has {len(tok.ids)} rows / "
                         f"{int(tok.num_tokens.sum())} tokens; rerun extract_plan")
    nl, hs, vocab = target_dims(target_dir, trust_remote_code=trust_remote_code)
    if (nl, hs) != (num_target_layers, hidden):
        raise ValueError(f"{plan_path}: planned for L={num_target_layers}, H={hidden} but target "
                         f"{target_dir} has L={nl}, H={hs}; rerun extract_plan")
    validate_layer_ids(layer_ids, nl)
    if rows:
        span = np.concatenate([tok.input_ids[tok.offsets[r]:tok.offsets[r + 1]] for r in rows])
        if span.min() < 0 or span.max() >= vocab:
            for r in rows:
                ids_r, _ = tok.row(r)
                bad = np.nonzero((ids_r < 0) | (ids_r >= vocab))[0]
                if bad.size:
                    raise ValueError(f"{tokenized_path}: row {r} (id {tok.ids[r]}): field 'input_ids' "
                                     f"position {int(bad[0])} holds {int(ids_r[bad[0]])}, outside the "
                                     f"target vocabulary 0..{vocab - 1}")
    return plan, rows, tok


def _resume_chunks(folder: Path, name: str, layout: str, chunks: list[_ChunkWork]) -> dict[int, dict]:
    """Finished chunks kept from an earlier run of this layout (file, size and sha256 verified); partial
    files, chunks of another layout and unverifiable ones are removed or redone."""
    progress_path = folder / "progress.json"
    records: dict[str, dict] = {}
    if progress_path.exists():
        prog = read_json(progress_path)
        if prog.get("format") == PROGRESS_FORMAT and prog.get("layout") == layout:
            records = {r["file"]: r for r in prog.get("chunks", [])}
        else:
            log.warning("%s: %s was made for another layout (plan, data, target or config "
                        "changed): recomputing every chunk", name, progress_path)
    # partial files of a killed job: the shard's job is its folder's only writer (Snakemake runs one per output)
    remove_dead_temporaries(folder, [".chunk-"], only_writer=True, what=name)
    wanted = {chunk_name(c.index) for c in chunks}
    for stale in folder.glob("chunk-*.safetensors"):
        if stale.name not in wanted:
            log.warning("%s: removing %s, not part of the current layout", name, stale.name)
            stale.unlink()
    done: dict[int, dict] = {}
    for c in chunks:
        rec = records.get(chunk_name(c.index))
        if rec is None:
            continue
        reason = _verify_record(folder, rec)
        if reason is None and rec["rows"] == c.rows:
            done[c.index] = rec
        else:
            log.warning("%s: %s will be redone: %s", name, rec["file"], reason or "rows differ")

    return done


def extract_shard(*, plan_path: str | os.PathLike, tokenized_path: str | os.PathLike,
                  target_dir: str | os.PathLike, manifest_path: str | os.PathLike, shard: int,
                  settings: ExtractShardSettings, model: nn.Module | None = None,
                  device: torch.device | str | None = None,
                  on_chunk: Callable[[int, dict], None] | None = None,
                  run_stats: dict | None = None, staging_dir: str | os.PathLike | None = None,
                  shard_dirs: Sequence[str | os.PathLike | Sequence[str | os.PathLike]] | None = None) -> dict:
    """Extract one shard of the plan into chunk files beside ``manifest_path`` and write the manifest.

    Resumable: ``progress.json`` beside the chunks (written atomically after each chunk) records every
    finished chunk's size and sha256; on restart a chunk whose file exists with the recorded size and
    sha256 is kept, any other chunk (no record, missing, truncated, mismatched) is recomputed. The
    chunk layout (batches and chunk boundaries) is a pure function of the plan, the tokenized rows and
    the config, and its hash is recorded: a changed layout restarts the shard.

    **Staged** (``staging_dir`` given): chunks, ``progress.json`` and the manifest are written in ``staging_dir``,
    which is renamed onto ``manifest_path``'s folder once the manifest is written (``os.replace``: the two must be
    on one file system, the destination absent or empty). A killed job's chunks survive the deletion of the rule's
    ``directory()`` output and the rerun resumes from them; the output folder appears only complete. A non-empty
    output folder without a staging folder is moved back into ``staging_dir`` first (a rerun resumes from it).
    Records name files relative to their folder, so nothing holds the staging path.

    A plan with a ``subset`` (:func:`draftsmith.shard_plan.shard_plan`, stream mode) is extracted the same way; its
    manifest records the subset and the errors name it (``phase 3 shard 1 chunk 2: ...``).

    Args:
        plan_path / tokenized_path / target_dir: inputs of the rule.
        manifest_path: ``results/features/shard-{i}/manifest.json`` (stream mode:
            ``results/stream/phase-{p}/shard-{i}/manifest.json``).
        shard: shard index in the plan.
        settings: the stage's keys: ``extract`` (storage_dtype, store_target_tokens, store_target_topk, chunk_tokens,
            token_budget, padding_mask, require_fla, disk_headroom, fuse) and ``target`` (dtype,
            attn_implementation, trust_remote_code).
        model: an already loaded target (tests, benchmarks); else it is loaded with
            :func:`draftsmith.target.load_target` -- only when some chunk remains to be computed.
        device: where to load the model (default: cuda if available else cpu).
        on_chunk: ``callback(chunk_index, record)`` after each chunk is durable (tests use it to
            interrupt a job).
        run_stats: if given, filled with timings of this run (seconds): ``forwards``, ``compute_s``
            (forwards + checks + copies), ``write_s`` (writer thread busy), ``wait_s`` (compute waiting
            on the writer), ``host_alloc_s`` (pinned buffers), ``chunks_done`` (computed now), ``fused``
            (what :func:`draftsmith.fused.fused_target` changed).
        staging_dir: where this shard is written before it is renamed into place (see above); ``None`` writes
            beside ``manifest_path`` directly.
        shard_dirs: for the disk check, every shard of the plan's folders (one entry per shard: a folder or a list
            of folders, e.g. its output and its staging folder). Default: ``<manifest's folder>/../shard-{j}`` and,
            when staged, ``<staging_dir>/../shard-{j}``.

    Returns:
        The manifest (``draftsmith.features/1``), also written to ``manifest_path``.

    Raises:
        DiskSpaceError: free disk < the bytes all shards of the plan still have to write x ``disk_headroom`` + the
            plan's ``reserve_bytes`` (:func:`_check_disk`).
        FeatureSanityError: non-finite values or all-zero rows (names sample id, row, layer, position).
        ValueError: a stale plan (tokenized rows changed), bad tokenized input, token ids outside the
            vocabulary -- naming file, row and field; a staging folder on another file system than the output.
        RuntimeError: the output folder and the staging folder both hold files.
    """
    opts = settings.extract
    storage, want_tt, top_k = opts.storage_dtype, bool(opts.store_target_tokens), int(opts.store_target_topk)
    manifest_path = Path(manifest_path)
    out = manifest_path.parent
    folder = out if staging_dir is None else open_staging(Path(staging_dir), out)
    folder.mkdir(parents=True, exist_ok=True)
    plan, rows, tok = _read_shard_inputs(plan_path, tokenized_path, target_dir, shard,
                                         settings.target.trust_remote_code)
    scope = subset_label(plan.get("subset"))
    name = f"{scope} shard {shard}" if scope else f"shard {shard}"
    layer_ids, hidden = plan["layer_ids"], plan["hidden_size"]
    lengths = [int(tok.num_tokens[r]) for r in rows]
    batches = make_batches(rows, lengths, int(opts.token_budget))
    chunks = _chunk_work(batches, tok, int(opts.chunk_tokens))

    fingerprint = target_fingerprint(target_dir)
    if model is not None:
        model_dtype = str(next(model.parameters()).dtype)
    else:
        model_dtype = str(resolve_dtype(settings.target.dtype, device or default_device()))
    layout = _layout_key(chunks=[[c.rows, c.ids, [list(b.rows) for b in c.batches]] for c in chunks],
                         layer_ids=layer_ids, storage=storage, target_token=want_tt,
                         padding_mask=bool(opts.padding_mask), target=fingerprint,
                         dtype=model_dtype.replace("torch.", ""), content=_content_hash(tok, rows),
                         **({"target_topk": top_k} if top_k else {}))  # k = 0 keeps the layouts of before
    done = _resume_chunks(folder, name, layout, chunks)
    todo = [c for c in chunks if c.index not in done]
    dirs = shard_folders(plan["num_shards"], out, staging_dir, shard_dirs)
    _check_disk(folder, name, shard, plan, len(batches), chunks, todo, dirs, storage, want_tt, opts,
                Path(plan_path).parent)

    common = {"shard": shard, "num_shards": plan["num_shards"]}
    if "subset" in plan:
        common["subset"] = plan["subset"]
    common.update({
        "layer_ids": layer_ids, "layer_semantics": LAYER_SEMANTICS, "hidden_size": hidden,
        "num_target_layers": plan["num_target_layers"], "storage_dtype": storage, "has_target_token": want_tt,
        **({"target_top_k": top_k} if top_k else {}),  # absent = 0 (draftsmith.features.target_top_k)
        "target_fingerprint": fingerprint, "tokenizer_fingerprint": tok.metadata.get("tokenizer_fingerprint"),
        "chat_template_kwargs": tok.metadata.get("chat_template_kwargs") or {},
    })
    if common["tokenizer_fingerprint"] is None:
        log.warning("%s has no draftsmith.tokenizer_fingerprint metadata: recorded as null", tokenized_path)
    if todo:
        _compute_chunks(todo, len(chunks), model, target_dir, settings, device, folder, name, tok, layout, done,
                        on_chunk, common, run_stats)
    manifest = _write_manifest(folder / manifest_path.name, name, common, [done[c.index] for c in chunks], rows,
                               sum(lengths))
    if staging_dir is not None:
        publish(folder, out)
    return manifest


def _chunk_work(batches: list, tok: Tokenized, chunk_tokens: int) -> list[_ChunkWork]:
    """The shard's chunks: consecutive forward batches of about ``chunk_tokens`` tokens, with their rows' ids."""
    chunks = []
    for j, chunk_batches in enumerate(make_chunks(batches, chunk_tokens)):
        chunk_rows = [r for b in chunk_batches for r in b.rows]
        chunks.append(_ChunkWork(j, chunk_batches, chunk_rows, [tok.ids[r] for r in chunk_rows],
                                 sum(b.real_tokens for b in chunk_batches)))
    return chunks


def _content_hash(tok: Tokenized, rows: list[int]) -> str:
    """sha256 over the shard's rows' token ids and loss masks (part of the chunk layout key)."""
    content = hashlib.sha256()
    for r in rows:
        ids_r, loss_mask_r = tok.row(r)
        content.update(ids_r.tobytes())
        content.update(loss_mask_r.tobytes())
    return content.hexdigest()


def _check_disk(folder: Path, name: str, shard: int, plan: dict, num_batches: int, chunks: list[_ChunkWork],
                todo: list[_ChunkWork], dirs: list[list[Path]], storage: str, want_tt: bool,
                opts: ShardExtractOptions, plan_dir: Path) -> None:
    """Log the shard's projected size and refuse to start when what **every** shard of the plan still has to
    write (they run at once), times the headroom, plus the plan's ``reserve_bytes`` does not fit the free disk.

    This shard's bytes still to write are its chunks not done; another shard's are its projection minus its
    finished chunks on disk (:func:`draftsmith.extract.folders.bytes_left`). The free disk is measured where the
    chunks go (``folder``); when the plan names the drafter's folder (``disk.drafter_dir``) on another file system,
    the part of the reserve written there is held to that one's free bytes instead
    (:func:`draftsmith.disk.measure_room`, which also removes dead writers' temporaries under the plan's
    ``disk.results_dir`` and counts the others).

    Raises:
        DiskSpaceError: free disk < :func:`draftsmith.disk.needed_bytes` (all shards' bytes still to write,
            ``disk_headroom``, the plan's reserve); the message names the shards with bytes still to write and, from
            the plan's ``disk.fit``, the smallest ``stream.slices`` that fits the whole run and what fp8 would need.
    """
    n_layers, hidden, headroom = len(plan["layer_ids"]), int(plan["hidden_size"]), float(opts.disk_headroom)
    top_k = int(opts.store_target_topk)
    rows, tokens = sum(len(c.rows) for c in chunks), sum(c.num_tokens for c in chunks)
    total = projected_bytes(tokens, rows, n_layers, hidden, storage, want_tt, len(chunks), target_topk=top_k)
    own_left = projected_bytes(sum(c.num_tokens for c in todo), sum(len(c.rows) for c in todo), n_layers, hidden,
                               storage, want_tt, len(todo), target_topk=top_k)
    left = bytes_left(plan, shard, own_left, dirs, storage=storage, want_tt=want_tt,
                      chunk_tokens=int(opts.chunk_tokens), target_topk=top_k)
    remaining, reserve = sum(left.values()), int(plan.get("reserve_bytes", 0))
    disk = plan.get("disk") or {}
    drafter_dir = plan_dir / disk["drafter_dir"] if disk.get("drafter_dir") else None
    results_dir = plan_dir / disk["results_dir"] if disk.get("results_dir") else None
    room = measure_room(folder, drafter_dir, results_dir=results_dir if todo else None)
    elsewhere = int(disk.get("drafter_reserve_bytes", 0)) if room.reserve_free_bytes is not None else 0
    free = room.free_bytes
    log.info("%s: %d rows, %d tokens, %d batches, %d chunks (%d already done); projected %.3f GB "
             "(%d bytes/token: %d layers x %d x %s%s), %.3f GB still to write (%.3f GB by all %d shards of the "
             "plan), reserve %.3f GB, %.3f GB free", name, rows, tokens, num_batches, len(chunks),
             len(chunks) - len(todo), total / 1e9,
             bytes_per_token(n_layers, hidden, storage, want_tt, target_topk=top_k), n_layers, hidden, storage,
             (" + target tokens" if want_tt else "") + (f" + top-{top_k}" if top_k else ""), own_left / 1e9,
             remaining / 1e9, plan["num_shards"], reserve / 1e9, free / 1e9)
    need = needed_bytes(remaining, headroom, reserve - elsewhere)
    short_elsewhere = elsewhere > (room.reserve_free_bytes or 0)
    if todo and (free < need or short_elsewhere):
        shares = ", ".join(f"shard {j}: {b / 1e9:.3f} GB" for j, b in sorted(left.items()) if b)
        reserve_text = (f"plus a reserve of {reserve / 1e9:.3f} GB for checkpoints and the trained drafter"
                        if not elsewhere else
                        f"plus {(reserve - elsewhere) / 1e9:.3f} GB kept for other features (the reserve of "
                        f"{elsewhere / 1e9:.3f} GB for checkpoints and the trained drafter goes to {drafter_dir}, "
                        f"{room.reserve_free_bytes / 1e9:.3f} GB free there)")
        message = (f"{name}: {remaining / 1e9:.3f} GB still to write x headroom {headroom} = "
                   f"{math.ceil(remaining * headroom) / 1e9:.3f} GB by the {len(left)} shards of the plan, which run "
                   f"at once ({shares}), {reserve_text} = {need / 1e9:.3f} GB, but only {free / 1e9:.3f} GB free "
                   f"under {folder}")
        if disk.get("fit"):  # the whole run's advice, the features written so far counted as free
            chunk_tokens = int(opts.chunk_tokens)
            whole = {int(s["shard"]): projected_bytes(int(s["num_tokens"]), len(s["rows"]), n_layers, hidden,
                                                      storage, want_tt, -(-int(s["num_tokens"]) // chunk_tokens),
                                                      target_topk=top_k)
                     for s in plan["shards"]}
            whole[shard] = total  # as bytes_left counts each shard
            done = sum(max(0, whole[j] - left.get(j, 0)) for j in whole)
            fit = disk_fit(**disk["fit"], storage_dtype=storage, target_token=want_tt, target_topk=top_k,
                           free_bytes=free + done, headroom=headroom, room=replace(room, free_bytes=free + done))
            message += (f". For the whole run (the {done / 1e9:.3f} GB of features written so far counted as "
                        f"free): {fit.message()}")
        else:
            message += "." + room.leftovers_note
        raise DiskSpaceError(message)


def _compute_chunks(todo: list[_ChunkWork], num_chunks: int, model: nn.Module | None, target_dir,
                    settings: ExtractShardSettings, device, folder: Path, name: str, tok: Tokenized, layout: str,
                    done: dict, on_chunk, common: dict, run_stats: dict | None) -> None:
    """Load the target (unless given), then compute and write the chunks still to do (:class:`_ShardRunner`);
    ``done`` gains their records."""
    opts, target = settings.extract, settings.target
    if model is None:
        model = load_target(target_dir, dtype=target.dtype, device=device,
                            attn_implementation=target.attn_implementation,
                            trust_remote_code=target.trust_remote_code, require_fla=bool(opts.require_fla))
    elif is_hybrid(model.config) and not fla_available():
        msg = "hybrid Gated DeltaNet target without flash-linear-attention: torch fallback (slow)"
        if opts.require_fla:
            raise RuntimeError(msg)
        log.warning("!" * 20 + " " + msg)
    runner = _ShardRunner(model, folder, common["shard"], name, common["layer_ids"], tok, common["storage_dtype"],
                          common["has_target_token"], bool(opts.padding_mask), layout, done, on_chunk, common)
    fuse = fused.resolve_fuse(opts.fuse, next(model.parameters()).device)
    with fused.fused_target(model, enabled=fuse) as fuse_report:
        runner.run(todo, num_chunks)
    if run_stats is not None:
        run_stats.update(forwards=runner.extractor.forward_calls, compute_s=runner.compute_seconds,
                         write_s=runner.write_seconds, wait_s=runner.wait_seconds,
                         host_alloc_s=runner.alloc_seconds, chunks_done=len(todo), fused=fuse_report)


def _write_manifest(manifest_path: Path, name: str, common: dict, records: list[dict], rows: list[int],
                    shard_tokens: int) -> dict:
    """The shard's manifest (counts checked against the plan), written atomically; returns it.

    Raises:
        RuntimeError: the chunks' counts differ from the plan's (a bug, never bad input).
    """
    manifest = {
        "format": FEATURES_FORMAT, **common,
        "num_samples": sum(r["num_samples"] for r in records),
        "num_tokens": sum(r["num_tokens"] for r in records),
        "bytes": sum(r["bytes"] for r in records),
        "chunks": records,
        "stats": _shard_stats(records, common["hidden_size"], len(common["layer_ids"])),
    }
    if manifest["num_samples"] != len(rows) or manifest["num_tokens"] != shard_tokens:
        raise RuntimeError(f"{name}: manifest counts {manifest['num_samples']} samples / "
                           f"{manifest['num_tokens']} tokens != plan {len(rows)} / {shard_tokens}")
    write_json(manifest_path, manifest)
    log.info("%s: manifest %s: %d samples, %d tokens, %.3f GB in %d chunks; per-layer RMS %s",
             name, manifest_path, manifest["num_samples"], manifest["num_tokens"],
             manifest["bytes"] / 1e9, len(records), [round(x, 4) for x in manifest["stats"]["rms"]])
    return manifest


@dataclass
class _HostBuffer:
    """Host memory (pinned on CUDA) for one chunk's rows: features in the storage dtype ``[capacity, n*H]``,
    float8 scales ``[capacity, n]`` float32, target tokens ``[capacity]`` int32, the target's top k
    ``[capacity, k]`` int32 ids and float16 log-probs."""

    features: torch.Tensor
    scales: torch.Tensor | None
    target_token: torch.Tensor | None
    target_topk_ids: torch.Tensor | None = None
    target_topk_logprobs: torch.Tensor | None = None

    def rows(self, n: int) -> dict[str, torch.Tensor | None]:
        """The first ``n`` rows, as :func:`draftsmith.features.write_chunk` keywords."""
        return {name: None if t is None else t[:n] for name, t in vars(self).items()}


class _ShardRunner:
    """The compute/write pipeline of one shard: GPU forwards in the main thread; device-to-host copies
    on a side CUDA stream into pinned, double-buffered host memory; chunk files serialised, hashed
    and recorded by one writer thread while the next chunk computes."""

    def __init__(self, model, folder: Path, shard: int, name: str, layer_ids, tok: Tokenized, storage: str,
                 want_tt: bool, padding_mask: bool, layout: str, done: dict[int, dict], on_chunk,
                 common: dict):
        self.model, self.folder, self.shard, self.name, self.tok = model, folder, shard, name, tok
        self.layer_ids, self.n_layers = list(layer_ids), len(layer_ids)
        self.storage, self.want_tt, self.padding_mask = storage, want_tt, padding_mask
        self.layout, self.done, self.on_chunk = layout, done, on_chunk
        self.top_k = int(common.get("target_top_k", 0))
        self.meta = json.dumps({k: common[k] for k in ("shard", "layer_ids", "hidden_size", "storage_dtype",
                                                       "has_target_token", "target_top_k", "target_fingerprint")
                                if k in common})
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.buffers: list[_HostBuffer] = []
        self.write_seconds = 0.0
        self.wait_seconds = 0.0
        self.compute_seconds = 0.0
        self.alloc_seconds = 0.0

    def _host(self, capacity: int, width: int) -> _HostBuffer:
        pin = self.cuda
        return _HostBuffer(
            features=torch.empty(capacity, width, dtype=storage_torch_dtype(self.storage), pin_memory=pin),
            scales=(torch.empty(capacity, self.n_layers, dtype=torch.float32, pin_memory=pin)
                    if self.storage == "float8_e4m3fn" else None),
            target_token=torch.empty(capacity, dtype=torch.int32, pin_memory=pin) if self.want_tt else None,
            target_topk_ids=(torch.empty(capacity, self.top_k, dtype=torch.int32, pin_memory=pin)
                             if self.top_k else None),
            target_topk_logprobs=(torch.empty(capacity, self.top_k, dtype=torch.float16, pin_memory=pin)
                                  if self.top_k else None))

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
            src.record_stream(self.copy_stream)
        else:
            dst.copy_(src)

    def _check(self, absmax: torch.Tensor, hidden: torch.Tensor, batch: Batch, chunk: int) -> None:
        bad = ~torch.isfinite(absmax) | (absmax == 0)
        if not bool(bad.any()):
            return
        # the shallowest broken layer first (NaN spreads to deeper layers and later positions)
        layer_idx = int(torch.nonzero(bad.any(0))[0])
        tok_idx = int(torch.nonzero(bad[:, layer_idx])[0])
        starts = np.cumsum([0, *batch.lengths])
        s = int(np.searchsorted(starts, tok_idx, side="right") - 1)
        row = batch.rows[s]
        nonfinite = int((~torch.isfinite(hidden)).sum())
        zero_rows = int((absmax == 0).sum())
        raise FeatureSanityError(
            f"{self.name} chunk {chunk}: sample id {self.tok.ids[row]!r} (tokenized row {row}) "
            f"has bad target features at layer id {self.layer_ids[layer_idx]}, position "
            f"{tok_idx - starts[s]}: "
            f"{'non-finite' if not math.isfinite(float(absmax[tok_idx, layer_idx])) else 'all-zero row'}"
            f" (this batch: {nonfinite} non-finite values, {zero_rows} all-zero rows). The target "
            f"produced broken hidden states; refusing to store them")

    def run(self, todo: list[_ChunkWork], num_chunks: int) -> None:
        width = self.n_layers * int(text_config(self.model.config).hidden_size)
        cap = max(c.num_tokens for c in todo)
        t0 = time.perf_counter()
        self.buffers = [self._host(cap, width)] + ([self._host(cap, width)] if len(todo) > 1 else [])
        self.alloc_seconds = time.perf_counter() - t0
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-writer")
        pending: list[tuple[_ChunkWork, concurrent.futures.Future]] = []
        total = sum(c.num_tokens for c in todo)
        bar = progress(total, f"extract {self.name}", unit="tok", unit_scale=True, logger=log, interval=10)
        t0 = time.perf_counter()
        try:
            with FeatureExtractor(self.model, self.layer_ids, target_tokens=self.want_tt,
                                  padding_mask=self.padding_mask, target_topk=self.top_k) as ex:
                self.extractor = ex
                for k, chunk in enumerate(todo):
                    # the buffer of chunk k was used by chunk k-2: its write must be finished
                    while len(pending) >= len(self.buffers):
                        self._finish(*pending.pop(0))
                    buf = self.buffers[k % len(self.buffers)]
                    stats = self._compute(chunk, buf, ex, bar)
                    event = None
                    if self.cuda:
                        event = torch.cuda.Event()
                        event.record(self.copy_stream)
                    pending.append((chunk, pool.submit(self._write, chunk, buf, stats, event)))
                while pending:
                    self._finish(*pending.pop(0))
        finally:
            for _, fut in pending:  # let a started write finish (it is atomic either way)
                fut.cancel()
            pool.shutdown(wait=True)
            bar.close()
        dt = time.perf_counter() - t0
        log.info("%s: %d tokens in %.1f s = %.0f tok/s (%d forwards, compute %.1f s; writer busy "
                 "%.1f s, compute waited %.1f s on it; pinned host buffers %.1f s)", self.name, total, dt,
                 total / max(dt, 1e-9), self.extractor.forward_calls, self.compute_seconds,
                 self.write_seconds, self.wait_seconds, self.alloc_seconds)

    def _compute(self, chunk: _ChunkWork, buf: _HostBuffer, ex: FeatureExtractor, bar) -> dict:
        pos = 0
        sumsq = torch.zeros(self.n_layers, dtype=torch.float64)
        t0 = time.perf_counter()
        for batch in chunk.batches:
            samples = [self.tok.row(r)[0] for r in batch.rows]
            hidden, target_token, *topk = ex(samples)
            t = hidden.shape[0]
            absmax = row_absmax(hidden, self.n_layers)
            self._check(absmax, hidden, batch, chunk.index)
            sumsq += torch.linalg.vector_norm(hidden.view(t, self.n_layers, -1), ord=2, dim=(0, 2),
                                              dtype=torch.float32).double().cpu() ** 2
            if self.storage == "float8_e4m3fn":
                q, scales = quantize_fp8(hidden, self.n_layers, absmax)
                self._to_host(buf.features[pos:pos + t], q)
                self._to_host(buf.scales[pos:pos + t], scales)
            else:
                self._to_host(buf.features[pos:pos + t], hidden.to(storage_torch_dtype(self.storage)))
            if target_token is not None:
                self._to_host(buf.target_token[pos:pos + t], target_token)
            if topk:
                self._to_host(buf.target_topk_ids[pos:pos + t], topk[0])
                self._to_host(buf.target_topk_logprobs[pos:pos + t], topk[1])
            pos += t
            bar.update(t)
        dt = time.perf_counter() - t0
        self.compute_seconds += dt
        log.info("%s: chunk %d computed: %d samples, %d tokens in %.1f s (%.0f tok/s)", self.name,
                 chunk.index, len(chunk.rows), pos, dt, pos / max(dt, 1e-9))
        hidden_size = buf.features.shape[1] // self.n_layers
        return {"rms": [math.sqrt(float(x) / (pos * hidden_size)) for x in sumsq],
                "nonfinite": 0, "zero_rows": 0}

    def _write(self, chunk: _ChunkWork, buf: _HostBuffer, stats: dict, event) -> dict:
        """Writer thread: serialise one chunk atomically, hash it, record it in progress.json."""
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        n = chunk.num_tokens
        ids = [self.tok.row(r)[0] for r in chunk.rows]
        masks = [self.tok.row(r)[1] for r in chunk.rows]
        path = self.folder / chunk_name(chunk.index)
        digest = write_chunk(path, **buf.rows(n), lengths=[len(x) for x in ids], sample_index=chunk.rows,
                             input_ids=np.concatenate(ids), loss_mask=np.concatenate(masks),
                             storage_dtype=self.storage, metadata={"draftsmith": self.meta})
        rec = {"file": path.name, "sha256": digest, "bytes": path.stat().st_size,
               "num_samples": len(chunk.rows), "num_tokens": n, "rows": chunk.rows, "ids": chunk.ids,
               "stats": stats}
        self.done[chunk.index] = rec
        write_json(self.folder / "progress.json",
                   {"format": PROGRESS_FORMAT, "layout": self.layout,
                    "chunks": [self.done[i] for i in sorted(self.done)]})
        self.write_seconds += time.perf_counter() - t0
        return rec

    def _finish(self, chunk: _ChunkWork, fut: concurrent.futures.Future) -> None:
        t0 = time.perf_counter()
        rec = fut.result()
        self.wait_seconds += time.perf_counter() - t0
        log.info("%s: %s written (%d bytes, sha256 %s…)", self.name, rec["file"], rec["bytes"],
                 rec["sha256"][:12])
        if self.on_chunk is not None:
            self.on_chunk(chunk.index, rec)
