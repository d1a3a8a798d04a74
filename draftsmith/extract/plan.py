"""Rule extract_plan: the shards, balanced by token count, and the target layer ids they tap -> ``plan.json``.

Reading order: the stage's settings (:class:`ExtractPlanSettings`), the tapped layers (:func:`resolve_layer_ids`),
the shards (:func:`balance_shards`), then :func:`build_plan`. The projected bytes of the features
(:func:`projected_bytes`, :func:`free_disk_bytes`) are logged here and enforced by each shard job
(:mod:`draftsmith.extract.shard`). The plan's format: :data:`draftsmith.features.PLAN_FORMAT`.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from draftsmith.features import PLAN_FORMAT, storage_torch_dtype
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.target import check_model_folder, text_config
from draftsmith.target_layers import num_tapped_layers, tapped_layer_ids
from draftsmith.tokenized import read_tokenized

log = logging.getLogger("draftsmith.extract")


@dataclass(frozen=True)
class PlanExtractOptions(SectionSettings):
    """The ``extract`` keys rule extract_plan reads: the shard count and what the projected bytes depend on.

    Raises:
        ValueError: a ``storage_dtype`` not in :data:`draftsmith.features.STORAGE_DTYPES`.
    """

    SECTION: ClassVar[str] = "extract"
    shards: int
    storage_dtype: str
    store_target_tokens: bool

    def __post_init__(self) -> None:
        storage_torch_dtype(self.storage_dtype)  # refuses an unknown name


@dataclass(frozen=True)
class PlanDrafterOptions(SectionSettings):
    """The ``drafter`` keys that decide the tapped layers (:func:`resolve_layer_ids`).

    ``num_target_features`` holds the effective count: with neither it nor ``target_layer_ids`` set,
    :meth:`from_mapping` takes it from ``drafter.num_layers`` (:func:`draftsmith.target_layers.num_tapped_layers`),
    the value the workflow passes as the rule's param (:mod:`draftsmith.stages`).
    """

    SECTION: ClassVar[str] = "drafter"
    target_layer_ids: tuple[int, ...] | None
    num_target_features: int | None

    @classmethod
    def from_mapping(cls, values: Any = None, **overrides: Any) -> PlanDrafterOptions:
        given = {**(values or {}), **overrides}
        if given.get("target_layer_ids") is None and given.get("num_target_features") is None:
            given["num_target_features"] = num_tapped_layers(None, None, given.get("num_layers"))
        return super().from_mapping(given)


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


def balance_shards(num_tokens: list[int] | np.ndarray, num_shards: int) -> list[list[int]]:
    """Split rows into ``num_shards`` shards balanced by token count, deterministically.

    Longest-processing-time greedy: rows by tokens descending (ties by row index) each go to the shard
    with the fewest tokens so far (ties by shard index). Max shard load <= 4/3 of the optimum.

    Returns:
        Per shard, the sorted row indices.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    order = sorted(range(len(num_tokens)), key=lambda r: (-int(num_tokens[r]), r))
    heap = [(0, s) for s in range(num_shards)]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for r in order:
        load, s = heapq.heappop(heap)
        shards[s].append(r)
        heapq.heappush(heap, (load + int(num_tokens[r]), s))
    return [sorted(rows) for rows in shards]


def target_dims(target_dir: str | os.PathLike, *, trust_remote_code: bool = False) -> tuple[int, int, int]:
    """``(num_target_layers L, hidden_size H, vocab_size V)`` from the target's config.json only."""
    from transformers import AutoConfig

    folder = check_model_folder(target_dir)
    cfg = text_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))
    return int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.vocab_size)


def build_plan(tokenized_path: str | os.PathLike, target_dir: str | os.PathLike,
               settings: ExtractPlanSettings) -> dict:
    """The shard plan (``draftsmith.plan/1``) of a tokenized train set into ``settings.extract.shards`` shards.

    Reads only ``id``/``num_tokens`` of the parquet and the target's config.json (no weights). It also
    logs the projected bytes of all shards (the shard jobs enforce the disk check) and warns when they
    exceed the free disk under ``results/``.

    Returns:
        ``{"format", "num_shards", "layer_ids", "hidden_size", "num_target_layers",
        "tokenized_rows", "tokenized_tokens", "shards": [{"shard", "rows", "num_tokens"}]}``.
    """
    tok = read_tokenized(tokenized_path, with_tokens=False)
    num_shards = int(settings.extract.shards)
    num_layers, hidden, _ = target_dims(target_dir, trust_remote_code=settings.target.trust_remote_code)
    layer_ids = resolve_layer_ids(settings.drafter, num_layers)
    shards = balance_shards(tok.num_tokens, num_shards)
    if num_shards > len(tok.ids):
        log.warning("%d shards for %d rows: %d shard(s) will be empty", num_shards, len(tok.ids),
                    num_shards - len(tok.ids))
    plan = {
        "format": PLAN_FORMAT,
        "num_shards": num_shards,
        "layer_ids": layer_ids,
        "hidden_size": hidden,
        "num_target_layers": num_layers,
        "tokenized_rows": len(tok.ids),
        "tokenized_tokens": int(tok.num_tokens.sum()),
        "shards": [{"shard": s, "rows": rows, "num_tokens": int(tok.num_tokens[rows].sum()) if rows else 0}
                   for s, rows in enumerate(shards)],
    }
    loads = [s["num_tokens"] for s in plan["shards"]]
    log.info("plan: %d rows, %d tokens in %d shards (tokens per shard min %d / max %d); layer ids %s",
             plan["tokenized_rows"], plan["tokenized_tokens"], num_shards, min(loads), max(loads),
             layer_ids)
    storage, want_tt = settings.extract.storage_dtype, bool(settings.extract.store_target_tokens)
    total = projected_bytes(plan["tokenized_tokens"], plan["tokenized_rows"], len(layer_ids), hidden, storage,
                            want_tt)
    free = free_disk_bytes(Path(tokenized_path).resolve().parent)
    log.info("projected features: %.3f GB (%d bytes/token: %d layers x %d x %s%s); %.3f GB free",
             total / 1e9, bytes_per_token(len(layer_ids), hidden, storage, want_tt), len(layer_ids),
             hidden, storage, " + target tokens" if want_tt else "", free / 1e9)
    if total > free:
        log.warning("the projected features (%.3f GB) exceed the free disk (%.3f GB): shard jobs "
                    "will refuse to start once their share does not fit", total / 1e9, free / 1e9)
    return plan


def bytes_per_token(num_layers: int, hidden: int, storage_dtype: str, target_token: bool) -> int:
    """Bytes one token costs in a chunk file: features (+ fp8 scales) + input id + loss mask
    (+ target token). Example: 5 layers x 5120 in bf16 with target tokens = 51,209 bytes."""
    elem = torch.empty((), dtype=storage_torch_dtype(storage_dtype)).element_size()
    extra = 4 * num_layers if storage_dtype == "float8_e4m3fn" else 0
    return num_layers * hidden * elem + extra + 4 + 1 + (4 if target_token else 0)


def projected_bytes(num_tokens: int, num_samples: int, num_layers: int, hidden: int,
                    storage_dtype: str, target_token: bool, num_chunks: int = 1) -> int:
    """Projected chunk bytes: tokens x :func:`bytes_per_token` + 16 bytes per sample (offsets,
    sample_index) + ~1 KB of safetensors header per chunk."""
    return (num_tokens * bytes_per_token(num_layers, hidden, storage_dtype, target_token)
            + 16 * num_samples + 8 * num_chunks + 1024 * num_chunks)


def free_disk_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free
