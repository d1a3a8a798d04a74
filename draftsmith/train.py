"""train: the DFlash drafter on the extracted target features (single process or torchrun DDP).

Reading order, nanoGPT style: :class:`FeatureIndex` (chunk files through safetensors memory maps),
:func:`split_samples` (held-out samples), :func:`pack_rows` / :func:`make_batch` (packed rows with document ids
and per-document anchors), :class:`Prefetcher` (a background thread that overlaps reading with compute),
checkpoints (:func:`save_checkpoint`, :func:`load_latest_checkpoint`), :func:`evaluate` (held-out loss,
per-position accuracy, expected acceptance length) and finally :func:`train`, the loop.

The batch plan is a pure function of (seed, epoch): epoch ``e`` shuffles the training samples with seed
``(seed, e)`` and packs them greedily into rows of at most ``tokens_per_batch`` tokens; optimizer step ``s`` of
rank ``r`` takes row ``(s_e * accum + m) * world + r`` for micro-batch ``m`` (``s_e`` = step within the
epoch, :class:`BatchPlan`); the anchors of a row are drawn from a generator seeded by (seed, epoch, row). So a
resumed run replays exactly the batches an uninterrupted one would see, and "data position" is the step counter.

Checkpoints (``<out>/checkpoints/run-<fingerprint>/step-XXXXXXXX/``, one folder per configuration):
``model.safetensors`` (drafter weights), ``optimizer.safetensors``
(AdamW moments and step counts), ``rng.safetensors`` (torch CPU / CUDA generator states), ``state.json`` (step,
epoch, scheduler, data position, run fingerprint, sha256 of the other files; written last). A folder is
assembled under a temporary name and renamed into place, then ``latest.json`` is replaced atomically; resume
verifies the hashes, so a half-written checkpoint is never accepted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import concurrent.futures
import contextlib
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from draftsmith.config import schema_defaults
from draftsmith.features import FeatureIndex
from draftsmith.flops import step_flops
from draftsmith.io import progress, read_json, sha256_file, write_json
from draftsmith.drafter_config import (
    build_drafter_config,
    default_loss_gamma,
    drafter_config_dict,
    resolve_mask_token_id,
)
from draftsmith.modeling import DFlashDraftModel, PackedBatch, sample_anchors
from draftsmith.target import load_target_embeddings_and_head
from draftsmith.stages import STAGE_KEYS
from draftsmith.target_layers import default_target_layer_ids, num_tapped_layers

log = logging.getLogger("draftsmith.train")

CHECKPOINT_FORMAT = "draftsmith.checkpoint/1"

#: Defaults of the ``train`` and ``drafter`` config sections for library callers: the schema's own
TRAIN_DEFAULTS: dict[str, Any] = schema_defaults("train")
DRAFTER_DEFAULTS: dict[str, Any] = schema_defaults("drafter")


# ---------------------------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------------------------

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
            g = torch.Generator().manual_seed(_seed_of(self.seed, "epoch", epoch))
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


def _seed_of(*parts: Any) -> int:
    """A 63-bit seed from a tuple (stable across processes and Python versions)."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def make_batch(index: FeatureIndex, row: list[tuple[int, int]], *, num_anchors: int, seed: int,
               feature_dtype: torch.dtype, pad_tokens_to: int = 1, pad_anchors_to: int = 1,
               bucket_anchors: bool = False, max_anchors_per_row: int | None = None,
               pin_memory: bool = False) -> PackedBatch:
    """Read one row of samples (``(sample, tokens)`` pairs) and pack it with :func:`pack_documents`."""
    parts = [index.read(index.samples[s], n, feature_dtype) for s, n in row]
    return pack_documents(parts, width=index.width, num_anchors=num_anchors, seed=seed, feature_dtype=feature_dtype,
                          pad_tokens_to=pad_tokens_to, pad_anchors_to=pad_anchors_to, bucket_anchors=bucket_anchors,
                          max_anchors_per_row=max_anchors_per_row, pin_memory=pin_memory)


