"""The run's data and learning rate: the global batch plan (:mod:`draftsmith.batch_plan`: held-out split, packed
rows, which row every optimizer step trains on) applied to the features of a run -- :func:`plan_data` offline (one
index holds every sample), :func:`plan_stream_data` in stream mode (the plan from the tokenized rows' lengths, the
features of one slice at a time) -- and :func:`lr_factor`, the schedule over its steps.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from draftsmith.batch_plan import BatchPlan, StreamPlan, heldout_subset, split_samples
from draftsmith.features import FeatureIndex, target_top_k
from draftsmith.tokenized import read_tokenized
from draftsmith.train.settings import StreamOptions, TrainOptions

log = logging.getLogger("draftsmith.train")


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warmup from ``1/warmup`` to 1 over
    ``warmup_steps`` steps, then cosine from 1 down to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


#: The index fields a run reads besides its samples (the drafter's shape, labels, the run fingerprint); every slice
#: of a stream-mode run shares them. ``target_top_k`` is absent from indexes of features without the target's top-k
#: (:func:`draftsmith.features.target_top_k`), and :meth:`FeatureMeta.of` leaves it out then.
FEATURE_FIELDS = ("layer_ids", "hidden_size", "num_target_layers", "storage_dtype", "has_target_token",
                  "target_fingerprint", "tokenizer_fingerprint", "target_top_k")


@dataclass(frozen=True)
class FeatureMeta:
    """What a run needs of its features besides the samples: the fields :data:`FEATURE_FIELDS` of an index (the
    attributes :func:`draftsmith.train.model.build_model_config` reads, as :class:`FeatureIndex` names them).

    Attributes:
        path: where they come from (named in messages).
        meta: ``{field: value}`` (JSON), the fields above.
    """

    path: str
    meta: dict[str, Any] = field(hash=False)

    @classmethod
    def of(cls, index: FeatureIndex) -> FeatureMeta:
        return cls(str(index.path), {k: index.meta.get(k) for k in FEATURE_FIELDS
                                     if k != "target_top_k" or k in index.meta})

    @property
    def layer_ids(self) -> list[int]:
        return [int(i) for i in self.meta["layer_ids"]]

    @property
    def num_target_layers(self) -> int:
        return int(self.meta["num_target_layers"])

    @property
    def storage_dtype(self) -> str:
        return self.meta["storage_dtype"]

    @property
    def has_target_token(self) -> bool:
        return bool(self.meta["has_target_token"])

    @property
    def target_top_k(self) -> int:
        """k of the target's top-k the features hold (``extract.store_target_topk``), 0 when none."""
        return target_top_k(self.meta)


@dataclass
class TrainData:
    """What a run trains on: the features, the held-out split and the batch plan.

    Samples are named by their tokenized train row throughout: ``lengths[row]`` is a sample's token count,
    ``train_ids`` / ``heldout_ids`` are rows (:func:`split_samples`' split, in row order; in stream mode the
    held-out samples kept, :func:`heldout_subset`), and the plan's packed rows hold ``(row, tokens)`` pairs that
    :meth:`FeatureIndex.ref` finds in ``index`` (training) and ``heldout_index`` (held-out metrics; offline the same
    index, None when there are no held-out samples). ``index`` is None for a run that only evaluates (stream mode's
    final step). ``truncated`` counts the training samples longer than a packed row, ``use_target_tokens`` whether
    the labels are the target's own next tokens (``train.labels = target`` and the features carry them),
    ``num_samples`` the samples of the split (offline the index's, in stream mode the tokenized rows), and
    ``plan_identity`` (stream mode) what decides the plan besides the settings: the ``stream`` keys and the sha256
    of the rows' lengths (:func:`draftsmith.train.checkpoint.run_fingerprint`).
    """

    index: FeatureIndex | None
    heldout_index: FeatureIndex | None
    features: FeatureMeta
    lengths: Mapping[int, int] | Sequence[int]
    train_ids: list[int]
    heldout_ids: list[int]
    truncated: int
    plan: BatchPlan | StreamPlan
    use_target_tokens: bool
    num_samples: int
    plan_identity: dict[str, Any] | None = None


#: fewer held-out samples than this make training's held-out metrics (loss, τ) noise: a warning says so
MIN_HELDOUT_SAMPLES = 32


def warn_few_heldout(heldout: int, eval_fraction: float, samples: int) -> None:
    """Warn when training's held-out split (``train.eval_fraction`` of ``samples``) holds fewer than
    :data:`MIN_HELDOUT_SAMPLES` samples: its loss and τ would then say little."""
    if heldout < MIN_HELDOUT_SAMPLES:
        log.warning("only %d held-out sample(s) (train.eval_fraction %g of %d): training's held-out loss and τ "
                    "are noisy (evaluate's decoded τ is not: it decodes its own sets); raise train.eval_fraction "
                    "for at least %d (expected on the CPU default's small data)", heldout, eval_fraction, samples,
                    MIN_HELDOUT_SAMPLES)


