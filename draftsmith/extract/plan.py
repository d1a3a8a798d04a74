"""Rule extract_plan: the shards, balanced by token count, and the target layer ids they tap -> ``plan.json``.

Reading order: the stage's settings (:class:`ExtractPlanSettings`), the tapped layers (:func:`resolve_layer_ids`),
then :func:`build_plan`. The plan's format and its shards: :func:`draftsmith.shard_plan.shard_plan`. The disk check
(features x ``extract.disk_headroom`` plus the reserve for checkpoints and the trained drafter against the free
disk) refuses here, before any GPU work, and again in each shard job (:mod:`draftsmith.extract.shard`); the
projections live in :mod:`draftsmith.disk`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from draftsmith.disk import (
    DrafterSize,
    PlanDrafterOptions,
    disk_fit,
    measure_room,
    reserve_bytes,
)
from draftsmith.features import check_target_topk, storage_torch_dtype
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.shard_plan import shard_plan
from draftsmith.target import target_dims
from draftsmith.target_layers import num_tapped_layers, tapped_layer_ids
from draftsmith.tokenized import read_tokenized

log = logging.getLogger("draftsmith.extract")


@dataclass(frozen=True)
class PlanExtractOptions(SectionSettings):
    """The ``extract`` keys rule extract_plan reads: the shard count and what the projected bytes depend on.

    Raises:
        ValueError: a ``storage_dtype`` not in :data:`draftsmith.features.STORAGE_DTYPES`; ``store_target_topk``
            > 0 without ``store_target_tokens`` (:func:`draftsmith.features.check_target_topk`).
    """

    SECTION: ClassVar[str] = "extract"
    shards: int
    storage_dtype: str
    store_target_tokens: bool
    store_target_topk: int
    disk_headroom: float

    def __post_init__(self) -> None:
        storage_torch_dtype(self.storage_dtype)  # refuses an unknown name
        check_target_topk(self.store_target_topk, self.store_target_tokens)


@dataclass(frozen=True)
class PlanTrainOptions(SectionSettings):
    """The ``train`` key rule extract_plan reads: how many checkpoints the disk reserve holds."""

    SECTION: ClassVar[str] = "train"
    keep_checkpoints: int


@dataclass(frozen=True)
class PlanStreamOptions(SectionSettings):
    """The ``stream`` key rule extract_plan reads: ``reserve_gb`` replaces the computed disk reserve."""

    SECTION: ClassVar[str] = "stream"
    reserve_gb: float | None


@dataclass(frozen=True)
class PlanTargetOptions(SectionSettings):
    """The ``target`` keys rule extract_plan reads (it reads the target's config.json only)."""

    SECTION: ClassVar[str] = "target"
    trust_remote_code: bool


@dataclass(frozen=True)
class ExtractPlanSettings(StageSettings):
    """Everything rule extract_plan reads from the config."""

    STAGE: ClassVar[str] = "extract_plan"
    extract: PlanExtractOptions
    drafter: PlanDrafterOptions
    train: PlanTrainOptions
    stream: PlanStreamOptions
    target: PlanTargetOptions


def resolve_layer_ids(drafter: PlanDrafterOptions, num_target_layers: int) -> list[int]:
    """Target layer ids from ``drafter.target_layer_ids`` or, when null, the official formula over
    ``drafter.num_target_features`` taps (:func:`draftsmith.target_layers.tapped_layer_ids`).

    Raises:
        ValueError: an id outside 0..L-1, duplicates, or an empty list.
    """
    given = drafter.target_layer_ids
    n = num_tapped_layers(given, drafter.num_target_features, None)
    ids = tapped_layer_ids(given, drafter.num_target_features, None, num_target_layers)
    if given is None:
        log.info("target_layer_ids not configured: official default for L=%d, n=%d -> %s", num_target_layers, n, ids)
    return ids


def build_plan(tokenized_path: str | os.PathLike, target_dir: str | os.PathLike, settings: ExtractPlanSettings, *,
               features_dir: str | os.PathLike | None = None, drafter_dir: str | os.PathLike | None = None,
               results_dir: str | os.PathLike | None = None) -> dict:
    """The shard plan (``draftsmith.plan/1``, :func:`draftsmith.shard_plan.shard_plan`) of the whole tokenized train
    set into ``settings.extract.shards`` shards, with the disk reserve of the run recorded.

    Reads only ``id``/``num_tokens`` of the parquet and the target's config.json (no weights). Projects the
    features' bytes and the reserve (checkpoints, trained and exported drafter: :func:`draftsmith.disk.reserve_bytes`)
    and refuses when they do not fit: the features against the free disk where they are written (``features_dir``,
    the plan's folder), the reserve against ``drafter_dir``'s when that is another file system
    (:func:`draftsmith.disk.measure_room`; temporaries of dead writers under ``results_dir`` are removed first, those
    that may not be are counted). The plan records those folders, relative to ``features_dir``, for the shard jobs'
    own checks and advice.

    Args:
        features_dir: where the features go (rule extract_plan: ``results/features``); default the tokenized
            parquet's folder. drafter_dir: where the checkpoints and the trained drafter go (``results/drafter``);
            default with the features. results_dir: the results folder swept for leftover temporaries (default none).

    Returns:
        ``{"format", "num_shards", "layer_ids", "hidden_size", "num_target_layers", "tokenized_rows",
        "tokenized_tokens", "reserve_bytes", "disk", "shards": [{"shard", "rows", "num_tokens"}]}``.

    Raises:
        DiskSpaceError: features x ``extract.disk_headroom`` + reserve exceed the free disk; the message names the
            smallest ``stream.slices`` that fits and what float8 storage would need (:class:`draftsmith.disk.DiskFit`).
        ValueError: bad tapped layers (:func:`resolve_layer_ids`).
    """
    tok = read_tokenized(tokenized_path, with_tokens=False)
    num_shards = int(settings.extract.shards)
    num_layers, hidden, _ = target_dims(target_dir, trust_remote_code=settings.target.trust_remote_code)
    layer_ids = resolve_layer_ids(settings.drafter, num_layers)
    reserve = reserve_bytes(target_dir, DrafterSize.from_settings(settings.drafter, len(layer_ids)),
                            keep_checkpoints=settings.train.keep_checkpoints, reserve_gb=settings.stream.reserve_gb,
                            trust_remote_code=settings.target.trust_remote_code)
    if num_shards > len(tok.ids):
        log.warning("%d shards for %d rows: %d shard(s) will be empty", num_shards, len(tok.ids),
                    num_shards - len(tok.ids))
    where = Path(features_dir) if features_dir is not None else Path(tokenized_path).resolve().parent
    fit_args = {"num_tokens": int(tok.num_tokens.sum()), "num_samples": len(tok.ids), "num_layers": len(layer_ids),
                "hidden_size": hidden, "reserve_bytes": reserve}
    disk = {"drafter_dir": os.path.relpath(drafter_dir, where) if drafter_dir is not None else None,
            "results_dir": os.path.relpath(results_dir, where) if results_dir is not None else None,
            "drafter_reserve_bytes": reserve, "fit": fit_args}
    plan = shard_plan(range(len(tok.ids)), tok.num_tokens, num_shards, layer_ids=layer_ids, hidden_size=hidden,
                      num_target_layers=num_layers, tokenized_rows=len(tok.ids),
                      tokenized_tokens=int(tok.num_tokens.sum()), reserve_bytes=reserve, disk=disk)
    loads = [s["num_tokens"] for s in plan["shards"]]
    log.info("plan: %d rows, %d tokens in %d shards (tokens per shard min %d / max %d); layer ids %s",
             plan["tokenized_rows"], plan["tokenized_tokens"], num_shards, min(loads), max(loads),
             layer_ids)
    storage, want_tt = settings.extract.storage_dtype, bool(settings.extract.store_target_tokens)
    top_k = int(settings.extract.store_target_topk)
    room = measure_room(where, drafter_dir, results_dir=results_dir)
    fit = disk_fit(**fit_args, storage_dtype=storage, target_token=want_tt, target_topk=top_k,
                   free_bytes=room.free_bytes, headroom=float(settings.extract.disk_headroom), where=where, room=room)
    what = (" + target tokens" if want_tt else "") + (f" + top-{top_k}" if top_k else "")
    log.info("projected features: %.3f GB (%d bytes/token: %d layers x %d x %s%s); reserve %.3f GB; %.3f GB free "
             "under %s%s", fit.feature_bytes / 1e9, fit.bytes_per_token, len(layer_ids), hidden, storage, what,
             reserve / 1e9, fit.free_bytes / 1e9, where,
             f" ({fit.reserve_free_bytes / 1e9:.3f} GB free under {fit.reserve_where} for the reserve)"
             if fit.reserve_where else "")
    fit.check()
    return plan
