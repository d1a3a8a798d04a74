"""The batch plan: held-out split, packed rows, which row every optimizer step trains on, the learning rate.

Everything here is a pure function of the seed (no clock, no process count except the world size the plan is cut
for), so a resumed run replays the batches an uninterrupted one would see: :func:`split_samples`,
:func:`pack_rows`, :class:`BatchPlan`, :func:`seed_of` (the seeds of epochs and anchors), :func:`lr_factor`, and
:func:`plan_data`, which applies them to the features of a run.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from draftsmith.features import FeatureIndex
from draftsmith.train.settings import TrainOptions

log = logging.getLogger("draftsmith.train")


def split_samples(rows: list[int], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Held-out split: ``round(eval_fraction * n)`` samples (at least 1 when the fraction is positive and
    n >= 2), chosen by a seeded permutation of the tokenized rows.

    Args:
        rows: the tokenized train row of each sample, in index order (``SampleRef.row``). The split and
            the order of the returned lists follow the rows, not the index order, so the held-out set and
            the training order do not depend on ``extract.shards`` (the index lists samples shard by shard).

    Returns:
        ``(train, heldout)``: index positions, each list in row order; together they partition
        ``range(n)``.
    """
    num_samples = len(rows)
    n_eval = int(round(eval_fraction * num_samples))
    if eval_fraction > 0 and num_samples >= 2:
        n_eval = max(1, n_eval)
    n_eval = min(n_eval, num_samples - 1)
    by_row = sorted(range(num_samples), key=lambda i: rows[i])  # index positions in row order
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:n_eval])  # ranks in row order
    return ([by_row[r] for r in range(num_samples) if r not in held],
            [by_row[r] for r in range(num_samples) if r in held])


def pack_rows(lengths: list[int], order: list[int], capacity: int) -> list[list[tuple[int, int]]]:
    """Greedy packing in ``order``: rows of ``(sample, tokens taken)`` with at most ``capacity`` tokens.

    A sample longer than ``capacity`` is cut to ``capacity`` tokens and gets a row of its own.
    """
    rows: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    used = 0
    for s in order:
        n = min(lengths[s], capacity)
        if cur and used + n > capacity:
            rows.append(cur)
            cur, used = [], 0
        cur.append((s, n))
        used += n
    if cur:
        rows.append(cur)
    return rows


def seed_of(*parts: Any) -> int:
    """A 63-bit seed from a tuple (stable across processes and Python versions)."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


class BatchPlan:
    """Which packed row every (optimizer step, micro-batch, rank) trains on: a pure function of the seed.

    Epoch ``e`` shuffles ``train_ids`` with a generator seeded by ``(seed, e)`` and packs them with
    :func:`pack_rows`; since the number of rows depends on the order, every epoch has its own step count
    ``len(rows_e) // (world * grad_accum)`` (the leftover rows of an epoch are skipped, counted in
    :attr:`skipped_rows`). Step ``s`` of epoch ``e`` gives rank ``r`` micro-batch ``m`` row
    ``(s_e * grad_accum + m) * world + r``.

    ``epochs`` may be fractional (the last epoch is cut to ``ceil(frac * steps)``); ``max_steps`` overrides it.

    Raises:
        ValueError: an epoch has fewer rows than one optimizer step needs.
    """

    def __init__(self, lengths: list[int], train_ids: list[int], capacity: int, *, seed: int, world: int,
                 grad_accum: int, epochs: float, max_steps: int | None = None):
        self.lengths, self.train_ids, self.capacity = lengths, list(train_ids), capacity
        self.seed, self.world, self.grad_accum = seed, world, grad_accum
        self.per_step = world * grad_accum
        self._rows: dict[int, list] = {}
        self.steps_per_epoch: list[int] = []
        self.skipped_rows = 0
        total, e = 0, 0
        target = max_steps if max_steps else None
        while True:
            n = self._count(e)
            if n < 1:
                raise ValueError(f"{len(self.train_ids)} training samples pack into {len(self.rows(e))} rows of "
                                 f"{capacity} tokens, fewer than one optimizer step needs ({world} processes x "
                                 f"{grad_accum} micro-batches); lower train.tokens_per_batch or grad_accum")
            if target is None:
                whole = int(math.floor(epochs))
                if e >= whole:
                    frac = epochs - whole
                    if frac > 0:
                        self.steps_per_epoch.append(max(1, math.ceil(frac * n)))
                    break
            elif total + n >= target:
                self.steps_per_epoch.append(target - total)
                break
            self.steps_per_epoch.append(n)
            self.skipped_rows += len(self.rows(e)) - n * self.per_step
            total += n
            e += 1
        if not self.steps_per_epoch:
            self.steps_per_epoch.append(max(1, self._count(0)))
        self.total_steps = sum(self.steps_per_epoch)
        self._starts = [sum(self.steps_per_epoch[:i]) for i in range(len(self.steps_per_epoch))]

    def _count(self, epoch: int) -> int:
        return len(self.rows(epoch)) // self.per_step

    def rows(self, epoch: int) -> list[list[tuple[int, int]]]:
        """Packed rows of ``epoch`` (cached for the last two epochs asked for)."""
        if epoch not in self._rows:
            if len(self._rows) >= 2:
                self._rows.pop(next(iter(self._rows)))
            g = torch.Generator().manual_seed(seed_of(self.seed, "epoch", epoch))
            order = [self.train_ids[i] for i in torch.randperm(len(self.train_ids), generator=g).tolist()]
            self._rows[epoch] = pack_rows(self.lengths, order, self.capacity)
        return self._rows[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, step within the epoch)`` of global optimizer step ``step``."""
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} outside 0..{self.total_steps - 1}")
        e = max(i for i, s0 in enumerate(self._starts) if s0 <= step)
        return e, step - self._starts[e]

    def items(self, first: int, last: int, rank: int) -> Iterator[tuple[int, int, int]]:
        """``(step, epoch, row index)`` of every micro-batch of ``rank`` for steps ``first .. last - 1``."""
        for step in range(first, last):
            epoch, i = self.locate(step)
            for m in range(self.grad_accum):
                yield step, epoch, (i * self.grad_accum + m) * self.world + rank


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

    ``lengths`` are the samples' token counts (index order), ``train_ids`` / ``heldout_ids`` index positions
    (:func:`split_samples`), ``truncated`` the training samples longer than a row, ``use_target_tokens`` whether the
    labels are the target's own next tokens (``train.labels = target`` and the features carry them).
    """

    index: FeatureIndex
    lengths: list[int]
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
    train_ids, heldout_ids = split_samples([s.row for s in index.samples], settings.eval_fraction, settings.seed)
    lengths = [s.num_tokens for s in index.samples]
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