def plan_data(index_path: str | os.PathLike, settings: TrainOptions, world: int) -> TrainData:
    """Open the features, split off the held-out samples and plan every step's rows for ``world`` processes
    (:class:`BatchPlan`).

    Raises:
        ValueError: too few samples for one optimizer step (named with the index path).
    """
    index = FeatureIndex(index_path)
    use_target_tokens = target_labels(settings, index)
    rows = [s.row for s in index.samples]
    train_ids, heldout_ids = ([rows[i] for i in part]
                              for part in split_samples(rows, settings.eval_fraction, settings.seed))
    lengths = {s.row: s.num_tokens for s in index.samples}
    row_tokens = int(settings.tokens_per_batch)
    truncated = sum(1 for i in train_ids if lengths[i] > row_tokens)
    log.info("samples: %d = %d train + %d held out; %d train samples longer than tokens_per_batch=%d are cut",
             len(index.samples), len(train_ids), len(heldout_ids), truncated, row_tokens)
    warn_few_heldout(len(heldout_ids), settings.eval_fraction, len(index.samples))
    try:
        plan = BatchPlan(lengths, train_ids, row_tokens, seed=settings.seed, world=world,
                         grad_accum=settings.grad_accum, epochs=settings.epochs, max_steps=settings.max_steps)
    except ValueError as exc:
        raise ValueError(f"{index_path}: {exc}") from None
    return TrainData(index, index, FeatureMeta.of(index), lengths, train_ids, heldout_ids, truncated, plan,
                     use_target_tokens, len(index.samples))


def plan_stream_data(tokenized_path: str | os.PathLike, settings: TrainOptions, stream: StreamOptions, world: int,
                     *, features: FeatureMeta, index: FeatureIndex | None = None,
                     heldout_index: FeatureIndex | None = None) -> TrainData:
    """Stream mode's data: the global plan (:class:`StreamPlan`, cut for ``world`` processes) from the tokenized train
    rows' lengths (``num_tokens`` only), the held-out split over every row (:func:`split_samples`) of which
    ``stream.heldout_samples`` are kept (:func:`heldout_subset`), and the features given (a slice's ``index``, the
    ``heldout_index``; checked by the caller, :func:`draftsmith.train.phases.open_phase_features`).

    Raises:
        FileNotFoundError / ValueError: the tokenized parquet is missing or malformed; the plan is impossible
            (:class:`StreamPlan`'s reasons, with the parquet named).
    """
    tokenized = read_tokenized(tokenized_path, with_tokens=False)
    lengths = [int(n) for n in tokenized.num_tokens]
    train_ids, split_heldout = split_samples(list(range(len(lengths))), settings.eval_fraction, settings.seed)
    heldout_ids = heldout_subset(split_heldout, stream.heldout_samples, settings.seed)
    row_tokens = int(settings.tokens_per_batch)
    truncated = sum(1 for r in train_ids if lengths[r] > row_tokens)
    log.info("samples: %d tokenized rows = %d train + %d held out (%d kept for the held-out metrics); %d train "
             "samples longer than tokens_per_batch=%d are cut", len(lengths), len(train_ids), len(split_heldout),
             len(heldout_ids), truncated, row_tokens)
    warn_few_heldout(len(heldout_ids), settings.eval_fraction, len(lengths))
    try:
        plan = StreamPlan(lengths, train_ids, row_tokens, seed=settings.seed, world=world,
                          grad_accum=settings.grad_accum, epochs=settings.epochs, max_steps=settings.max_steps,
                          slices=stream.slices, reuse=stream.reuse)
    except ValueError as exc:
        raise ValueError(f"{tokenized_path}: {exc}") from None
    identity = {"stream": stream.to_dict(),
                "lengths_sha256": hashlib.sha256(tokenized.num_tokens.astype("<i8").tobytes()).hexdigest()}
    return TrainData(index, heldout_index, features, lengths, train_ids, heldout_ids, truncated, plan,
                     target_labels(settings, features), len(lengths), identity)


def target_labels(settings: TrainOptions, features: FeatureIndex | FeatureMeta) -> bool:
    """Whether the labels are the target's own next tokens: ``train.labels`` ``target`` or ``target_topk`` and the
    features carry them (``target``: a warning when they do not).

    Raises:
        ValueError: ``train.labels: target_topk`` on features without the target's greedy token or with a top-k of
            fewer than 2 tokens (the features named: they were extracted without ``extract.store_target_topk``), or
            fewer than ``train.labels_topk``.
    """
    has_target_token, top_k = features.has_target_token, features.target_top_k
    if settings.labels == "target_topk" and (not has_target_token or top_k < 2):
        held = f"a top-{top_k}" if top_k else "no top-k"
        raise ValueError(f"{features.path}: train.labels is target_topk but the features hold {held} of the "
                         f"target's next-token distribution{'' if has_target_token else ' and no target_token'}: "
                         "extract them with extract.store_target_topk >= 2 (and store_target_tokens: true)")
    if settings.labels == "target_topk" and settings.labels_topk is not None and settings.labels_topk > top_k:
        raise ValueError(f"{features.path}: train.labels_topk is {settings.labels_topk} but the features hold the "
                         f"target's top {top_k}: lower it, or extract with extract.store_target_topk >= "
                         f"{settings.labels_topk}")
    if settings.labels == "target" and not has_target_token:
        log.warning("train.labels = target but the features have no target_token: training on data tokens")
    return settings.labels in ("target", "target_topk") and has_target_token


def plan_summary(plan: BatchPlan | StreamPlan) -> tuple[list[int], int]:
    """``(optimizer steps of each epoch, packed rows skipped at the ends of the packings the plan uses whole)`` --
    :class:`BatchPlan`'s ``steps_per_epoch`` and ``skipped_rows``; for a :class:`StreamPlan` counted step by step
    (its steps of epoch ``e`` are those of the packings of epoch ``e``, slice-local ones included)."""
    if isinstance(plan, BatchPlan):
        return list(plan.steps_per_epoch), plan.skipped_rows
    steps_of = Counter(plan.locate(step)[0] for step in range(plan.total_steps))
    per_epoch = Counter()
    skipped = 0
    for key, steps in steps_of.items():
        per_epoch[key[0]] += steps
        rows = len(plan.rows(key))
        if steps == rows // plan.per_step:  # a packing trained to its end (not cut by max_steps)
            skipped += rows - steps * plan.per_step
    return [per_epoch[e] for e in sorted(per_epoch)], skipped
