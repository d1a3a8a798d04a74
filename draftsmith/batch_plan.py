"""The global batch plan: which tokenized rows every optimizer step trains on, and how a run is cut into phases.

A pure function of the seed, the samples' lengths and a few ``train`` / ``stream`` settings (no clock, no process
count except the world size the plan is cut for), so a resumed run replays the batches an uninterrupted one would
see, and a run cut into phases trains exactly what one uninterrupted run would.

* :func:`split_samples` (the held-out split), :func:`pack_rows` (greedy packing into rows of at most
  ``train.tokens_per_batch`` tokens), :func:`seed_of` (the seeds of epochs and anchors);
* :class:`BatchPlan`: the offline plan (every feature on disk for the whole run), epoch by epoch;
* :class:`StreamPlan`: the same plan cut into **phases**, each training one **slice** of the data that is extracted
  before the phase and deleted after it (``stream.slices`` slices per pass over the data, each trained
  ``stream.reuse`` times). ``reuse: 1`` is :class:`BatchPlan` cut into step ranges; one slice trained
  ``train.epochs`` times is :class:`BatchPlan` too (tested). Design and measurements: ``docs/stream.md``.

Samples are named by their *key*: the trainer uses tokenized train rows; any list of distinct integers works.
Importing this module imports torch (its seeded permutations are torch's) but nothing of the workflow.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch


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

    def anchor_seed(self, epoch: int, row: int) -> int:
        """The seed of the anchors of row ``row`` of ``epoch``'s packing."""
        return seed_of(self.seed, "anchors", epoch, row)

    def items(self, first: int, last: int, rank: int) -> Iterator[tuple[int, int, int]]:
        """``(step, epoch, row index)`` of every micro-batch of ``rank`` for steps ``first .. last - 1``."""
        for step in range(first, last):
            epoch, i = self.locate(step)
            for m in range(self.grad_accum):
                yield step, epoch, (i * self.grad_accum + m) * self.world + rank


@dataclass(frozen=True)
class Phase:
    """One phase of a :class:`StreamPlan`: optimizer steps ``[first_step, end_step)``, trained on one slice.

    Attributes:
        index: the phase number p (0-based; phases run in order).
        pass_index: the pass over the data x it belongs to (``epochs / reuse`` passes).
        slice_index: the slice k of that pass (``stream.slices`` slices per pass).
        first_step, end_step: the global optimizer steps it trains.
        samples: the keys of the samples its steps read, sorted: exactly what must be extracted for this phase
            (a subset of its slice: samples that land in rows skipped at the end of every packing are not read).
    """

    index: int
    pass_index: int
    slice_index: int
    first_step: int
    end_step: int
    samples: tuple[int, ...]

    @property
    def steps(self) -> int:
        return self.end_step - self.first_step


@dataclass(frozen=True)
class _Segment:
    """``steps`` consecutive optimizer steps from global step ``start`` that read the packed rows of ``key`` from
    row ``row_offset`` on (``key`` = ``(epoch, slice)``, slice ``None`` for a whole pass's packing)."""

    key: tuple[int, int | None]
    row_offset: int
    steps: int
    start: int