def pack_documents(parts: list[dict], *, width: int, num_anchors: int, seed: int, feature_dtype: torch.dtype,
                   pad_tokens_to: int = 1, pad_anchors_to: int = 1, bucket_anchors: bool = False,
                   max_anchors_per_row: int | None = None, pin_memory: bool = False) -> PackedBatch:
    """Pack documents into one :class:`PackedBatch` row (``R = 1``).

    Args:
        parts: per document ``{"features": [n, width], "input_ids": [n], "loss_mask": [n], "target_token": [n]
            or absent}``.

    Documents are concatenated in order, document-relative positions restart at 0, the row is right-padded
    to a multiple of ``pad_tokens_to`` (doc id ``-1``, loss mask 0) and the anchor list to a multiple of
    ``pad_anchors_to`` (``anchor_valid`` False), or with ``bucket_anchors`` to the next power of two (at least
    ``pad_anchors_to``): on GPU a handful of shapes keeps compiled flex_attention kernels from recompiling.
    Anchors: :func:`draftsmith.modeling.sample_anchors` with a generator seeded by ``seed``, at most
    ``max_anchors_per_row`` of them (a uniform subset; see :func:`cap_anchors`).

    With ``pin_memory`` the features (the row's bulk: ``S x width`` values) are written straight into page-locked
    memory, ready for an asynchronous copy to the GPU. Only the padding tail is zeroed: zero-filling a fresh
    ``S x width`` buffer cost more than reading the documents (40 of 80 ms per 16K-token row of 3 x 576 bf16
    features, measured on a CPU core).
    """
    total = sum(p["input_ids"].numel() for p in parts)
    S = max(pad_tokens_to, -(-total // pad_tokens_to) * pad_tokens_to)
    feats = torch.empty(S, width, dtype=feature_dtype, pin_memory=pin_memory)
    feats[total:].zero_()
    ids = torch.zeros(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    docs = torch.full((S,), -1, dtype=torch.long)
    pos = torch.zeros(S, dtype=torch.long)
    with_tt = bool(parts) and parts[0].get("target_token") is not None
    tgt = torch.zeros(S, dtype=torch.long) if with_tt else None
    o = 0
    for d, p in enumerate(parts):
        n = p["input_ids"].numel()
        feats[o:o + n] = p["features"]
        ids[o:o + n] = p["input_ids"]
        mask[o:o + n] = p["loss_mask"]
        docs[o:o + n] = d
        pos[o:o + n] = torch.arange(n)
        if tgt is not None:
            tgt[o:o + n] = p["target_token"]
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
                       anchor_valid[None], None if tgt is None else tgt[None])


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
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
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


# ---------------------------------------------------------------------------------------------------------------
# Schedule, optimizer state, checkpoints
# ---------------------------------------------------------------------------------------------------------------

def lr_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based): linear warmup from ``1/warmup`` to 1 over
    ``warmup_steps`` steps, then cosine from 1 down to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer ``state_dict`` into safetensors-able tensors (``state.<param>.<name>``) and JSON."""
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{pid}.{name}"] = t.detach().contiguous().cpu()
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Inverse of :func:`optimizer_tensors`."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def run_fingerprint(drafter_config: dict, train_cfg: dict, index_meta: dict, world: int) -> str:
    """sha256 of everything that decides the training trajectory (not the save / eval / log cadence)."""
    # the runtime keys of draftsmith.stages (Snakemake does not rerun training for them either); the GPU count
    # enters as world_size
    cadence = set(STAGE_KEYS["train"]["train"]["runtime"]) | {"gpus"}
    payload = {
        "drafter": drafter_config,
        "train": {k: v for k, v in sorted(train_cfg.items()) if k not in cadence},
        "features": {k: index_meta.get(k) for k in ("num_samples", "num_tokens", "layer_ids", "target_fingerprint",
                                                     "tokenizer_fingerprint", "storage_dtype")},
        "world_size": world,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: Path, step: int, model: DFlashDraftModel, opt: torch.optim.Optimizer,
                    state: dict, keep: int = 2) -> Path:
    """Write ``ckpt_dir/step-XXXXXXXX/`` atomically, point ``latest.json`` at it, keep the newest ``keep``.

    ``state`` (JSON) gets the sha256 of every tensor file; ``state.json`` is written last inside the
    temporary folder, which is then renamed into place.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".step-{step:08d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    opt_tensors, opt_meta = optimizer_tensors(opt)
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    files = {"model.safetensors": model.trainable_state_dict(), "optimizer.safetensors": opt_tensors,
             "rng.safetensors": rng}
    hashes = {}
    for name, tensors in files.items():
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        hashes[name] = sha256_file(tmp / name)
    full = dict(state, format=CHECKPOINT_FORMAT, step=step, files=hashes, optimizer=opt_meta)
    write_json(tmp / "state.json", full)
    for name in list(files) + ["state.json"]:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    write_json(ckpt_dir / "latest.json", {"step": step, "path": final.name})
    done = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(path: Path) -> dict | None:
    """``state.json`` of a complete checkpoint folder whose files match their recorded sha256, else None."""
    try:
        state = read_json(path / "state.json")
    except (FileNotFoundError, ValueError):
        return None
    if state.get("format") != CHECKPOINT_FORMAT:
        return None
    for name, digest in (state.get("files") or {}).items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            log.warning("checkpoint %s: %s is missing or does not match its sha256; ignoring it", path, name)
            return None
    return state


def load_latest_checkpoint(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest verified checkpoint: ``latest.json``'s target when valid, else the newest valid
    ``step-*`` folder (temporary ``.step-*`` folders of killed writers are ignored)."""
    if not ckpt_dir.is_dir():
        return None
    candidates = []
    latest = ckpt_dir / "latest.json"
    if latest.is_file():
        try:
            candidates.append(ckpt_dir / read_json(latest)["path"])
        except (ValueError, KeyError):
            log.warning("%s is unreadable; scanning the step folders", latest)
    candidates += sorted((p for p in ckpt_dir.glob("step-*") if p.is_dir()), reverse=True)
    for path in candidates:
        state = verify_checkpoint(path)
        if state is not None:
            return path, state
    return None


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------

def expected_acceptance_length(acc: list[float]) -> float:
    """E[tau] = 1 + sum_k prod_{j<=k} acc_j from per-position accuracies ``acc_1..acc_{B-1}`` (bonus included;
    positions treated as independent)."""
    tau, surv = 1.0, 1.0
    for a in acc:
        surv *= a
        tau += surv
    return tau


class Metrics:
    """Sums of :class:`draftsmith.modeling.DFlashTrainOutput` fields over batches (and ranks)."""

    def __init__(self, nslot: int, device: torch.device):
        self.t = {"loss_w": torch.zeros((), dtype=torch.float64, device=device),
                  "weight": torch.zeros((), dtype=torch.float64, device=device),
                  "ce": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "correct": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "count": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "accept": torch.zeros((), dtype=torch.float64, device=device),
                  "blocks": torch.zeros((), dtype=torch.float64, device=device)}

    def add(self, out) -> None:
        self.t["loss_w"] += out.loss.detach().double() * out.weight_sum.double()
        self.t["weight"] += out.weight_sum.detach().double()
        self.t["ce"] += out.ce_sum.double()
        self.t["correct"] += out.correct.double()
        self.t["count"] += out.count.double()
        self.t["accept"] += out.accept_sum.double()
        self.t["blocks"] += out.full_blocks.double()

    def all_reduce(self) -> None:
        if dist.is_initialized():
            for v in self.t.values():
                dist.all_reduce(v)

    def summary(self) -> dict[str, Any]:
        t = {k: v.cpu() for k, v in self.t.items()}
        count = t["count"].clamp_min(1)
        acc = (t["correct"] / count).tolist()
        return {
            "loss": float(t["loss_w"] / t["weight"].clamp_min(1e-12)),
            "ce_per_position": (t["ce"] / count).tolist(),
            "accuracy_per_position": acc,
            "predictions_per_position": [int(c) for c in t["count"].tolist()],
            "tau_expected": expected_acceptance_length(acc),
            "tau_blocks": float(1 + t["accept"] / t["blocks"].clamp_min(1)),
            "full_blocks": int(t["blocks"]),
        }


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


#: How long a collective waits for the other ranks before torch.distributed aborts the job (torch's default for
#: NCCL: 10 min). Rank 0 writes every checkpoint while the other ranks wait at a barrier: at a 27B-class drafter a
#: checkpoint is 21.4 GB (fp32 weights + AdamW moments), 40 s to local NVMe on an H200 node
#: (docs/rehearsal-x2/README.md) but over 10 min to a shared file system below 36 MB/s.
COLLECTIVE_TIMEOUT_S = 3600


def setup_distributed(device_type: str) -> Dist:
    """Initialise torch.distributed from torchrun's environment (nccl on CUDA, gloo on CPU) when WORLD_SIZE > 1,
    with collectives that wait :data:`COLLECTIVE_TIMEOUT_S` for a slow rank."""
    import datetime

    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if world > 1 and not dist.is_initialized():
        if device_type == "cuda":  # bound to this rank's GPU: barriers and collectives know their device
            dist.init_process_group("nccl", timeout=timeout,
                                    device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        else:
            dist.init_process_group("gloo", timeout=timeout)
    if dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Dist()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def build_model_config(index: FeatureIndex, target_dir: Path, drafter_cfg: dict, vocab_size: int):
    """The drafter's ``Qwen3Config`` from the target config, the drafter section and the features' layer ids.

    Raises:
        ValueError: ``drafter.target_layer_ids`` differs from the layer ids the features were extracted at.
    """
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_dir)
    ids = drafter_cfg.get("target_layer_ids")
    if ids is not None and [int(i) for i in ids] != index.layer_ids:
        raise ValueError(f"drafter.target_layer_ids {ids} differ from the features' layer_ids {index.layer_ids} "
                         f"({index.path}); re-extract or fix the config")
    n_feat = num_tapped_layers(None, drafter_cfg.get("num_target_features"), drafter_cfg["num_layers"])
    if ids is None and index.layer_ids != default_target_layer_ids(index.num_target_layers, n_feat):
        log.warning("features were extracted at layers %s, not the default formula's %s; using the features' ids",
                    index.layer_ids, default_target_layer_ids(index.num_target_layers, n_feat))
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception as exc:  # noqa: BLE001 - a target folder without a tokenizer
        log.warning("no tokenizer in %s (%s); mask token falls back to config", target_dir, exc)
        tokenizer = None
    mask_id, why = resolve_mask_token_id(drafter_cfg.get("mask_token_id"), tokenizer, vocab_size)
    log.info("mask token id %d (%s)", mask_id, why)
    return build_drafter_config(
        target_config, num_layers=drafter_cfg["num_layers"], block_size=drafter_cfg["block_size"],
        target_layer_ids=index.layer_ids, mask_token_id=mask_id, vocab_size=vocab_size,
        layer_types=drafter_cfg.get("layer_types"), sliding_window=drafter_cfg.get("sliding_window"),
        is_causal=drafter_cfg.get("is_causal"), intermediate_size=drafter_cfg.get("intermediate_size"),
        num_attention_heads=drafter_cfg.get("num_attention_heads"),
        num_key_value_heads=drafter_cfg.get("num_key_value_heads"), head_dim=drafter_cfg.get("head_dim"),
        rope_theta=drafter_cfg.get("rope_theta"))


def evaluate(model: DFlashDraftModel, batches, embed, head, *, gamma: float, use_target_tokens: bool,
             device: torch.device, autocast, logits_chunk_bytes: int = 1 << 30) -> dict[str, Any]:
    """Held-out metrics over ``batches`` (this rank's share; summed over ranks): loss, CE and accuracy per
    position, ``tau_expected`` (from per-position accuracies) and ``tau_blocks`` (mean accepted prefix + 1 over
    fully supervised blocks)."""
    was_training = model.training
    model.eval()
    metrics = Metrics(model.block_size - 1, device)
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            with autocast():
                out = model.training_forward(batch, embed, head, gamma=gamma, use_target_tokens=use_target_tokens,
                                             logits_chunk_bytes=logits_chunk_bytes)
            metrics.add(out)
    metrics.all_reduce()
    model.train(was_training)
    return metrics.summary()


class _TrainStep(torch.nn.Module):
    """DDP needs ``forward``: this wrapper's forward is the drafter's training forward."""

    def __init__(self, drafter: DFlashDraftModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, embed, head, gamma, use_target_tokens, backend, logits_chunk_bytes):
        return self.drafter.training_forward(batch, embed, head, gamma=gamma, use_target_tokens=use_target_tokens,
                                             backend=backend, logits_chunk_bytes=logits_chunk_bytes)


def _setup_device(threads: int | None) -> tuple[torch.device, Dist]:
    """This process's device (``cuda:LOCAL_RANK`` when CUDA is there), torch.distributed, CPU threads."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads:
        torch.set_num_threads(max(1, int(threads)))
    ranks = setup_distributed(device.type)
    if ranks.world > 1 and threads:
        torch.set_num_threads(max(1, int(threads) // ranks.world))
    return device, ranks


def _optimizer(model: DFlashDraftModel, settings: dict, on_gpu: bool) -> tuple[torch.optim.Optimizer, list]:
    """AdamW over the trainable parameters, weight decay on matrices only; returns ``(optimizer, params)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=settings["lr"],
                                  fused=on_gpu or None)
    return optimizer, params


def _resume(ckpt_dir: Path, fingerprint: str, model: DFlashDraftModel, optimizer: torch.optim.Optimizer,
            device: torch.device, total_steps: int) -> tuple[int, list]:
    """Load the newest valid checkpoint of this run (weights, optimizer, RNG); ``(start step, eval history)``,
    ``(0, [])`` when there is none.

    Raises:
        ValueError: the checkpoint's fingerprint is not the folder's (edited by hand).
    """
    found = load_latest_checkpoint(ckpt_dir)
    if found is None:
        return 0, []
    path, state = found
    if state.get("fingerprint") != fingerprint:
        raise ValueError(f"{path}: its run fingerprint {state.get('fingerprint', '?')[:12]} does not match "
                         f"the folder's {fingerprint[:12]}; the checkpoint folder was edited by hand")
    model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)))
    load_optimizer_tensors(optimizer, load_file(str(path / "optimizer.safetensors"), device=str(device)),
                           state["optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and f"torch_cuda_{device.index or 0}" in rng:
        torch.cuda.set_rng_state(rng[f"torch_cuda_{device.index or 0}"], device)
    log.info("resumed from %s (step %d of %d)", path, int(state["step"]), total_steps)
    return int(state["step"]), list(state.get("history", []))


def whole_layer_graphs_under_ddp() -> None:
    """Compile each drafter layer as one graph under DDP (``torch._dynamo.config.optimize_ddp = False``).

    By default dynamo's DDPOptimizer splits every graph compiled inside DDP's forward into pieces of DDP's bucket
    size (25 MB of parameters), so that the all-reduce of one piece's gradients overlaps the backward of the next
    (torch/_dynamo/backends/distributed.py). The trainer compiles layer by layer: a 27B-class drafter layer (330 M
    parameters) would become ~50 graphs, each fused and partitioned on its own (no fusion across the cuts, and the
    activations at every cut saved for the backward). Layer boundaries already give that overlap: DDP's reducer
    all-reduces a layer's buckets while the layers below it run their backward. Measured before this (2 x H200,
    27B shape, docs/rehearsal-x2/README.md): DDP cost each GPU 7% of its model FLOP/s and 17.3 GiB more memory
    than one process, of which only the persistent gradients (6.4 GiB) were accounted for.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.optimize_ddp = False


def _allow_recompiles() -> None:
    """Compiled flex_attention sees one shape per anchor bucket: let dynamo keep them all."""
    import torch._dynamo.config as dynamo_config

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))


def _log_heldout(writer, metrics: dict, step: int) -> None:
    if writer is not None:
        writer.add_scalar("eval/loss", metrics["loss"], step)
        writer.add_scalar("eval/tau_expected", metrics["tau_expected"], step)
        writer.add_scalar("eval/tau_blocks", metrics["tau_blocks"], step)
        for k, a in enumerate(metrics["accuracy_per_position"], start=1):
            writer.add_scalar(f"eval/accuracy_pos{k:02d}", a, step)
    log.info("step %d held-out: loss %.4f, tau_expected %.3f, tau_blocks %.3f, acc %s", step, metrics["loss"],
             metrics["tau_expected"], metrics["tau_blocks"],
             " ".join(f"{a:.2f}" for a in metrics["accuracy_per_position"]))


def _log_train(writer, summary: dict, step: int, lr: float, grad_norm: float, rates: dict) -> None:
    if writer is not None:
        writer.add_scalar("train/loss", summary["loss"], step)
        writer.add_scalar("train/lr", lr, step)
        writer.add_scalar("train/grad_norm", grad_norm, step)
        writer.add_scalar("train/tokens_per_s", rates["window_tokens_per_s"], step)
        writer.add_scalar("train/model_tflops_per_gpu", rates["model_tflops_per_gpu"], step)
        writer.add_scalar("train/accuracy_pos01", summary["accuracy_per_position"][0], step)


@dataclass
class _TrainItem:
    """A packed training batch and its model FLOPs (:func:`draftsmith.flops.step_flops`, counted on the host by
    the prefetch workers)."""

    batch: PackedBatch
    flops: float

    def pin_memory(self) -> "_TrainItem":
        return _TrainItem(self.batch.pin_memory(), self.flops)


class Throughput:
    """Context tokens and model FLOPs per second, summed over ranks: since the loop started, and over the
    current window (the steps since the last log line; held-out evaluations and checkpoints are left out, so the
    window rate is the training rate once compilation has warmed up).

    The model FLOPs are :func:`draftsmith.flops.step_flops` (PaLM-style MFU: matmuls only, no recomputation);
    ``model_tflops_per_gpu`` divided by the GPU's dense bf16 peak is the MFU.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.t_start = self.t_window = time.time()
        self.tokens = self.window_tokens = 0
        self.window_flops = 0.0

    def add(self, tokens: int, flops: float) -> None:
        self.tokens += tokens
        self.window_tokens += tokens
        self.window_flops += flops

    def skip(self, now: float | None = None) -> None:
        """Start a new window (now, or at ``now``): the time since the last call is not training (evaluation,
        checkpoint)."""
        self.t_window = time.time() if now is None else now
        self.window_tokens, self.window_flops = 0, 0.0

    def rates(self, world: int) -> dict[str, float]:
        """``{"tokens_per_s", "window_tokens_per_s", "model_tflops_per_gpu"}`` over all ranks (a collective under
        torch.distributed), then a new window."""
        now = time.time()
        sums = torch.tensor([self.tokens, self.window_tokens, self.window_flops], dtype=torch.float64,
                            device=self.device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        tokens, window_tokens, window_flops = sums.tolist()
        window_s = max(now - self.t_window, 1e-9)
        out = {"tokens_per_s": tokens / max(now - self.t_start, 1e-9),
               "window_tokens_per_s": window_tokens / window_s,
               "model_tflops_per_gpu": window_flops / window_s / world / 1e12}
        self.skip(now)
        return out


class StepMemory:
    """GPU memory of each phase of one optimizer step: what the step starts with and, per phase, the peak
    allocated during it and what stays allocated after it (GiB, torch's caching-allocator counters).

    The phases are ``forward`` / ``backward`` per micro-batch (``forward.2``, ... when ``grad_accum`` > 1), then
    ``clip`` (gradient norm), ``optimizer`` (AdamW step) and ``zero_grad``. Reading the counters needs no GPU
    sync: allocations are made when the host enqueues the kernels. Each phase resets the allocator's peak, so
    the whole run's peak is carried in :attr:`run_peak` (bytes) and :func:`peak_memory_gib` takes it as a floor.
    Written to trainer_state.json as ``memory_by_phase_gib`` (rank 0's); the question it answers: where DDP's
    extra memory over one process sits (17 GiB per rank at the 27B shape, docs/rehearsal-x2/README.md).

    Args:
        allocated, peak, reset: the counters (default ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` /
            ``reset_peak_memory_stats`` of ``device``), replaceable for tests.
    """

    def __init__(self, device: torch.device | None = None, *, allocated=None, peak=None, reset=None):
        self.allocated = allocated or (lambda: torch.cuda.memory_allocated(device))
        self.peak = peak or (lambda: torch.cuda.max_memory_allocated(device))
        self.reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self.run_peak = 0
        self.phases: dict[str, dict[str, float]] = {}

    def start(self) -> None:
        """Before the step: records what is allocated (weights, optimizer state, DDP buckets) and resets the peak."""
        self.run_peak = max(self.run_peak, self.peak())
        self.phases = {"start": {"allocated_gib": round(self.allocated() / 2 ** 30, 2)}}
        self.reset()

    def mark(self, phase: str) -> None:
        """At the end of ``phase``: its peak and what it left allocated; resets the peak for the next phase."""
        peak = self.peak()
        self.run_peak = max(self.run_peak, peak)
        name, k = phase, 1
        while name in self.phases:
            k += 1
            name = f"{phase}.{k}"
        self.phases[name] = {"peak_gib": round(peak / 2 ** 30, 2), "after_gib": round(self.allocated() / 2 ** 30, 2)}
        self.reset()

    def summary(self) -> str:
        """One log line: ``start 30.1; forward peak 60.2 -> 58.0; ...`` (GiB)."""
        parts = [f"start {self.phases['start']['allocated_gib']:.1f}"] if "start" in self.phases else []
        parts += [f"{k} peak {v['peak_gib']:.1f} -> {v['after_gib']:.1f}" for k, v in self.phases.items()
                  if k != "start"]
        return "; ".join(parts) + " GiB"


def peak_memory_gib(device: torch.device, floor_bytes: int = 0) -> list[float] | None:
    """Peak GPU memory allocated by torch on each rank (GiB, ``torch.cuda.max_memory_allocated``, or
    ``floor_bytes`` when higher: the peak of phases whose counter :class:`StepMemory` reset; rank order);
    None on the CPU. A collective under torch.distributed."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([max(torch.cuda.max_memory_allocated(device), floor_bytes) / 2 ** 30], dtype=torch.float64,
                        device=device)
    every = [peak]
    if dist.is_initialized():
        every = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(every, peak)
    return [round(float(t), 2) for t in every]


@dataclass
class _Data:
    """What the features give the run: the index, the held-out split and the batch plan."""

    index: FeatureIndex
    lengths: list[int]
    train_ids: list[int]
    heldout_ids: list[int]
    truncated: int
    plan: BatchPlan
    use_target_tokens: bool


def _plan_data(index_path: str | os.PathLike, settings: dict, ranks: Dist) -> _Data:
    """Open the features, split off the held-out samples and plan every step's rows (:class:`BatchPlan`).

    Raises:
        ValueError: too few samples for one optimizer step (named with the index path).
    """
    index = FeatureIndex(index_path)
    use_target_tokens = settings["labels"] == "target" and index.has_target_token
    if settings["labels"] == "target" and not index.has_target_token:
        log.warning("train.labels = target but the features have no target_token: training on data tokens")
    train_ids, heldout_ids = split_samples([s.row for s in index.samples], settings["eval_fraction"],
                                           settings["seed"])
    lengths = [s.num_tokens for s in index.samples]
    row_tokens = int(settings["tokens_per_batch"])
    truncated = sum(1 for i in train_ids if lengths[i] > row_tokens)
    log.info("samples: %d = %d train + %d held out; %d train samples longer than tokens_per_batch=%d are cut",
             len(index.samples), len(train_ids), len(heldout_ids), truncated, row_tokens)
    try:
        plan = BatchPlan(lengths, train_ids, row_tokens, seed=settings["seed"], world=ranks.world,
                         grad_accum=settings["grad_accum"], epochs=settings["epochs"], max_steps=settings["max_steps"])
    except ValueError as exc:
        raise ValueError(f"{index_path}: {exc}") from None
    return _Data(index, lengths, train_ids, heldout_ids, truncated, plan, use_target_tokens)


class _TrainingRun:
    """One training run: the frozen target embedding and head, the drafter, its optimizer and checkpoints, the
    batches, and the loop's steps (:meth:`step`, :meth:`log_step`, :meth:`heldout_metrics`, :meth:`checkpoint`).
    Built by :func:`train`, which reads top to bottom."""

    def __init__(self, data: _Data, target_dir: Path, out_dir: Path, settings: dict, drafter_settings: dict,
                 device: torch.device, ranks: Dist):
        self.data, self.out_dir, self.settings, self.device, self.ranks = data, out_dir, settings, device, ranks
        self.on_gpu = device.type == "cuda"
        self.feature_dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.row_tokens = int(settings["tokens_per_batch"])
        self.total_steps = data.plan.total_steps
        self.warmup = int(round(settings["warmup_ratio"] * self.total_steps))

        # the frozen target embedding and LM head (tied: one copy on the device), then the drafter
        embed, head = load_target_embeddings_and_head(target_dir)
        self.config = build_model_config(data.index, target_dir, drafter_settings, embed.shape[0])
        tied = head is embed
        self.embed = embed.to(device=device, dtype=self.feature_dtype)
        self.head = self.embed if tied else head.to(device=device, dtype=self.feature_dtype)
        self.block = self.config.dflash_config["block_size"]
        self.gamma = float(settings["loss_gamma"] or default_loss_gamma(self.block))
        torch.manual_seed(settings["seed"])
        with torch.device(device):  # initialised where it trains: a 27B target's 1.7 B-parameter drafter took 31 s
            self.model = DFlashDraftModel(self.config)  # on one CPU thread before moving
        self.model.train()
        self.optimizer, self.params = _optimizer(self.model, settings, self.on_gpu)

        # one checkpoint folder per run fingerprint: a rerun with the same configuration resumes; a changed one
        # (Snakemake reruns train when its params change) starts fresh and leaves the other run's checkpoints alone
        self.fingerprint = run_fingerprint(drafter_config_dict(self.config), settings, data.index.meta, ranks.world)
        self.ckpt_dir = out_dir / "checkpoints" / f"run-{self.fingerprint[:12]}"
        others = sorted(p.name for p in self.ckpt_dir.parent.glob("run-*") if p != self.ckpt_dir) \
            if self.ckpt_dir.parent.is_dir() else []
        if others and ranks.main:
            log.info("checkpoints of other configurations in %s (not resumed, not deleted): %s",
                     self.ckpt_dir.parent, ", ".join(others))
        self.start_step, self.history = _resume(self.ckpt_dir, self.fingerprint, self.model, self.optimizer, device,
                                                self.total_steps)
        self.n_params = sum(p.numel() for p in self.params)
        # the third step of this run (the optimizer state exists, DDP has rebuilt its buckets) by memory phase
        self.memory = StepMemory(device) if self.on_gpu else None
        self.memory_step = self.start_step + 2
        log.info("drafter: %d layers, hidden %d, %d trainable parameters (%.1f M); block %d, gamma %.3g, labels "
                 "%s; %d steps (%d per epoch, warmup %d), %d process(es) on %s", self.config.num_hidden_layers,
                 self.config.hidden_size, self.n_params, self.n_params / 1e6, self.block, self.gamma,
                 "target tokens" if data.use_target_tokens else "data tokens", self.total_steps,
                 data.plan.steps_per_epoch[0], self.warmup, ranks.world, device)

        # the step: DDP across ranks, compiled layers on a GPU, bf16 autocast
        self.step_model: torch.nn.Module = _TrainStep(self.model)
        # DDP whenever a process group exists: setup_distributed makes one for WORLD_SIZE > 1; bench_train's
        # --ddp-overhead makes a one-process group to measure DDP's own memory and speed cost on one GPU
        self.ddp = dist.is_initialized()
        if self.ddp:
            # gradients as views into DDP's all-reduce buckets: no second copy of them (at a 27B target's drafter
            # on 2 H200s DDP peaked at 79.5 GiB per rank against 62.2 GiB in one process, with and without it)
            self.step_model = torch.nn.parallel.DistributedDataParallel(
                self.step_model, device_ids=[device.index] if self.on_gpu else None, gradient_as_bucket_view=True)
        self.chunk_bytes = int(settings["logits_chunk_mib"]) << 20
        self.model.activation_checkpointing = bool(settings["activation_checkpointing"])
        if settings["compile"] and self.on_gpu:
            if self.ddp:
                whole_layer_graphs_under_ddp()
            for layer in self.model.layers:
                layer.compile()  # in place: state-dict names unchanged
        if self.on_gpu:
            _allow_recompiles()
        self.heldout_rows = pack_rows(data.lengths, data.heldout_ids, self.row_tokens)[ranks.rank::ranks.world] \
            if data.heldout_ids else []
        self.writer = None
        if ranks.main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=self.start_step or None)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.on_gpu else torch.autocast("cpu", enabled=False)

    # -- batches: packed rows; on a GPU a fixed row length and power-of-two anchor buckets, so compiled
    # flex_attention sees few shapes
    def batch_of(self, row: list[tuple[int, int]], seed: int) -> PackedBatch:
        return make_batch(self.data.index, row, num_anchors=self.settings["num_anchors"], seed=seed,
                          feature_dtype=self.feature_dtype,
                          pad_tokens_to=-(-self.row_tokens // 128) * 128 if self.on_gpu else 1,
                          pad_anchors_to=max(1, 128 // self.block) if self.on_gpu else 1,
                          bucket_anchors=self.on_gpu, max_anchors_per_row=self.settings["max_anchors_per_row"],
                          pin_memory=self.on_gpu)

    def train_item(self, item: tuple[int, int, int]) -> _TrainItem:
        """The batch of plan item ``(step, epoch, row)`` and its model FLOPs (runs on a prefetch worker)."""
        _, epoch, r = item
        batch = self.batch_of(self.data.plan.rows(epoch)[r], _seed_of(self.settings["seed"], "anchors", epoch, r))
        return _TrainItem(batch, step_flops(self.model, batch, self.data.use_target_tokens))

    def prefetch(self, items: list, make) -> Prefetcher:
        return Prefetcher(items, make, depth=self.settings["prefetch"], pin=self.on_gpu,
                          workers=self.settings["loader_workers"])

    # -- one optimizer step: micro-batches (DDP all-reduces on the last one), clip, AdamW
    def step(self, step: int, items: Iterator[_TrainItem], throughput: Throughput
             ) -> tuple[Metrics, float, torch.Tensor]:
        """Returns ``(metrics of the step's micro-batches, learning rate, gradient norm before clipping)``; the
        norm stays a device tensor (reading it would wait for the GPU every step)."""
        settings, accum = self.settings, self.settings["grad_accum"]
        lr = settings["lr"] * lr_factor(step, self.total_steps, self.warmup, settings["min_lr_ratio"])
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics = Metrics(self.block - 1, self.device)
        memory = self.memory if step == self.memory_step else None  # one step's memory by phase (GPU)
        mark = memory.mark if memory is not None else lambda phase: None
        if memory is not None:
            memory.start()
        for micro in range(accum):
            item = next(items)
            throughput.add(int((item.batch.doc_ids >= 0).sum()), item.flops)  # on the host: no wait for the GPU
            batch = item.batch.to(self.device, non_blocking=True)
            no_sync = self.ddp and micro < accum - 1
            with self.step_model.no_sync() if no_sync else contextlib.nullcontext(), self.autocast():
                out = self.step_model(batch, self.embed, self.head, self.gamma, self.data.use_target_tokens,
                                      settings["attention"], self.chunk_bytes)
                mark("forward")
                (out.loss / accum).backward()
                mark("backward")
            metrics.add(out)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, settings["grad_clip"])
        mark("clip")
        self.optimizer.step()
        mark("optimizer")
        # under DDP the gradients are views into its buckets: zeroed in place, they stay views (set to None, each
        # backward would allocate them again and DDP copy them into its buckets)
        self.optimizer.zero_grad(set_to_none=not self.ddp)
        mark("zero_grad")
        if memory is not None and self.ranks.main:
            log.info("GPU memory of step %d by phase (rank 0): %s", step + 1, memory.summary())
        return metrics, lr, grad_norm

    def log_step(self, done: int, metrics: Metrics, lr: float, grad_norm: torch.Tensor, throughput: Throughput,
                 bar) -> dict[str, Any]:
        """The training line of step ``done`` (loss, rates) to TensorBoard and the progress bar; returns it."""
        grad_norm = float(grad_norm)
        metrics.all_reduce()
        summary = metrics.summary()
        rates = throughput.rates(self.ranks.world)
        _log_train(self.writer, summary, done, lr, grad_norm, rates)
        flops = f", {rates['model_tflops_per_gpu']:.0f} TFLOP/s/GPU" if self.on_gpu else ""
        bar.set_postfix_str(f"loss {summary['loss']:.4f}, lr {lr:.2e}, {rates['window_tokens_per_s']:,.0f} ctx "
                            f"tok/s{flops}", refresh=False)
        return {"step": done, "loss": summary["loss"], "lr": lr, "grad_norm": grad_norm, **rates}

    def heldout_metrics(self, step: int) -> dict | None:
        """Held-out loss, accuracies and τ (:func:`evaluate`) over every rank's share of the held-out rows."""
        if not self.data.heldout_ids:
            return None

        def heldout_batch(j: int) -> PackedBatch:
            return self.batch_of(self.heldout_rows[j], _seed_of(self.settings["seed"], "heldout", self.ranks.rank, j))

        batches = self.prefetch(list(range(len(self.heldout_rows))), heldout_batch)
        try:
            metrics = evaluate(self.model, batches, self.embed, self.head, gamma=self.gamma,
                               use_target_tokens=self.data.use_target_tokens, device=self.device,
                               autocast=self.autocast, logits_chunk_bytes=self.chunk_bytes)
        finally:
            batches.close()
        metrics["step"] = step
        _log_heldout(self.writer, metrics, step)
        return metrics

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes the checkpoint of ``step`` (:func:`save_checkpoint`; its size and time logged), then
        every rank waits for it."""
        plan = self.data.plan
        if self.ranks.main:
            t0 = time.time()
            path = save_checkpoint(self.ckpt_dir, step, self.model, self.optimizer, {
                "fingerprint": self.fingerprint, "total_steps": self.total_steps,
                "data_position": {"step": step, "epoch": plan.locate(min(step, self.total_steps - 1))[0],
                                  "micro_batches_per_step": plan.per_step},
                "scheduler": {"warmup_steps": self.warmup, "total_steps": self.total_steps,
                              "min_lr_ratio": self.settings["min_lr_ratio"],
                              "lr": self.optimizer.param_groups[0]["lr"]},
                "history": self.history}, keep=int(self.settings["keep_checkpoints"]))
            size = sum(f.stat().st_size for f in path.iterdir())
            log.info("checkpoint %s: %.2f GB in %.1f s", path, size / 1e9, time.time() - t0)
        _barrier()

    def state(self, last: dict, final_eval: dict | None, peak: list[float] | None, wall_s: float) -> dict[str, Any]:
        data = self.data
        return {
            "format": "draftsmith.trainer_state/1", "steps": self.total_steps,
            "steps_per_epoch": data.plan.steps_per_epoch, "world_size": self.ranks.world, "device": str(self.device),
            "samples": {"total": len(data.index.samples), "train": len(data.train_ids),
                        "heldout": len(data.heldout_ids), "train_truncated": data.truncated},
            "rows_skipped_at_epoch_ends": data.plan.skipped_rows, "tokens_per_batch": self.row_tokens,
            "block_size": self.block, "gamma": self.gamma, "labels": "target" if data.use_target_tokens else "data",
            "trainable_parameters": self.n_params, "last_train": last, "peak_memory_gib": peak,
            "memory_by_phase_gib": self.memory.phases if self.memory is not None else None,
            "heldout": final_eval, "history": self.history, "fingerprint": self.fingerprint,
            "resumed_from_step": self.start_step, "wall_s": wall_s,
        }

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def train(index_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
          train_cfg: dict | None = None, drafter_cfg: dict | None = None, *, threads: int | None = None,
          stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train a DFlash drafter; resume automatically from ``<out_dir>/checkpoints``.

    Writes ``<out_dir>/trained/{model.safetensors, config.json, trainer_state.json}`` (trainer_state last),
    checkpoints under ``<out_dir>/checkpoints/``, TensorBoard scalars under ``<out_dir>/tensorboard/``.

    Steps: data (held-out split, batch plan: :func:`_plan_data`) -> the run (frozen target embedding and head,
    drafter, optimizer, resume: :class:`_TrainingRun`) -> the loop (learning rate, micro-batches, clip, step;
    log, held-out evaluation, checkpoint) -> trained/ and trainer_state.json.

    The log line every ``train.log_every`` steps carries the loss, the learning rate, context tokens/s of all
    ranks and model TFLOP/s per GPU (:class:`Throughput`); trainer_state.json keeps the last one
    (``last_train``) and each rank's peak GPU memory (``peak_memory_gib``, GiB).

    Args:
        index_path: ``results/features/index.json``.
        target_dir: the target's HF folder (config, tokenizer, safetensors with embedding / LM head).
        train_cfg / drafter_cfg: the config sections (missing keys take :data:`TRAIN_DEFAULTS` /
            :data:`DRAFTER_DEFAULTS`).
        threads: CPU threads per process (``torch.set_num_threads``).
        stop_after_steps: stop (after checkpointing) once this many steps are done, without writing
            ``trained/`` -- a controlled "kill" for resume tests.

    Returns:
        The trainer state dict (also written to ``trainer_state.json``).

    Raises:
        ValueError: inconsistent features / config (named), too few samples for one optimizer step, or a
            checkpoint from a different configuration in ``checkpoints/``.
    """
    t_start = time.time()
    settings = {**TRAIN_DEFAULTS, **(train_cfg or {})}
    device, ranks = _setup_device(threads)
    data = _plan_data(index_path, settings, ranks)
    run = _TrainingRun(data, Path(target_dir), Path(out_dir), settings, {**DRAFTER_DEFAULTS, **(drafter_cfg or {})},
                       device, ranks)
    end_step = run.total_steps if stop_after_steps is None else min(run.total_steps, stop_after_steps)
    try:
        last = _loop(run, end_step)
        if end_step < run.total_steps:  # stopped early on purpose (tests): checkpoint written, no final outputs
            return {"stopped_at": end_step, "total_steps": run.total_steps}
        return _finish(run, last, time.time() - t_start)
    finally:
        run.close()


def _loop(run: _TrainingRun, end_step: int) -> dict[str, Any]:
    """Steps ``run.start_step .. end_step - 1``: step; every ``log_every`` a log line, every ``eval_every`` the
    held-out metrics, every ``save_every`` (and at the end) a checkpoint. Returns the last log line's values."""
    settings, ranks = run.settings, run.ranks
    items = run.prefetch(list(run.data.plan.items(run.start_step, end_step, ranks.rank)), run.train_item)
    bar = progress(run.total_steps, "train", unit="step", logger=log, initial=run.start_step,
                   disable=not ranks.main, interval=float(settings["progress_interval"]))
    throughput, last = Throughput(run.device), {}
    try:
        batches = iter(items)
        for step in range(run.start_step, end_step):
            metrics, lr, grad_norm = run.step(step, batches, throughput)
            done = step + 1
            if done % settings["log_every"] == 0 or done == end_step:
                last = run.log_step(done, metrics, lr, grad_norm, throughput, bar)
            bar.update(1)
            if done % settings["eval_every"] == 0 and done != run.total_steps:
                heldout = run.heldout_metrics(done)
                if heldout is not None:
                    run.history.append(heldout)
                throughput.skip()
            if done % settings["save_every"] == 0 or done == end_step:
                run.checkpoint(done)
                throughput.skip()
    finally:
        items.close()
        bar.close()
    return last


def _finish(run: _TrainingRun, last: dict, wall_s: float) -> dict[str, Any]:
    """The final held-out metrics, peak memory per rank, ``trained/`` (weights, config) and trainer_state.json
    (written last); returns the state."""
    final_eval = run.heldout_metrics(run.total_steps)
    if final_eval is not None:
        run.history.append(final_eval)
    peak = peak_memory_gib(run.device, run.memory.run_peak if run.memory is not None else 0)
    if peak is not None and run.ranks.main:
        log.info("peak GPU memory per rank: %s GiB", ", ".join(f"{p:.1f}" for p in peak))
    state = run.state(last, final_eval, peak, wall_s)
    if run.ranks.main:
        trained = run.out_dir / "trained"
        run.model.save_pretrained(trained)
        write_json(trained / "trainer_state.json", state)
        log.info("wrote %s (held-out tau_expected %s)", trained,
                 f"{final_eval['tau_expected']:.3f}" if final_eval else "n/a")
    _barrier()
    return state


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.train``: one training process (torchrun starts one per GPU; rule train runs it).

    ``--args`` is JSON ``{"train": {...}, "drafter": {...}}`` (missing keys take the defaults). Resumes from
    ``<out>/checkpoints/`` when a checkpoint of the same configuration is there.
    """
    import argparse

    from draftsmith.io import setup_logging

    parser = argparse.ArgumentParser(prog="python -m draftsmith.train", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", required=True, help="results/features/index.json")
    parser.add_argument("--target", required=True, help="the target's Hugging Face folder")
    parser.add_argument("--out", required=True, help="output folder (results/drafter)")
    parser.add_argument("--args", required=True, help="JSON with the train and drafter config sections")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for all processes together")
    args = parser.parse_args(argv)
    cfg = json.loads(args.args)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, level=logging.INFO if rank == 0 else logging.WARNING)  # the rule tees output to its log
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        train(args.index, args.target, args.out, cfg.get("train"), cfg.get("drafter"), threads=args.threads)
    finally:
        if dist.is_initialized():  # NCCL warns (and may leak) without an explicit teardown
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
