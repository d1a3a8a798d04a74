"""The run's data and learning rate: :func:`plan_data` applies the global batch plan
(:mod:`draftsmith.batch_plan`: held-out split, packed rows, which row every optimizer step trains on) to the
features of a run; :func:`lr_factor` is the schedule over its steps.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from draftsmith.batch_plan import BatchPlan, split_samples
from draftsmith.features import FeatureIndex
from draftsmith.train.settings import TrainOptions

log = logging.getLogger("draftsmith.train")


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warmup from ``1/warmup`` to 1 over
    ``warmup_steps`` steps, then cosine from 1 down to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainData:
    """What the features give a run: the index, the held-out split and the batch plan.

    Samples are named by their tokenized train row throughout: ``lengths[row]`` is a sample's token count,
    ``train_ids`` / ``heldout_ids`` are rows (:func:`split_samples`' split, in row order), and the plan's packed
    rows hold ``(row, tokens)`` pairs that :meth:`FeatureIndex.ref` finds. ``truncated`` counts the training samples
    longer than a packed row, ``use_target_tokens`` whether the labels are the target's own next tokens
    (``train.labels = target`` and the features carry them).
    """

    index: FeatureIndex
    lengths: Mapping[int, int]
    train_ids: list[int]
    heldout_ids: list[int]
    truncated: int
    plan: BatchPlan
    use_target_tokens: bool


def plan_data(index_path: str | os.PathLike, settings: TrainOptions, world: int) -> TrainData:
    """Open the features, split off the held-out samples and plan every step's rows for ``world`` processes
    (:class:`BatchPlan`).

    Raises:
        ValueError: too few samples for one optimizer step (named with the index path).
    """
    index = FeatureIndex(index_path)
    use_target_tokens = settings.labels == "target" and index.has_target_token
    if settings.labels == "target" and not index.has_target_token:
        log.warning("train.labels = target but the features have no target_token: training on data tokens")
    rows = [s.row for s in index.samples]
    train_ids, heldout_ids = ([rows[i] for i in part]
                              for part in split_samples(rows, settings.eval_fraction, settings.seed))
    lengths = {s.row: s.num_tokens for s in index.samples}
    row_tokens = int(settings.tokens_per_batch)
    truncated = sum(1 for i in train_ids if lengths[i] > row_tokens)
    log.info("samples: %d = %d train + %d held out; %d train samples longer than tokens_per_batch=%d are cut",
             len(index.samples), len(train_ids), len(heldout_ids), truncated, row_tokens)
    try:
        plan = BatchPlan(lengths, train_ids, row_tokens, seed=settings.seed, world=world,
                         grad_accum=settings.grad_accum, epochs=settings.epochs, max_steps=settings.max_steps)
    except ValueError as exc:
        raise ValueError(f"{index_path}: {exc}") from None
    return TrainData(index, lengths, train_ids, heldout_ids, truncated, plan, use_target_tokens)
