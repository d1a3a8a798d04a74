"""Batches: packed rows of feature documents with per-document anchors, read ahead on background threads.

:func:`make_batch` reads one planned row (:mod:`draftsmith.train.plan`) from the features and packs it with
:func:`pack_documents`; :func:`cap_anchors` bounds a row's anchors; :func:`batch_maker` fixes the shapes the run
uses (on a GPU a fixed row length and power-of-two anchor buckets); :class:`Prefetcher` overlaps reading with the
training step; :class:`TrainItem` is a training batch with its model FLOPs and its loss weight
(:func:`loss_weight`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from draftsmith.drafter_loss import slot_weights
from draftsmith.features import FeatureIndex
from draftsmith.modeling import PackedBatch, block_targets, sample_anchors
from draftsmith.train.settings import TrainOptions


def make_batch(index: FeatureIndex, row: list[tuple[int, int]], *, num_anchors: int, seed: int,
               feature_dtype: torch.dtype, pad_tokens_to: int = 1, pad_anchors_to: int = 1,
               bucket_anchors: bool = False, max_anchors_per_row: int | None = None,
               pin_memory: bool = False, keep_fp8: bool = False, soft_labels: bool = False,
               soft_label_tokens: int | None = None) -> PackedBatch:
    """Read one packed row of samples (``(tokenized row, tokens)`` pairs, :meth:`FeatureIndex.ref`) and pack it with
    :func:`pack_documents`. With ``keep_fp8`` float8 features stay float8 with their scales (decoded later by
    :meth:`PackedBatch.dequantize`, on the GPU); else they are decoded to ``feature_dtype`` here. With
    ``soft_labels`` (``train.labels: target_topk``) the batch carries the target's stored top-k, which the drafter's
    loss then learns; without, they are not read (the batch trains on the greedy token). ``soft_label_tokens``
    (``train.labels_topk``) keeps the first that many of each position's stored top-k (the most likely).

    Raises:
        KeyError: the index does not hold a row's sample.
    """
    parts = [index.read(index.ref(s), n, feature_dtype, dequantize=not keep_fp8, topk=soft_labels) for s, n in row]
    if soft_labels and soft_label_tokens is not None:
        for part in parts:
            for key in ("target_topk_ids", "target_topk_logprobs"):
                part[key] = part[key][:, :soft_label_tokens]
    return pack_documents(parts, width=index.width, num_anchors=num_anchors, seed=seed, feature_dtype=feature_dtype,
                          pad_tokens_to=pad_tokens_to, pad_anchors_to=pad_anchors_to, bucket_anchors=bucket_anchors,
                          max_anchors_per_row=max_anchors_per_row, pin_memory=pin_memory)


def pack_documents(parts: list[dict], *, width: int, num_anchors: int, seed: int, feature_dtype: torch.dtype,
                   pad_tokens_to: int = 1, pad_anchors_to: int = 1, bucket_anchors: bool = False,
                   max_anchors_per_row: int | None = None, pin_memory: bool = False) -> PackedBatch:
    """Pack documents into one :class:`PackedBatch` row (``R = 1``).

    Args:
        parts: per document ``{"features": [n, width], "input_ids": [n], "loss_mask": [n], "target_token": [n]
            or absent, "scales": [n, layers] or absent, "target_topk_ids" / "target_topk_logprobs": [n, k] or
            absent}``. With ``scales`` (every part) the features are float8_e4m3fn as stored and the batch carries
            them with ``feature_scales`` (padding 0); without, they are packed as ``feature_dtype``. With the top-k
            (every part) the batch carries ``target_topk_ids [1, S, k]`` int32 and ``target_topk_logprobs
            [1, S, k]`` float16 as stored (padding 0; widened on the device for the supervised slots only).

    Documents are concatenated in order, document-relative positions restart at 0, the row is right-padded
    to a multiple of ``pad_tokens_to`` (doc id ``-1``, loss mask 0) and the anchor list to a multiple of
    ``pad_anchors_to`` (``anchor_valid`` False), or with ``bucket_anchors`` to the next power of two (at least
    ``pad_anchors_to``): on GPU a handful of shapes keeps compiled flex_attention kernels from recompiling.
    Anchors: :func:`draftsmith.modeling.sample_anchors` with a generator seeded by ``seed``, at most
    ``max_anchors_per_row`` of them (a uniform subset; see :func:`cap_anchors`).

    With ``pin_memory`` the features (the row's bulk: ``S x width`` values) are written straight into page-locked
    memory, ready for an asynchronous copy to the GPU. Only the padding tail is zeroed: zero-filling a fresh
    ``S x width`` buffer costs about as much as reading the documents into it.
    """
    total = sum(p["input_ids"].numel() for p in parts)
    S = max(pad_tokens_to, -(-total // pad_tokens_to) * pad_tokens_to)
    fp8 = bool(parts) and "scales" in parts[0]
    feats = torch.empty(S, width, dtype=torch.float8_e4m3fn if fp8 else feature_dtype, pin_memory=pin_memory)
    feats[total:].zero_()
    scales = torch.zeros(S, parts[0]["scales"].shape[1], dtype=torch.float32) if fp8 else None
    ids = torch.zeros(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    docs = torch.full((S,), -1, dtype=torch.long)
    pos = torch.zeros(S, dtype=torch.long)
    with_tt = bool(parts) and parts[0].get("target_token") is not None
    tgt = torch.zeros(S, dtype=torch.long) if with_tt else None
    with_topk = bool(parts) and parts[0].get("target_topk_ids") is not None
    k = parts[0]["target_topk_ids"].shape[1] if with_topk else 0
    topk_ids = torch.zeros(S, k, dtype=torch.int32) if with_topk else None
    topk_logprobs = torch.zeros(S, k, dtype=torch.float16) if with_topk else None
    o = 0
    for d, p in enumerate(parts):
        n = p["input_ids"].numel()
        feats[o:o + n] = p["features"]
        if scales is not None:
            scales[o:o + n] = p["scales"]
        ids[o:o + n] = p["input_ids"]
        mask[o:o + n] = p["loss_mask"]
        docs[o:o + n] = d
        pos[o:o + n] = torch.arange(n)
        if tgt is not None:
            tgt[o:o + n] = p["target_token"]
        if topk_ids is not None:
            topk_ids[o:o + n] = p["target_topk_ids"]
            topk_logprobs[o:o + n] = p["target_topk_logprobs"]
        o += n
    generator = torch.Generator().manual_seed(seed)
    anchors = cap_anchors(sample_anchors(mask, docs, num_anchors, generator), max_anchors_per_row, generator)
    if bucket_anchors:
        A = max(pad_anchors_to, 1 << max(0, anchors.numel() - 1).bit_length())
    else:
        A = max(pad_anchors_to, -(-anchors.numel() // pad_anchors_to) * pad_anchors_to)
    anchor_valid = torch.zeros(A, dtype=torch.bool)
    anchor_valid[:anchors.numel()] = True
    anchors = torch.cat([anchors, torch.zeros(A - anchors.numel(), dtype=torch.long)])
    return PackedBatch(feats[None], ids[None], mask[None], docs[None], pos[None], anchors[None],
                       anchor_valid[None], None if tgt is None else tgt[None],
                       None if scales is None else scales[None],
                       target_topk_ids=None if topk_ids is None else topk_ids[None],
                       target_topk_logprobs=None if topk_logprobs is None else topk_logprobs[None])


def cap_anchors(anchors: torch.Tensor, limit: int | None, generator: torch.Generator) -> torch.Tensor:
    """At most ``limit`` of a row's sorted anchors ``[A]``, drawn uniformly without replacement, still sorted.

    Anchors are sampled per document (``num_anchors`` each, the published recipe's per-sequence count), so a
    row of many short documents can hold almost one anchor per answer token: B block tokens per context
    token. The drafter's activations grow with the block tokens (``A x B``); this bound makes a micro-batch's
    memory independent of how many documents share the row. ``None`` keeps every anchor.
    """
    if limit is None or anchors.numel() <= limit:
        return anchors
    keep = torch.randperm(anchors.numel(), generator=generator)[:limit]
    return torch.sort(anchors[keep]).values


def batch_maker(index: FeatureIndex, settings: TrainOptions, *, block_size: int, feature_dtype: torch.dtype,
                on_gpu: bool) -> Callable[..., PackedBatch]:
    """``make(row, seed=...)``: :func:`make_batch` with the run's anchors and shapes. On a GPU rows are padded to a
    multiple of 128 tokens past ``train.tokens_per_batch``, anchors to power-of-two buckets of at least
    ``128 // block_size``, and features pinned: compiled flex_attention sees few shapes; float8 features stay
    float8 (half the bytes of bf16 to copy, decoded on the GPU by :meth:`PackedBatch.dequantize`). On the CPU the
    loader decodes them."""
    row_tokens = int(settings.tokens_per_batch)
    return functools.partial(make_batch, index, num_anchors=settings.num_anchors, feature_dtype=feature_dtype,
                             pad_tokens_to=-(-row_tokens // 128) * 128 if on_gpu else 1,
                             pad_anchors_to=max(1, 128 // block_size) if on_gpu else 1,
                             bucket_anchors=on_gpu, max_anchors_per_row=settings.max_anchors_per_row,
                             pin_memory=on_gpu, keep_fp8=on_gpu and index.storage_dtype == "float8_e4m3fn",
                             soft_labels=settings.labels == "target_topk", soft_label_tokens=settings.labels_topk)


def loss_weight(batch: PackedBatch, block_size: int, gamma: float, dpace: bool = False) -> float:
    """The loss weight of a batch, ``sum(w)`` with ``w = valid * exp(-(k - 1) / gamma)`` over its blocks' slots
    k = 1..B-1 (:func:`~draftsmith.modeling.block_targets`, :func:`~draftsmith.drafter_loss.slot_weights`), or with
    ``dpace`` the number of valid slots (D-PACE's normaliser, :func:`~draftsmith.drafter_loss.slot_loss_weights`):
    what :meth:`~draftsmith.modeling.DFlashDraftModel.training_forward` returns as ``weight_sum``, computed without
    the model (float64, from the token ids, loss mask, documents and anchors only), so the trainer knows an
    optimizer step's total weight before its first backward."""
    valid = block_targets(batch, block_size, use_target_tokens=False)[1]  # [R, A, B-1]
    if dpace:
        return float(valid.sum())
    return float((valid.double() * slot_weights(block_size, gamma).double()).sum())


@dataclass
class TrainItem:
    """A packed training batch, its model FLOPs (:func:`draftsmith.flops.step_flops`) and its loss weight
    (:func:`loss_weight`), both counted on the host by the prefetch workers."""

    batch: PackedBatch
    flops: float
    weight: float

    def pin_memory(self) -> "TrainItem":
        return TrainItem(self.batch.pin_memory(), self.flops, self.weight)


class Prefetcher:
    """Runs ``make(item)`` for every item of ``items`` on ``workers`` background threads, ``depth`` items ahead.

    Iterating yields the results in the items' order. An exception in a worker is re-raised in the consumer.
    With ``pin``, batches are page-locked (asynchronous copies to the GPU). Several workers matter on a GPU: one
    thread reading, packing and pinning rows of a small target's features fell behind the training step.
    """

    _END = object()

    def __init__(self, items: list, make, depth: int = 4, pin: bool = False, workers: int = 1):
        self.items, self.make, self.pin = items, make, pin
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                          thread_name_prefix="draftsmith-prefetch")
        self.thread = threading.Thread(target=self._run, name="draftsmith-prefetch", daemon=True)
        self.thread.start()

    def _make(self, item):
        out = self.make(item)
        return out.pin_memory() if self.pin else out

    def _run(self) -> None:
        try:
            for item in self.items:
                if self.stop.is_set():
                    return
                self._put(self.pool.submit(self._make, item))  # the bounded queue bounds the work in flight
        except BaseException as exc:  # handed to the consumer
            self._put(exc)
            return
        self._put(self._END)

    def _put(self, obj) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(obj, timeout=0.5)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator:
        while True:
            obj = self.q.get()
            if obj is self._END:
                return
            if isinstance(obj, BaseException):
                raise obj
            yield obj.result()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)