def _cut(steps: int, parts: int) -> list[int]:
    """Boundaries ``[0, ..., steps]`` of ``parts`` contiguous ranges as equal as possible (the first ones longer)."""
    q, r = divmod(steps, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return bounds


class StreamPlan:
    """The global plan of a run cut into phases: which packed row every (step, micro-batch, rank) trains on, and
    which samples each phase's slice holds.

    With ``reuse`` R and ``slices`` S, the run makes ``X = ceil(epochs / R)`` passes over the training samples and
    ``X * S`` phases; phase ``p = x * S + k`` trains slice k of pass x R times before the slice is deleted:

    * **R = 1**: exactly :class:`BatchPlan` (same rows, same steps, same anchor seeds); each epoch's steps are cut
      into S contiguous step ranges and slice k holds the samples of the rows of its steps.
    * **R > 1** (``epochs`` a multiple of R): pass x packs the training samples in the order of epoch ``x R``
      (:class:`BatchPlan`'s), cuts that packing's steps into S ranges, and slice k holds the samples of its range's
      rows; the last slice also holds the samples of the rows left over at the end of the packing, so the S slices
      of a pass partition the training samples. The phase trains its range, then R - 1 more passes over the
      slice's samples, each shuffled with the seed of epoch ``x R + r`` (and the slice number when S > 1) and
      packed again (rows left over at the end of each are skipped, as at an epoch's end). With S = 1 this is
      :class:`BatchPlan` again: one slice trained ``epochs`` times.

    Anchors of row j of a packing are drawn with :meth:`anchor_seed` (``(seed, "anchors", epoch, j)`` as
    :class:`BatchPlan` does, with the slice number added for slice-local packings). ``max_steps`` only cuts the plan
    short (the phase count comes from ``epochs``); the learning-rate schedule runs over :attr:`total_steps`.

    Raises:
        ValueError: ``reuse`` does not divide a whole number of ``epochs``; a packing has fewer rows than one
            optimizer step; a pass has fewer steps than ``slices``; a phase would have no steps.
    """

    def __init__(self, lengths: Sequence[int], train_ids: Sequence[int], capacity: int, *, seed: int, world: int,
                 grad_accum: int, epochs: float, max_steps: int | None = None, slices: int = 1, reuse: int = 1):
        if slices < 1 or reuse < 1:
            raise ValueError(f"stream.slices ({slices}) and stream.reuse ({reuse}) must be >= 1")
        self.lengths, self.train_ids, self.capacity = lengths, list(train_ids), capacity
        self.seed, self.world, self.grad_accum = seed, world, grad_accum
        self.per_step = world * grad_accum
        self.slices, self.reuse = slices, reuse
        self._base = BatchPlan(lengths, self.train_ids, capacity, seed=seed, world=world, grad_accum=grad_accum,
                               epochs=epochs if reuse == 1 else 1)
        self._slice_order: dict[tuple[int, int], list[int]] = {}
        self._packed: dict[tuple[int, int | None], list] = {}
        segments: list[_Segment] = []
        phases: list[tuple[int, int, list[int], list[_Segment]]] = []  # (pass, slice, samples, segments)
        self.steps_per_pass: list[int] = []  # each pass's steps before max_steps (what max_stream_slices reads)
        if reuse == 1:
            for x, steps in enumerate(self._base.steps_per_epoch):
                self.steps_per_pass.append(steps)
                bounds = self._bounds(steps, x)
                for k in range(slices):
                    a, b = bounds[k], bounds[k + 1]
                    rows = self._base.rows(x)[a * self.per_step:b * self.per_step]
                    phases.append((x, k, _samples_of(rows), [_Segment((x, None), a * self.per_step, b - a, 0)]))
        else:
            if epochs != int(epochs) or int(epochs) % reuse:
                raise ValueError(f"stream.reuse {reuse} must divide train.epochs ({epochs}) into whole passes")
            for x in range(int(epochs) // reuse):
                packing = self._rows_of((x * reuse, None))
                steps = len(packing) // self.per_step
                self._check_rows(len(packing), f"the packing of epoch {x * reuse}")
                self.steps_per_pass.append(steps)
                bounds = self._bounds(steps, x)
                for k in range(slices):
                    a, b = bounds[k], bounds[k + 1]
                    end = len(packing) if k == slices - 1 else b * self.per_step  # the last slice takes the leftovers
                    samples = _samples_of(packing[a * self.per_step:end])
                    order = sorted(samples, key=self._position)  # the training order of train_ids
                    self._slice_order[(x, k)] = order
                    parts = [_Segment((x * reuse, None), a * self.per_step, b - a, 0)]
                    for r in range(1, reuse):
                        key = (x * reuse + r, None if slices == 1 else k)
                        n = len(self._rows_of(key)) // self.per_step
                        self._check_rows(len(self._rows_of(key)), f"slice {k} of pass {x} in epoch {x * reuse + r}")
                        parts.append(_Segment(key, 0, n, 0))
                    phases.append((x, k, samples, parts))
        # lay the segments end to end, cut at max_steps
        total, self.phases = 0, []
        for p, (x, k, _, parts) in enumerate(phases):
            first, used = total, set()
            for seg in parts:
                steps = seg.steps if max_steps is None else max(0, min(seg.steps, max_steps - total))
                if steps:
                    segments.append(_Segment(seg.key, seg.row_offset, steps, total))
                    total += steps
                    rows = self._rows_of(seg.key)[seg.row_offset:seg.row_offset + steps * self.per_step]
                    used.update(s for row in rows for s, _ in row)
            if total == first:
                raise ValueError(f"phase {p} (pass {x}, slice {k}) has no optimizer steps: train.max_steps "
                                 f"{max_steps} ends the plan before it; lower stream.slices or raise max_steps")
            self.phases.append(Phase(p, x, k, first, total, tuple(sorted(used))))
        self._segments = segments
        self.total_steps = total
        self._starts = [s.start for s in segments]

    # -- construction helpers
    def _position(self, key: int) -> int:
        if not hasattr(self, "_positions"):
            self._positions = {s: i for i, s in enumerate(self.train_ids)}
        return self._positions[key]

    def _check_rows(self, rows: int, what: str) -> None:
        if rows // self.per_step < 1:
            raise ValueError(f"{what} has {rows} rows of {self.capacity} tokens, fewer than one optimizer step needs "
                             f"({self.world} processes x {self.grad_accum} micro-batches); lower "
                             "train.tokens_per_batch or grad_accum, or use fewer stream.slices")

    def _bounds(self, steps: int, x: int) -> list[int]:
        if steps < self.slices:
            raise ValueError(f"pass {x} has {steps} optimizer steps, fewer than stream.slices = {self.slices}: "
                             "use fewer slices (or more data)")
        return _cut(steps, self.slices)

    # -- the plan
    def _rows_of(self, key: tuple[int, int | None]) -> list[list[tuple[int, int]]]:
        epoch, k = key
        if k is None and self.reuse == 1:
            return self._base.rows(epoch)
        if key not in self._packed:
            if len(self._packed) >= 2:
                self._packed.pop(next(iter(self._packed)))
            if k is None:  # a whole pass (or, with one slice, the whole data again): BatchPlan's epoch order
                ids, parts = self.train_ids, ("epoch", epoch)
            else:
                ids, parts = self._slice_order[(epoch // self.reuse, k)], ("epoch", epoch, "slice", k)
            g = torch.Generator().manual_seed(seed_of(self.seed, *parts))
            order = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
            self._packed[key] = pack_rows(self.lengths, order, self.capacity)
        return self._packed[key]

    def rows(self, key: tuple[int, int | None]) -> list[list[tuple[int, int]]]:
        """The packed rows of packing ``key`` (as :meth:`items` yields it): lists of ``(sample key, tokens)``."""
        return self._rows_of(key)

    def anchor_seed(self, key: tuple[int, int | None], row: int) -> int:
        """The seed of the anchors of row ``row`` of packing ``key``: :class:`BatchPlan`'s for whole-pass
        packings, with the slice number for a slice's own packings."""
        epoch, k = key
        return seed_of(self.seed, "anchors", epoch, row) if k is None else seed_of(self.seed, "anchors", epoch,
                                                                                   "slice", k, row)

    def locate(self, step: int) -> tuple[tuple[int, int | None], int]:
        """``(packing key, step within that packing's steps)`` of global optimizer step ``step``."""
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} outside 0..{self.total_steps - 1}")
        i = max(j for j, s0 in enumerate(self._starts) if s0 <= step)
        seg = self._segments[i]
        return seg.key, seg.row_offset // self.per_step + step - seg.start

    def items(self, first: int, last: int, rank: int) -> Iterator[tuple[int, tuple[int, int | None], int]]:
        """``(step, packing key, row index)`` of every micro-batch of ``rank`` for steps ``first .. last - 1``:
        the same rows :class:`BatchPlan` gives (row ``(s * grad_accum + m) * world + rank`` of its packing)."""
        for step in range(first, last):
            key, i = self.locate(step)
            for m in range(self.grad_accum):
                yield step, key, (i * self.grad_accum + m) * self.world + rank

    def phase_of(self, step: int) -> Phase:
        """The phase that trains global step ``step``."""
        for phase in self.phases:
            if phase.first_step <= step < phase.end_step:
                return phase
        raise IndexError(f"step {step} outside 0..{self.total_steps - 1}")


def steps_per_pass(lengths: Sequence[int], train_ids: Sequence[int], capacity: int, *, seed: int, world: int,
                   grad_accum: int, epochs: float, reuse: int = 1) -> list[int]:
    """The optimizer steps of each pass over the training samples as :class:`StreamPlan` cuts them into slices,
    before ``train.max_steps``: with ``reuse`` 1 each epoch of :class:`BatchPlan` (a fractional last one cut); with
    ``reuse`` R the packing of epoch ``x R`` for pass x (``epochs / R`` passes).

    Raises:
        ValueError: :class:`BatchPlan`'s (an epoch with fewer rows than one step needs).
    """
    plan = BatchPlan(list(lengths), list(train_ids), capacity, seed=seed, world=world, grad_accum=grad_accum,
                     epochs=epochs)
    if reuse == 1:
        return list(plan.steps_per_epoch)
    return [plan.steps_per_epoch[x * reuse] for x in range(int(epochs) // reuse)]


def max_stream_slices(passes: Sequence[int], *, reuse: int = 1, max_steps: int | None = None) -> int:
    """The largest ``stream.slices`` S whose :class:`StreamPlan` gives every phase an optimizer step; 1 (offline)
    when no S > 1 does.

    :class:`StreamPlan`'s rules, over ``passes`` (:func:`steps_per_pass`): every pass has at least S steps (it cuts
    each pass into S step ranges, the first ones one step longer), and with ``max_steps`` the last phase starts
    before it (the phases lie end to end and ``max_steps`` cuts the plan short: a phase after it has no step). The
    last phase starts after ``reuse x (sum(passes) - passes[-1] // S)`` steps: exact for ``reuse`` 1; for R > 1 a
    phase's R - 1 passes over its own slice are counted as its range's steps again (their packings are made by the
    plan itself, about as many rows).
    """
    if not passes:
        return 1
    total, last, best = sum(passes), passes[-1], 1
    for s in range(2, min(passes) + 1):
        if max_steps is not None and reuse * (total - last // s) >= max_steps:
            break
        best = s
    return best


def _samples_of(rows: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """The distinct sample keys of packed rows."""
    return sorted({s for row in rows for s, _ in row})


def heldout_subset(heldout: Sequence[int], limit: int | None, seed: int) -> list[int]:
    """At most ``limit`` of the held-out samples (all when ``limit`` is None or not smaller), a seeded choice kept in
    the order given: the samples whose features stream mode keeps for the trainer's held-out metrics.

    Args:
        heldout: sample keys (e.g. :func:`split_samples`'s held-out list mapped to tokenized rows).
        limit: ``stream.heldout_samples``.
        seed: ``train.seed``.
    """
    if limit is None or limit >= len(heldout):
        return list(heldout)
    g = torch.Generator().manual_seed(seed_of(seed, "heldout-subset"))
    chosen = set(torch.randperm(len(heldout), generator=g)[:limit].tolist())
    return [s for i, s in enumerate(heldout) if i in chosen]
