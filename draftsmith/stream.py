"""stream: the global plan of a run trained in slices, and the disk checks that refuse a run before it spends GPU hours.

Two rules (docs/stream.md):

* ``stream_plan`` (stream mode, ``stream.slices`` > 1): :func:`build_stream_plan` cuts the global batch plan
  (:class:`draftsmith.batch_plan.StreamPlan`) into phases, writes one extraction plan per phase's slice and one for
  the held-out samples (the extraction plan format, ``subset`` set), and ``results/stream/plan.json`` with every
  phase's steps and the disk budget. It fails when a slice does not fit the disk.
* ``disk_plan`` (before regeneration): :func:`check_disk_before_regeneration` projects an upper bound of the features
  from the curated conversations (their prompt tokens plus the answer budget of every regenerated turn) and refuses
  a run that neither the offline mode nor the configured slicing can hold.

Both name the smallest ``stream.slices`` that fits and what fp8 storage would change
(:func:`draftsmith.disk.fits_message`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from draftsmith.batch_plan import StreamPlan, heldout_subset, split_samples
from draftsmith.disk import (
    DiskSpaceError,
    DrafterSize,
    PlanDrafterOptions,
    bytes_per_token,
    disk_fit,
    free_disk_bytes,
    reserve_bytes,
)
from draftsmith.features import shard_plan
from draftsmith.io import CURATED_PARQUET, reading, write_json
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.stages import num_phases
from draftsmith.target_layers import tapped_layer_ids
from draftsmith.tokenized import read_tokenized

log = logging.getLogger("draftsmith.stream")

STREAM_PLAN_FORMAT = "draftsmith.stream-plan/1"
DISK_PLAN_FORMAT = "draftsmith.disk-plan/1"


# --------------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class StreamOptions(SectionSettings):
    """The ``stream`` section: slices per pass, trainings per slice, kept held-out samples (output keys); slices on
    disk at once and the disk reserve (runtime)."""

    SECTION: ClassVar[str] = "stream"
    slices: int
    reuse: int
    heldout_samples: int
    slices_on_disk: int
    reserve_gb: float | None


@dataclass(frozen=True)
class PlanTrainOptions(SectionSettings):
    """The ``train`` keys that decide the plan's rows and steps, and how many checkpoints the disk must hold."""

    SECTION: ClassVar[str] = "train"
    gpus: int
    seed: int
    epochs: float
    max_steps: int | None
    tokens_per_batch: int
    grad_accum: int
    eval_fraction: float
    keep_checkpoints: int


@dataclass(frozen=True)
class PlanExtractOptions(SectionSettings):
    """The ``extract`` keys: shards per slice, how features are stored, the disk headroom."""

    SECTION: ClassVar[str] = "extract"
    shards: int
    storage_dtype: str
    store_target_tokens: bool
    disk_headroom: float


@dataclass(frozen=True)
class PlanTargetOptions(SectionSettings):
    SECTION: ClassVar[str] = "target"
    trust_remote_code: bool


@dataclass(frozen=True)
class StreamPlanSettings(StageSettings):
    """Everything rule ``stream_plan`` reads (STAGE_KEYS["stream_plan"])."""

    STAGE: ClassVar[str] = "stream_plan"
    stream: StreamOptions
    train: PlanTrainOptions
    extract: PlanExtractOptions
    drafter: PlanDrafterOptions
    target: PlanTargetOptions


# --------------------------------------------------------------------------------------------------
# stream_plan


def _lengths_digest(num_tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(num_tokens, dtype=np.int64).tobytes()).hexdigest()


