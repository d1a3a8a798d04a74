"""stream: the global plan of a run trained in slices, and the disk checks that refuse a run before it spends GPU hours.

Two rules (docs/stream.md):

* ``stream_plan`` (stream mode, ``stream.slices`` > 1): :func:`build_stream_plan` cuts the global batch plan
  (:class:`draftsmith.batch_plan.StreamPlan`) into phases, writes one extraction plan per phase's slice and one for
  the held-out samples (the extraction plan format, ``subset`` set), and ``results/stream/plan.json`` with every
  phase's steps and the disk budget. It fails when a slice does not fit the disk.
* ``disk_plan`` (before regeneration): :func:`check_disk_before_regeneration` projects the features from the curated
  conversations (their prompt tokens plus each regenerated answer as long as the curated one: the expected size; at
  the full answer budget: an upper bound) and refuses a run whose expected size the configured mode cannot hold;
  when only the upper bound exceeds the disk it warns (the exact checks after tokenize decide).

Both measure the disk where the bytes go (:func:`draftsmith.disk.measure_room`) and name the smallest
``stream.slices`` that fits, within those ``train.max_steps`` leaves an optimizer step to every phase
(:func:`draftsmith.batch_plan.max_stream_slices`), and what fp8 storage would change (:class:`draftsmith.disk.DiskFit`).
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

from draftsmith.batch_plan import StreamPlan, heldout_subset, max_stream_slices, split_samples, steps_per_pass
from draftsmith.disk import (
    DiskSpaceError,
    DrafterSize,
    PlanDrafterOptions,
    bytes_per_token,
    disk_fit,
    measure_room,
    reserve_bytes,
)
from draftsmith.features import check_target_topk
from draftsmith.io import CURATED_PARQUET, reading, write_json
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.shard_plan import shard_plan
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
    """The ``extract`` keys: shards per slice, how features are stored, the disk headroom.

    Raises:
        ValueError: ``store_target_topk`` > 0 without ``store_target_tokens``
            (:func:`draftsmith.features.check_target_topk`).
    """

    SECTION: ClassVar[str] = "extract"
    shards: int
    storage_dtype: str
    store_target_tokens: bool
    store_target_topk: int
    disk_headroom: float

    def __post_init__(self) -> None:
        check_target_topk(self.store_target_topk, self.store_target_tokens)


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


def slices_note(passes: list[int], reuse: int, max_steps: int | None, *, estimated: bool = False) -> str:
    """How :func:`~draftsmith.batch_plan.max_stream_slices` counted: ``"about 40 optimizer steps a pass (2 passes),
    train.max_steps 60"`` (``estimated``: from projected lengths, before tokenize)."""
    steps = (f"{passes[0]}" if len(set(passes)) == 1 else f"{min(passes)}-{max(passes)}") if passes else "0"
    return (f"{'about ' if estimated or reuse > 1 else ''}{steps} optimizer steps a pass ({len(passes)} pass(es)"
            f"{f', each slice trained {reuse} times' if reuse > 1 else ''})"
            + (f", train.max_steps {max_steps}" if max_steps is not None else ""))


def _plan_error(exc: ValueError, lengths, train_rows: list[int], t: PlanTrainOptions, s: StreamOptions) -> str:
    """StreamPlan's refusal, with the largest ``stream.slices`` these data and ``train.max_steps`` allow."""
    try:
        passes = steps_per_pass(lengths, train_rows, int(t.tokens_per_batch), seed=t.seed, world=max(1, t.gpus),
                                grad_accum=t.grad_accum, epochs=t.epochs, reuse=s.reuse)
    except ValueError:
        return str(exc)
    most = max_stream_slices(passes, reuse=s.reuse, max_steps=t.max_steps)
    allowed = (f"at most {most} stream.slices give every phase an optimizer step" if most > 1 else
               "no stream.slices above 1 gives every phase an optimizer step (train offline, raise or unset "
               "train.max_steps, or lower train.epochs)")
    return f"{exc} (with {slices_note(passes, s.reuse, t.max_steps)}, {allowed})"


