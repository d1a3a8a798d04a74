"""The extraction plan's format (:data:`PLAN_FORMAT`, ``results/features/plan.json`` and stream mode's per-phase
plans): which tokenized rows each shard job extracts, balanced by token count (:func:`shard_plan`), and how a plan's
subset is named (:func:`subset_label`). Written by rule extract_plan (:mod:`draftsmith.extract.plan`) and stream
mode, read by the shard jobs and merge. Importing it does not import torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PLAN_FORMAT = "draftsmith.plan/1"


def balance_shards(num_tokens: Sequence[int] | np.ndarray, num_shards: int) -> list[list[int]]:
    """Split rows into ``num_shards`` shards balanced by token count, deterministically.

    Longest-processing-time greedy: rows by tokens descending (ties by row index) each go to the shard
    with the fewest tokens so far (ties by shard index). Max shard load <= 4/3 of the optimum.

    Returns:
        Per shard, the sorted row indices (positions in ``num_tokens``).

    Raises:
        ValueError: ``num_shards`` < 1.
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


def subset_label(subset: Mapping[str, Any] | None) -> str:
    """How messages name a plan's subset: ``"phase 3"``, ``"held-out"``, or ``""`` for the whole train set.

    Raises:
        ValueError: a subset other than ``{"phase": p}`` (p >= 0) or ``{"heldout": True}``.
    """
    if subset is None:
        return ""
    given = dict(subset) if isinstance(subset, Mapping) else None
    phase = given.get("phase") if given is not None and set(given) == {"phase"} else None
    if isinstance(phase, int) and not isinstance(phase, bool) and phase >= 0:
        return f"phase {phase}"
    if given == {"heldout": True}:
        return "held-out"
    raise ValueError(f"plan subset {subset!r}: expected {{'phase': p}} (p >= 0) or {{'heldout': True}}")


def shard_plan(rows: Sequence[int], lengths: Sequence[int], num_shards: int, *, layer_ids: Sequence[int],
               hidden_size: int, num_target_layers: int, tokenized_rows: int, tokenized_tokens: int,
               subset: Mapping[str, Any] | None = None, reserve_bytes: int = 0,
               disk: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An extraction plan (:data:`PLAN_FORMAT`): ``rows`` split into ``num_shards`` shards balanced by token count
    (:func:`balance_shards` over the rows in row order).

    Without ``subset`` the plan covers every tokenized row (rule extract_plan); with one it lists only ``rows``
    (stream mode: ``{"phase": p}``, the samples phase p trains on, or ``{"heldout": True}``), and merge then
    requires exactly those rows.

    Args:
        rows: tokenized train rows to extract (distinct, any order); lengths: their token counts, aligned.
        layer_ids, hidden_size, num_target_layers: the tapped layers and the target's H and L.
        tokenized_rows, tokenized_tokens: the whole tokenized train set's (shard jobs and merge check them).
        subset: see above; reserve_bytes: the disk the rest of the run needs (:func:`draftsmith.disk.reserve_bytes`),
            which every shard job counts in its disk check.
        disk: where the rest goes and what a shard's refusal advises (``{"drafter_dir", "results_dir"}``: folders
            relative to the plan's; ``"drafter_reserve_bytes"``: the part of ``reserve_bytes`` written under
            ``drafter_dir``, checked against that file system's free bytes when it is another; ``"fit"``: the
            :func:`draftsmith.disk.disk_fit` arguments of the run, for the advice), recorded as given.

    Returns:
        ``{"format", "num_shards", "layer_ids", "hidden_size", "num_target_layers", "tokenized_rows",
        "tokenized_tokens", ["subset", "num_samples", "num_tokens" (the subset's)], "reserve_bytes", ["disk"],
        "shards": [{"shard", "rows", "num_tokens"}]}``.

    Raises:
        ValueError: rows and lengths of other lengths, duplicated rows, rows outside the tokenized set, a plan
            without subset that misses rows, an unknown subset (:func:`subset_label`).
    """
    subset_label(subset)
    if len(rows) != len(lengths):
        raise ValueError(f"shard_plan: {len(rows)} rows but {len(lengths)} lengths")
    order = sorted(range(len(rows)), key=lambda k: int(rows[k]))
    rows_sorted = [int(rows[k]) for k in order]
    tokens_sorted = [int(lengths[k]) for k in order]
    if len(set(rows_sorted)) != len(rows_sorted):
        dup = next(r for r, nxt in zip(rows_sorted, rows_sorted[1:]) if r == nxt)
        raise ValueError(f"shard_plan: row {dup} is listed twice")
    if rows_sorted and not (0 <= rows_sorted[0] and rows_sorted[-1] < tokenized_rows):
        raise ValueError(f"shard_plan: rows {rows_sorted[0]}..{rows_sorted[-1]} outside the tokenized set's "
                         f"0..{tokenized_rows - 1}")
    if subset is None and len(rows_sorted) != tokenized_rows:
        raise ValueError(f"shard_plan: a plan without subset covers all {tokenized_rows} tokenized rows, got "
                         f"{len(rows_sorted)}")
    shards = [[rows_sorted[k] for k in positions] for positions in balance_shards(tokens_sorted, num_shards)]
    row_tokens = dict(zip(rows_sorted, tokens_sorted))
    plan: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "num_shards": int(num_shards),
        "layer_ids": [int(i) for i in layer_ids],
        "hidden_size": int(hidden_size),
        "num_target_layers": int(num_target_layers),
        "tokenized_rows": int(tokenized_rows),
        "tokenized_tokens": int(tokenized_tokens),
    }
    if subset is not None:
        plan.update(subset=dict(subset), num_samples=len(rows_sorted), num_tokens=sum(tokens_sorted))
    plan["reserve_bytes"] = int(reserve_bytes)
    if disk is not None:
        plan["disk"] = dict(disk)
    plan["shards"] = [{"shard": s, "rows": shard_rows, "num_tokens": sum(row_tokens[r] for r in shard_rows)}
                      for s, shard_rows in enumerate(shards)]
    return plan