def build_stream_plan(tokenized_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                      settings: StreamPlanSettings) -> dict[str, Any]:
    """Plan a stream-mode run and write ``<out_dir>/plan.json``, ``<out_dir>/plans/phase-{p}.json`` and
    ``<out_dir>/plans/heldout.json`` (each atomically).

    The phases are :class:`~draftsmith.batch_plan.StreamPlan`'s over the tokenized train rows that
    :func:`~draftsmith.batch_plan.split_samples` does not hold out, for ``train.gpus`` processes; the held-out
    samples kept are :func:`~draftsmith.batch_plan.heldout_subset`'s. Each phase's extraction plan splits its slice
    into ``extract.shards`` shards.

    Returns:
        The plan (``draftsmith.stream-plan/1``): ``phases`` (phase, pass, slice, first_step, end_step,
        num_samples, tokens, bytes; the slice's rows are in its extraction plan), ``total_steps``, ``heldout``
        (samples, tokens), ``disk`` (bytes per token, the largest slice, the held-out features, reserve, free,
        need), the settings it was made with and a digest of the row lengths.

    Raises:
        DiskSpaceError: ``stream.slices_on_disk`` slices (x ``extract.disk_headroom``) + the held-out features + the
            reserve exceed the free disk under ``out_dir``; the message names the smallest ``stream.slices`` that
            fits and what fp8 storage would need.
        ValueError: a plan the data cannot fill (see :class:`~draftsmith.batch_plan.StreamPlan`), named.
    """
    from draftsmith.target import target_dims

    out_dir = Path(out_dir)
    s, t, x, d = settings.stream, settings.train, settings.extract, settings.drafter
    tok = read_tokenized(tokenized_path, with_tokens=False)
    lengths = tok.num_tokens
    num_layers, hidden, _ = target_dims(target_dir, trust_remote_code=settings.target.trust_remote_code)
    layer_ids = tapped_layer_ids(d.target_layer_ids, d.num_target_features, d.num_layers, num_layers)
    rows = list(range(len(tok.ids)))
    train_rows, held = split_samples(rows, t.eval_fraction, t.seed)
    held = heldout_subset(held, s.heldout_samples, t.seed)
    try:
        plan = StreamPlan(lengths.tolist(), train_rows, int(t.tokens_per_batch), seed=t.seed, world=max(1, t.gpus),
                          grad_accum=t.grad_accum, epochs=t.epochs, max_steps=t.max_steps, slices=s.slices,
                          reuse=s.reuse)
    except ValueError as exc:
        raise ValueError(f"{tokenized_path}: {exc}") from None
    expected = num_phases(t.epochs, s.slices, s.reuse)
    if len(plan.phases) != expected:  # the DAG declared its phases from the config alone
        raise ValueError(f"the plan has {len(plan.phases)} phases where train.epochs / stream.reuse x stream.slices "
                         f"gives {expected}")

    per_token = bytes_per_token(len(layer_ids), hidden, x.storage_dtype, x.store_target_tokens)
    trust = settings.target.trust_remote_code
    reserve = reserve_bytes(target_dir, DrafterSize.from_settings(d, num_taps=len(layer_ids)),
                            keep_checkpoints=t.keep_checkpoints, reserve_gb=s.reserve_gb, trust_remote_code=trust)
    held_tokens = int(lengths[held].sum()) if held else 0
    held_bytes = held_tokens * per_token
    largest = max(int(lengths[list(p.samples)].sum()) for p in plan.phases) * per_token
    # what a slice's shards must leave free beside their own bytes: the reserve, the kept held-out features and the
    # other slices on disk at once (each shard's own check counts its slice, draftsmith.extract)
    slice_reserve = reserve + held_bytes + int((s.slices_on_disk - 1) * largest * x.disk_headroom)
    common = dict(layer_ids=layer_ids, hidden_size=hidden, num_target_layers=num_layers,
                  tokenized_rows=len(rows), tokenized_tokens=int(lengths.sum()))
    phases = []
    for phase in plan.phases:
        samples = list(phase.samples)
        extraction = shard_plan(samples, lengths[samples].tolist(), x.shards, subset={"phase": phase.index},
                                reserve_bytes=slice_reserve, **common)
        tokens = int(lengths[samples].sum())
        write_json(out_dir / "plans" / f"phase-{phase.index}.json", extraction)
        phases.append({"phase": phase.index, "pass": phase.pass_index, "slice": phase.slice_index,
                       "first_step": phase.first_step, "end_step": phase.end_step, "num_samples": len(samples),
                       "tokens": tokens, "bytes": tokens * per_token})
    write_json(out_dir / "plans" / "heldout.json",
               shard_plan(held, lengths[held].tolist(), 1, subset={"heldout": True}, reserve_bytes=reserve, **common))

    free = free_disk_bytes(out_dir)
    need = int(s.slices_on_disk * largest * x.disk_headroom) + held_bytes + reserve
    disk = {"bytes_per_token": per_token, "largest_slice_bytes": largest, "heldout_bytes": held_bytes,
            "reserve_bytes": reserve, "slices_on_disk": s.slices_on_disk, "need_bytes": need, "free_bytes": free}
    log.info("stream plan: %d phases (%d passes x %d slices, each trained %d time(s)), %d steps; slices up to %.3g GB "
             "(%d bytes a token); held-out %d samples (%.3g GB); reserve %.3g GB; need %.3g GB of %.3g GB free",
             len(phases), len(phases) // s.slices, s.slices, s.reuse, plan.total_steps, largest / 1e9, per_token,
             len(held), held_bytes / 1e9, reserve / 1e9, need / 1e9, free / 1e9)
    if need > free:
        pass_tokens = sum(int(lengths[list(p.samples)].sum()) for p in plan.phases if p.pass_index == 0)
        fit = disk_fit(num_tokens=pass_tokens, num_samples=len(train_rows), num_layers=len(layer_ids),
                       hidden_size=hidden, storage_dtype=x.storage_dtype, target_token=x.store_target_tokens,
                       free_bytes=free, reserve_bytes=reserve, headroom=x.disk_headroom, slices=s.slices,
                       slices_on_disk=s.slices_on_disk, kept_bytes=held_bytes, where=out_dir)
        raise DiskSpaceError(
            f"stream.slices = {s.slices}: {s.slices_on_disk} slice(s) of up to {largest / 1e9:.3f} GB (x "
            f"extract.disk_headroom {x.disk_headroom}) + the held-out features {held_bytes / 1e9:.3f} GB + a reserve "
            f"of {reserve / 1e9:.3f} GB = {need / 1e9:.3f} GB, but only {free / 1e9:.3f} GB are free under {out_dir}. "
            f"For one pass over the data: {fit.message()}")
    doc = {
        "format": STREAM_PLAN_FORMAT, "settings": settings.to_dict(), "world": max(1, t.gpus),
        "lengths_sha256": _lengths_digest(lengths), "tokenized_rows": len(rows),
        "train_samples": len(train_rows), "total_steps": plan.total_steps, "layer_ids": layer_ids,
        "phases": phases, "heldout": {"samples": len(held), "tokens": held_tokens},
        "disk": disk,
    }
    write_json(out_dir / "plan.json", doc)
    return doc