def build_stream_plan(tokenized_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                      settings: StreamPlanSettings, *, drafter_dir: str | os.PathLike | None = None,
                      results_dir: str | os.PathLike | None = None) -> dict[str, Any]:
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

    The disk is measured where the bytes go (:func:`draftsmith.disk.measure_room`): the slices and the held-out
    features under ``out_dir``, the reserve under ``drafter_dir`` when that is another file system; temporaries of
    dead writers under ``results_dir`` are removed first, and those that may not be are counted.

    Raises:
        DiskSpaceError: ``stream.slices_on_disk`` slices (x ``extract.disk_headroom``) + the held-out features + the
            reserve exceed the free disk; the message names the smallest ``stream.slices`` that fits (within those
            whose phases all get an optimizer step with ``train.max_steps``) and what fp8 storage would need.
        ValueError: a plan the data cannot fill (see :class:`~draftsmith.batch_plan.StreamPlan`), named with the
            largest ``stream.slices`` that gives every phase a step.
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
        raise ValueError(f"{tokenized_path}: {_plan_error(exc, lengths.tolist(), train_rows, t, s)}") from None
    expected = num_phases(t.epochs, s.slices, s.reuse)
    if len(plan.phases) != expected:  # the DAG declared its phases from the config alone
        raise ValueError(f"the plan has {len(plan.phases)} phases where train.epochs / stream.reuse x stream.slices "
                         f"gives {expected}")

    per_token = bytes_per_token(len(layer_ids), hidden, x.storage_dtype, x.store_target_tokens,
                                target_topk=x.store_target_topk)
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
    # one pass's features and what the run's slicing allows: the fit of the refusal here and of a shard's
    most = max_stream_slices(plan.steps_per_pass, reuse=s.reuse, max_steps=t.max_steps)
    pass_tokens = sum(int(lengths[list(p.samples)].sum()) for p in plan.phases if p.pass_index == 0)
    fit_args = {"num_tokens": pass_tokens, "num_samples": len(train_rows), "num_layers": len(layer_ids),
                "hidden_size": hidden, "reserve_bytes": reserve, "slices": s.slices, "slices_on_disk": s.slices_on_disk,
                "kept_bytes": held_bytes, "max_slices": most,
                "steps_note": slices_note(plan.steps_per_pass, s.reuse, t.max_steps)}
    plans_dir = out_dir / "plans"

    def disk_record(drafter_reserve: int) -> dict[str, Any]:
        return {"drafter_dir": os.path.relpath(drafter_dir, plans_dir) if drafter_dir is not None else None,
                "results_dir": os.path.relpath(results_dir, plans_dir) if results_dir is not None else None,
                "drafter_reserve_bytes": drafter_reserve, "fit": fit_args}

    phases = []
    for phase in plan.phases:
        samples = list(phase.samples)
        extraction = shard_plan(samples, lengths[samples].tolist(), x.shards, subset={"phase": phase.index},
                                reserve_bytes=slice_reserve, disk=disk_record(reserve), **common)
        tokens = int(lengths[samples].sum())
        write_json(out_dir / "plans" / f"phase-{phase.index}.json", extraction)
        phases.append({"phase": phase.index, "pass": phase.pass_index, "slice": phase.slice_index,
                       "first_step": phase.first_step, "end_step": phase.end_step, "num_samples": len(samples),
                       "tokens": tokens, "bytes": tokens * per_token})
    write_json(out_dir / "plans" / "heldout.json",
               shard_plan(held, lengths[held].tolist(), 1, subset={"heldout": True}, reserve_bytes=reserve,
                          disk=disk_record(reserve), **common))

    room = measure_room(out_dir, drafter_dir, results_dir=results_dir)
    free, separate = room.free_bytes, room.reserve_free_bytes is not None
    need = int(s.slices_on_disk * largest * x.disk_headroom) + held_bytes + (0 if separate else reserve)
    disk = {"bytes_per_token": per_token, "largest_slice_bytes": largest, "heldout_bytes": held_bytes,
            "reserve_bytes": reserve, "slices_on_disk": s.slices_on_disk, "need_bytes": need, "free_bytes": free,
            "max_slices": most}
    if separate:
        disk.update(reserve_free_bytes=room.reserve_free_bytes)
    log.info("stream plan: %d phases (%d passes x %d slices, each trained %d time(s)), %d steps; slices up to %.3g GB "
             "(%d bytes a token); held-out %d samples (%.3g GB); reserve %.3g GB; need %.3g GB of %.3g GB free under "
             "%s%s", len(phases), len(phases) // s.slices, s.slices, s.reuse, plan.total_steps, largest / 1e9,
             per_token, len(held), held_bytes / 1e9, reserve / 1e9, need / 1e9, free / 1e9, out_dir,
             f" (the reserve: {room.reserve_free_bytes / 1e9:.3g} GB free under {room.reserve_where})" if separate
             else "")
    if need > free or (separate and reserve > room.reserve_free_bytes):
        fit = disk_fit(**fit_args, storage_dtype=x.storage_dtype, target_token=x.store_target_tokens,
                       target_topk=x.store_target_topk, free_bytes=free, headroom=x.disk_headroom, where=out_dir,
                       room=room)
        reserve_text = (f" + a reserve of {reserve / 1e9:.3f} GB = {need / 1e9:.3f} GB, but only {free / 1e9:.3f} GB "
                        f"are free under {out_dir}" if not separate else
                        f" = {need / 1e9:.3f} GB with {free / 1e9:.3f} GB free under {out_dir}, and a reserve of "
                        f"{reserve / 1e9:.3f} GB with {room.reserve_free_bytes / 1e9:.3f} GB free under "
                        f"{room.reserve_where}")
        raise DiskSpaceError(
            f"stream.slices = {s.slices}: {s.slices_on_disk} slice(s) of up to {largest / 1e9:.3f} GB (x "
            f"extract.disk_headroom {x.disk_headroom}) + the held-out features {held_bytes / 1e9:.3f} GB"
            f"{reserve_text}. For one pass over the data: {fit.message()}")
    recorded = settings.to_dict()
    if not x.store_target_topk:  # added later: at 0 the plan reads as the plans of before
        del recorded["extract"]["store_target_topk"]
    doc = {
        "format": STREAM_PLAN_FORMAT, "settings": recorded, "world": max(1, t.gpus),
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
    store_target_topk: int
    disk_headroom: float


@dataclass(frozen=True)
class DiskTrainOptions(SectionSettings):
    """The ``train`` keys disk_plan reads: the checkpoints the reserve holds, and what decides the plan's steps (the
    ``stream.slices`` it advises must give every phase an optimizer step)."""

    SECTION: ClassVar[str] = "train"
    keep_checkpoints: int
    gpus: int
    seed: int
    epochs: float
    max_steps: int | None
    tokens_per_batch: int
    grad_accum: int
    eval_fraction: float


@dataclass(frozen=True)
class DiskStreamOptions(SectionSettings):
    SECTION: ClassVar[str] = "stream"
    slices: int
    slices_on_disk: int
    reuse: int
    reserve_gb: float | None
    accept_disk_risk: bool


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


@dataclass(frozen=True)
class TokenProjection:
    """What the curated conversations become once regenerated and tokenized, per tokenized row (one per conversation
    and ``regenerate.num_answers``), each at most ``tokenize.max_length`` (:func:`project_tokens`).

    Attributes:
        at_least: the non-answer text alone (system, user and tool messages, tool calls, tool schemas): answers of
            no length, no template tokens.
        expected: the non-answer text, the template's overhead per message and every regenerated answer as long as
            the curated answer it replaces (its content and reasoning), at most ``regenerate.max_new_tokens``.
        at_most: the same with every regenerated answer at the full ``regenerate.max_new_tokens``: an upper bound.
    """

    at_least: list[int]
    expected: list[int]
    at_most: list[int]

    @property
    def rows(self) -> int:
        return len(self.at_most)


def project_tokens(conversations: list[dict], tokenizer, settings: DiskPlanSettings) -> TokenProjection:
    """:class:`TokenProjection` of the curated ``conversations``.

    Per conversation: the tokens of every non-answer text up to the ``regenerate.max_turns``-th answer (tool-call
    turns are kept as they are, their calls counted as text), the template's overhead per message
    (:func:`_message_overhead`), and per regenerated answer ``regenerate.max_new_tokens`` (at most) or the curated
    answer's own tokens capped there (expected). (Templates that rewrite history get one row per answer in tokenize;
    their prefixes share the prompts, so the bound holds per row, not for their sum: :func:`build_stream_plan` and
    ``extract_plan`` check the exact count after tokenize.)
    """
    r, k = settings.regenerate, settings.tokenize
    overhead = _message_overhead(tokenizer, k.chat_template_kwargs)
    texts, answers, per_conv = [], [], []
    for conv in conversations:
        n_answers, messages, first, first_answer = 0, 0, len(texts), len(answers)
        for m in conv.get("messages") or []:
            if m.get("role") == "assistant":
                if m.get("tool_calls"):
                    texts.append(json.dumps(m["tool_calls"], ensure_ascii=False))
                else:
                    if r.max_turns is not None and n_answers >= r.max_turns:
                        break
                    n_answers += 1
                    answers.append((m.get("reasoning_content") or "") + (m.get("content") or ""))
            else:
                texts.append(m.get("content") or "")
            messages += 1
        if conv.get("tools"):
            texts.append(conv["tools"] if isinstance(conv["tools"], str) else json.dumps(conv["tools"]))
        per_conv.append((first, len(texts), first_answer, len(answers), messages, n_answers))
    counts = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    own = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]] if answers else []
    at_least, expected, at_most = [], [], []
    for first, last, a0, a1, messages, n_answers in per_conv:
        prompt = sum(counts[first:last])
        framed = prompt + overhead * messages
        for _ in range(r.num_answers):
            at_least.append(min(prompt, k.max_length))
            expected.append(min(framed + sum(min(n, r.max_new_tokens) for n in own[a0:a1]), k.max_length))
            at_most.append(min(framed + r.max_new_tokens * n_answers, k.max_length))
    return TokenProjection(at_least, expected, at_most)


def upper_bound_tokens(conversations: list[dict], tokenizer, settings: DiskPlanSettings) -> tuple[int, int]:
    """An upper bound of the tokenized train tokens the curated ``conversations`` become once regenerated:
    ``(tokens, rows)`` (:func:`project_tokens`' ``at_most``)."""
    projection = project_tokens(conversations, tokenizer, settings)
    return sum(projection.at_most), projection.rows


def _steps_limit(lengths: list[list[int]], settings: DiskPlanSettings) -> tuple[int | None, str]:
    """The largest ``stream.slices`` that gives every phase a step, for each of the projected lengths (the smallest
    of them: more tokens make more steps a pass, fewer make fewer), and how it was counted; ``(None, "")`` when the
    projected rows make no optimizer step (stream_plan says so after tokenize)."""
    t, s = settings.train, settings.stream
    most, note = None, ""
    for rows in lengths:
        train_ids, _ = split_samples(list(range(len(rows))), t.eval_fraction, t.seed)
        try:
            passes = steps_per_pass(rows, train_ids, int(t.tokens_per_batch), seed=t.seed, world=max(1, t.gpus),
                                    grad_accum=t.grad_accum, epochs=t.epochs, reuse=s.reuse)
        except ValueError:
            return None, ""
        limit = max_stream_slices(passes, reuse=s.reuse, max_steps=t.max_steps)
        if most is None or limit < most:
            most, note = limit, slices_note(passes, s.reuse, t.max_steps, estimated=True)
    return most, note