# --------------------------------------------------------------------------------------------------
# disk_plan: before regeneration


@dataclass(frozen=True)
class DiskRegenerateOptions(SectionSettings):
    SECTION: ClassVar[str] = "regenerate"
    max_new_tokens: int
    max_turns: int | None
    num_answers: int


@dataclass(frozen=True)
class DiskTokenizeOptions(SectionSettings):
    SECTION: ClassVar[str] = "tokenize"
    max_length: int
    chat_template_kwargs: Any


@dataclass(frozen=True)
class DiskExtractOptions(SectionSettings):
    SECTION: ClassVar[str] = "extract"
    storage_dtype: str
    store_target_tokens: bool
    disk_headroom: float


@dataclass(frozen=True)
class DiskTrainOptions(SectionSettings):
    SECTION: ClassVar[str] = "train"
    keep_checkpoints: int


@dataclass(frozen=True)
class DiskStreamOptions(SectionSettings):
    SECTION: ClassVar[str] = "stream"
    slices: int
    slices_on_disk: int
    reserve_gb: float | None


@dataclass(frozen=True)
class DiskPlanSettings(StageSettings):
    """Everything rule ``disk_plan`` reads (STAGE_KEYS["disk_plan"]; all runtime: it checks, it never reruns)."""

    STAGE: ClassVar[str] = "disk_plan"
    regenerate: DiskRegenerateOptions
    tokenize: DiskTokenizeOptions
    extract: DiskExtractOptions
    drafter: PlanDrafterOptions  # the keys extract_plan and stream_plan read to size the reserve
    train: DiskTrainOptions
    stream: DiskStreamOptions
    target: PlanTargetOptions


def _message_overhead(tokenizer, chat_template_kwargs: dict) -> int:
    """Tokens the chat template adds around one message, at most: a probe conversation of empty messages rendered,
    divided by its messages, plus a margin (role markers, separators, the end-of-turn token)."""
    from draftsmith.chat import render_text

    probe = [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    try:
        text = render_text(tokenizer, probe, None, dict(chat_template_kwargs), add_generation_prompt=False)
    except Exception:  # a template that refuses a system message or empty content: a generous fixed overhead
        return 32
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) // len(probe) + 8