def check_disk_before_regeneration(curated_path: str | os.PathLike, target_dir: str | os.PathLike,
                                   report_path: str | os.PathLike, settings: DiskPlanSettings, *,
                                   features_dir: str | os.PathLike | None = None,
                                   drafter_dir: str | os.PathLike | None = None,
                                   results_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Refuse, before regeneration, a run whose features cannot fit the disk; write the projection to
    ``report_path`` (``draftsmith.disk-plan/1``) when they may.

    Projects the tokens (:func:`project_tokens`: at least, expected, at most) x bytes a token for the features of
    one pass (offline: all of them kept; stream mode: ``stream.slices_on_disk`` slices of ``1 / stream.slices`` of
    them at once) plus the checkpoint reserve, against the free disk where they go (:func:`draftsmith.disk.
    measure_room`: the features under ``features_dir``, the reserve under ``drafter_dir`` when another file system;
    dead writers' temporaries under ``results_dir`` removed first, the others counted). Then:

    * the expected size does not fit: refused, unless ``stream.accept_disk_risk`` (then a warning: regeneration
      runs, and extract_plan / stream_plan check the exact size after tokenize), and whatever the key when even the
      prompts alone (``at_least``) do not fit;
    * only the upper bound does not fit: a warning with both numbers; the exact checks after tokenize decide;
    * else it fits.

    The refusal names the smallest ``stream.slices`` that fits the expected size, within those whose phases all get
    an optimizer step with ``train.max_steps`` (:func:`~draftsmith.batch_plan.max_stream_slices` over the projected
    rows, counted for the expected and the upper lengths), and what fp8 storage would need.

    Args:
        features_dir: where the features go (``results/features`` offline, ``results/stream`` in stream mode);
            default the report's folder. drafter_dir: ``results/drafter`` (default: with the features).
            results_dir: the results folder swept for leftover temporaries (default none).

    Raises:
        DiskSpaceError: see above; the message gives the expected and the upper size.
    """
    import pyarrow.parquet as pq

    from draftsmith.chat import load_tokenizer
    from draftsmith.target import target_dims

    d, x, s = settings.drafter, settings.extract, settings.stream
    trust = settings.target.trust_remote_code
    with reading(curated_path, CURATED_PARQUET):
        conversations = pq.read_table(curated_path, columns=["messages", "tools"]).to_pylist()
    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust)
    projection = project_tokens(conversations, tokenizer, settings)
    rows = projection.rows
    least, expected, most = sum(projection.at_least), sum(projection.expected), sum(projection.at_most)
    num_layers, hidden, _ = target_dims(target_dir, trust_remote_code=trust)
    tapped = len(tapped_layer_ids(d.target_layer_ids, d.num_target_features, d.num_layers, num_layers))
    reserve = reserve_bytes(target_dir, DrafterSize.from_settings(d, num_taps=tapped),
                            keep_checkpoints=settings.train.keep_checkpoints, reserve_gb=s.reserve_gb,
                            trust_remote_code=trust)
    report_path = Path(report_path)
    where = Path(features_dir) if features_dir is not None else report_path.parent
    room = measure_room(where, drafter_dir, results_dir=results_dir)
    max_slices, steps = _steps_limit([projection.expected, projection.at_most], settings)

    def fit(tokens: int):
        return disk_fit(num_tokens=tokens, num_samples=rows, num_layers=tapped, hidden_size=hidden,
                        storage_dtype=x.storage_dtype, target_token=x.store_target_tokens,
                        target_topk=x.store_target_topk, free_bytes=room.free_bytes, reserve_bytes=reserve,
                        headroom=x.disk_headroom,
                        slices=s.slices, slices_on_disk=s.slices_on_disk, room=room, max_slices=max_slices,
                        steps_note=steps)

    low, mid, high = fit(least), fit(expected), fit(most)
    sizes = (f"Regenerated and tokenized, these {len(conversations)} conversations make about {expected:,} tokens "
             f"(each answer as long as its curated one, at most regenerate.max_new_tokens "
             f"{settings.regenerate.max_new_tokens}: {mid.feature_bytes / 1e9:.3f} GB of features), at most "
             f"{most:,} (every answer at that budget: {high.feature_bytes / 1e9:.3f} GB) and at least {least:,} "
             "(the prompts alone)")
    report = {"format": DISK_PLAN_FORMAT, "conversations": len(conversations), "rows_at_most": rows,
              "tokens_at_least": least, "tokens_expected": expected, "tokens_at_most": most,
              "bytes_per_token": mid.bytes_per_token, "features_bytes_expected": mid.feature_bytes,
              "features_bytes_at_most": high.feature_bytes, "slices": s.slices,
              "on_disk_bytes_expected": mid.on_disk_bytes, "on_disk_bytes_at_most": high.on_disk_bytes,
              "reserve_bytes": reserve, "need_bytes_expected": mid.needed_bytes, "need_bytes": high.needed_bytes,
              "free_bytes": room.free_bytes, "features_where": room.features_where,
              "reserve_free_bytes": room.reserve_free_bytes, "reserve_where": room.reserve_where,
              "fits": high.fits, "fits_expected": mid.fits, "accepted_risk": False,
              "min_slices": mid.min_slices, "fp8_min_slices": mid.fp8_min_slices,
              "min_slices_at_most": high.min_slices, "max_slices": max_slices}
    log.info("disk before regeneration: %s. At the expected size: %s", sizes, mid.message())
    if not mid.fits:
        if not low.fits:
            raise DiskSpaceError(
                f"{curated_path}: refused before regeneration. {sizes}; even the prompts alone do not fit as "
                f"configured (stream.accept_disk_risk cannot help). At the expected size: {mid.message()}")
        if not s.accept_disk_risk:
            raise DiskSpaceError(
                f"{curated_path}: refused before regeneration. {sizes}. At the expected size: {mid.message()} (Set "
                "stream.accept_disk_risk: true to regenerate all the same: extract_plan and stream_plan check the "
                "exact size after tokenize.)")
        report["accepted_risk"] = True
        log.warning("%s: at the expected size the features do not fit the disk, and stream.accept_disk_risk is set: "
                    "regenerating all the same; extract_plan and stream_plan check the exact size after tokenize. %s. "
                    "%s", curated_path, sizes, mid.message())
    elif not high.fits:
        log.warning("%s: at the expected size the features fit the disk, at the upper bound they do not: the exact "
                    "checks after tokenize (extract_plan, stream_plan) decide. %s. At the upper bound: %s",
                    curated_path, sizes, high.message())
    write_json(report_path, report)
    return report