def upper_bound_tokens(conversations: list[dict], tokenizer, settings: DiskPlanSettings) -> tuple[int, int]:
    """An upper bound of the tokenized train tokens the curated ``conversations`` become once regenerated:
    ``(tokens, rows)``.

    Per conversation: the tokens of every non-answer text (system, user and tool messages, tool calls, the tools'
    JSON schemas) up to the ``regenerate.max_turns``-th answer, the template's overhead per message
    (:func:`_message_overhead`), and ``regenerate.max_new_tokens`` for every regenerated answer; at most
    ``tokenize.max_length`` per row, ``regenerate.num_answers`` rows per conversation. (Templates that rewrite
    history get one row per answer in tokenize; their prefixes share the prompts, so this bound holds per row, not
    for their sum: :func:`build_stream_plan` and ``extract_plan`` check the exact count after tokenize.)
    """
    r, k = settings.regenerate, settings.tokenize
    overhead = _message_overhead(tokenizer, k.chat_template_kwargs)
    texts, per_conv = [], []
    for conv in conversations:
        answers, messages, first = 0, 0, len(texts)
        for m in conv.get("messages") or []:
            if m.get("role") == "assistant":
                if m.get("tool_calls"):
                    texts.append(json.dumps(m["tool_calls"], ensure_ascii=False))
                else:
                    if r.max_turns is not None and answers >= r.max_turns:
                        break
                    answers += 1
            else:
                texts.append(m.get("content") or "")
            messages += 1
        if conv.get("tools"):
            texts.append(conv["tools"] if isinstance(conv["tools"], str) else json.dumps(conv["tools"]))
        per_conv.append((first, len(texts), messages, answers))
    counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    total = rows = 0
    for first, last, messages, answers in per_conv:
        bound = sum(counts[first:last]) + overhead * messages + r.max_new_tokens * answers
        total += min(bound, k.max_length) * r.num_answers
        rows += r.num_answers
    return total, rows


def check_disk_before_regeneration(curated_path: str | os.PathLike, target_dir: str | os.PathLike,
                                   report_path: str | os.PathLike, settings: DiskPlanSettings) -> dict[str, Any]:
    """Refuse, before regeneration, a run whose features cannot fit the disk; write the projection to
    ``report_path`` (``draftsmith.disk-plan/1``) when they can.

    Projects :func:`upper_bound_tokens` x bytes a token for the features of every pass (offline: all of them kept;
    stream mode: ``stream.slices_on_disk`` slices of ``1 / stream.slices`` of them at once) plus the checkpoint
    reserve, against the free disk under the report's folder.

    Raises:
        DiskSpaceError: the configured mode cannot hold it; names the smallest ``stream.slices`` that fits and what
            fp8 storage would need.
    """
    import pyarrow.parquet as pq

    from draftsmith.chat import load_tokenizer
    from draftsmith.target import target_dims

    d, x, s = settings.drafter, settings.extract, settings.stream
    trust = settings.target.trust_remote_code
    with reading(curated_path, CURATED_PARQUET):
        conversations = pq.read_table(curated_path, columns=["messages", "tools"]).to_pylist()
    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust)
    tokens, rows = upper_bound_tokens(conversations, tokenizer, settings)
    num_layers, hidden, _ = target_dims(target_dir, trust_remote_code=trust)
    tapped = len(tapped_layer_ids(d.target_layer_ids, d.num_target_features, d.num_layers, num_layers))
    reserve = reserve_bytes(target_dir, DrafterSize.from_settings(d, num_taps=tapped),
                            keep_checkpoints=settings.train.keep_checkpoints, reserve_gb=s.reserve_gb,
                            trust_remote_code=trust)
    report_path = Path(report_path)
    fit = disk_fit(num_tokens=tokens, num_samples=rows, num_layers=tapped, hidden_size=hidden,
                   storage_dtype=x.storage_dtype, target_token=x.store_target_tokens,
                   free_bytes=free_disk_bytes(report_path.parent), reserve_bytes=reserve, headroom=x.disk_headroom,
                   slices=s.slices, slices_on_disk=s.slices_on_disk, where=report_path.parent)
    report = {"format": DISK_PLAN_FORMAT, "conversations": len(conversations), "rows_at_most": rows,
              "tokens_at_most": tokens, "bytes_per_token": fit.bytes_per_token,
              "features_bytes_at_most": fit.feature_bytes, "slices": s.slices,
              "on_disk_bytes_at_most": fit.on_disk_bytes,
              "reserve_bytes": reserve, "need_bytes": fit.needed_bytes, "free_bytes": fit.free_bytes,
              "fits": fit.fits, "min_slices": fit.min_slices, "fp8_min_slices": fit.fp8_min_slices}
    log.info("disk before regeneration: at most %d tokens in %d rows from %d conversations: %s", tokens, rows,
             len(conversations), fit.message())
    if not fit.fits:
        raise DiskSpaceError(
            f"{curated_path}: refused before regeneration. Regenerated and tokenized, these {len(conversations)} "
            f"conversations make at most {tokens:,} tokens: {fit.message()}")
    write_json(report_path, report)
    return report
