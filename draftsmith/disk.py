"""Disk: what the features and the rest of a run write, and whether it fits, checked before any GPU work.

* :func:`bytes_per_token`, :func:`projected_bytes`: the bytes of extracted features (chunk files,
  :mod:`draftsmith.features`);
* :func:`drafter_parameters`, :func:`reserve_bytes`: the disk a run writes besides the features (training
  checkpoints, ``trained/``, ``final/``), from the target's config and the drafter keys (:class:`DrafterSize`);
* :func:`disk_fit` (:class:`DiskFit`): whether the features (whole, or cut into ``stream.slices``) plus that reserve
  fit the free disk, the smallest ``stream.slices`` that does (within those ``train.max_steps`` gives every phase a
  step), and what float8 storage would change; its message is the refusal of extract_plan, stream_plan, disk_plan
  and the extraction shards;
* :func:`measure_room` (:class:`Room`): the free disk where the bytes go, the features' file system and, when it is
  another, the drafter's (the reserve), after removing dead writers' temporaries;
* :func:`free_disk_bytes`, :func:`same_file_system`, :class:`DiskSpaceError`.

Sizes are bytes; messages print GB = 1e9 bytes. Importing this module imports neither torch nor transformers
(:func:`drafter_parameters` imports transformers when it reads a target's config).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from draftsmith.features import DTYPE_BYTES, STORAGE_DTYPES
from draftsmith.settings import SectionSettings
from draftsmith.target_layers import num_tapped_layers

GB = 1e9
FP8 = "float8_e4m3fn"
#: Bytes per weight of ``drafter.export_dtype``.
EXPORT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Bytes per drafter parameter in one training checkpoint: float32 weights and AdamW's two float32 moments.
CHECKPOINT_BYTES_PER_PARAMETER = 12
#: One checkpoint's files besides those tensors: AdamW step counts, RNG states, safetensors headers, state.json.
CHECKPOINT_EXTRA_BYTES = 16 << 20
#: What else a run writes on the same disk (logs, metrics, indexes, reports).
RESERVE_SLACK_BYTES = 256 << 20


class DiskSpaceError(RuntimeError):
    """The projected bytes (times ``extract.disk_headroom``, plus the reserve) exceed the free disk."""


def _storage_bytes(storage_dtype: str) -> int:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"extract.storage_dtype {storage_dtype!r} not in {list(STORAGE_DTYPES)}")
    return DTYPE_BYTES[STORAGE_DTYPES[storage_dtype]]


def bytes_per_token(num_layers: int, hidden: int, storage_dtype: str, target_token: bool, *,
                    target_topk: int = 0) -> int:
    """Bytes one token costs in a chunk file: features (+ fp8 scales) + input id + loss mask
    (+ target token) (+ 6 bytes per each of the target's top ``target_topk``: an int32 id and a float16 log-prob,
    ``extract.store_target_topk``). Example: 5 layers x 5120 in bf16 with target tokens = 51,209 bytes.

    Raises:
        ValueError: a ``storage_dtype`` not in :data:`draftsmith.features.STORAGE_DTYPES`.
    """
    extra = 4 * num_layers if storage_dtype == FP8 else 0
    return (num_layers * hidden * _storage_bytes(storage_dtype) + extra + 4 + 1 + (4 if target_token else 0)
            + 6 * target_topk)


def projected_bytes(num_tokens: int, num_samples: int, num_layers: int, hidden: int,
                    storage_dtype: str, target_token: bool, num_chunks: int = 1, *, target_topk: int = 0) -> int:
    """Projected chunk bytes: tokens x :func:`bytes_per_token` + 16 bytes per sample (offsets,
    sample_index) + ~1 KB of safetensors header per chunk."""
    return (num_tokens * bytes_per_token(num_layers, hidden, storage_dtype, target_token, target_topk=target_topk)
            + 16 * num_samples + 8 * num_chunks + 1024 * num_chunks)


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_disk_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def same_file_system(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` (their nearest existing parents: a folder not made yet goes where its parent is) are
    on one file system (``st_dev``): then one free-space figure holds the bytes written under both."""
    return os.stat(_existing(a)).st_dev == os.stat(_existing(b)).st_dev


@dataclass(frozen=True)
class Room:
    """The free disk where a check's bytes go (:func:`measure_room`).

    Attributes:
        features_where, free_bytes: the folder the features are written under and the free bytes of its file system.
        reserve_where, reserve_free_bytes: the folder the checkpoints and the trained drafter are written under and
            its free bytes, when that is another file system (else None: the features' free bytes hold both).
        leftovers_note: temporaries of writers that may still run under the results folder, which the check could
            not remove (:func:`draftsmith.io.temporaries_note`; ``""`` when none).
    """

    features_where: str
    free_bytes: int
    reserve_where: str | None = None
    reserve_free_bytes: int | None = None
    leftovers_note: str = ""


def measure_room(features_dir: str | os.PathLike, drafter_dir: str | os.PathLike | None = None, *,
                 results_dir: str | os.PathLike | None = None) -> Room:
    """Measure the free disk where a run's bytes go: the features under ``features_dir``, the checkpoints and the
    trained drafter (the reserve) under ``drafter_dir`` (None: with the features), each on its own file system.

    First, under ``results_dir`` (when given: the results folder), the temporaries of writers known dead (their pid
    is not running on this host) are removed, and those of writers that may still run are kept and counted
    (:func:`draftsmith.io.remove_dead_temporaries`, named in the log): what they hold is not free, and the refusal
    says so (:attr:`Room.leftovers_note`).
    """
    from draftsmith.io import remove_dead_temporaries, temporaries_note

    note = ""
    if results_dir is not None and Path(results_dir).is_dir():
        _, kept = remove_dead_temporaries(results_dir, recursive=True, by_age=False, what="disk check")
        note = temporaries_note(kept)
    free = free_disk_bytes(features_dir)
    if drafter_dir is None or same_file_system(features_dir, drafter_dir):
        return Room(str(features_dir), free, leftovers_note=note)
    return Room(str(features_dir), free, str(drafter_dir), free_disk_bytes(drafter_dir), note)


def needed_bytes(feature_bytes: int, headroom: float, reserve: int = 0) -> int:
    """The free disk that ``feature_bytes`` of features need: ``ceil(feature_bytes x headroom) + reserve``
    (``extract.disk_headroom`` covers the features' projection error; the reserve is counted as it is)."""
    return math.ceil(feature_bytes * headroom) + reserve


# --------------------------------------------------------------------------------------------------
# the reserve: checkpoints and the trained drafter


@dataclass(frozen=True)
class DrafterSize:
    """The drafter keys that decide its parameter count and export size.

    ``None`` takes the target's value, as :func:`draftsmith.drafter_config.build_drafter_config` does.

    Attributes:
        num_layers: ``drafter.num_layers``.
        num_taps: the tapped target layers (``len(target_layer_ids)``): the width of the ``fc`` input.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: the ``drafter`` keys.
        export_dtype: ``drafter.export_dtype`` (:data:`EXPORT_DTYPE_BYTES`).
        architecture: ``drafter.architecture`` (``dflash`` or ``dflash2``).
        conv_kernel_size, conv_group_size, selector_rank: the DFlash2 keys (read for ``dflash2`` only).
    """

    num_layers: int
    num_taps: int
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    export_dtype: str = "bfloat16"
    architecture: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 64
    selector_rank: int = 256

    @classmethod
    def from_settings(cls, drafter: Any, num_taps: int) -> DrafterSize:
        """From a stage's ``drafter`` settings (any object with the keys as attributes) and the tap count."""
        return cls(num_layers=int(drafter.num_layers), num_taps=int(num_taps),
                   intermediate_size=drafter.intermediate_size, num_attention_heads=drafter.num_attention_heads,
                   num_key_value_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim,
                   export_dtype=drafter.export_dtype, architecture=drafter.architecture,
                   conv_kernel_size=int(drafter.conv_kernel_size), conv_group_size=int(drafter.conv_group_size),
                   selector_rank=int(drafter.selector_rank))


def _text_config(target: Any, trust_remote_code: bool) -> Any:
    """The decoder config of ``target``: a loaded HF config, or a model folder / config.json path."""
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoConfig

        target = AutoConfig.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    return getattr(target, "text_config", None) or target


def drafter_parameters(target: Any, size: DrafterSize, *, trust_remote_code: bool = False) -> int:
    """The drafter's parameter count, counted from the shapes :class:`draftsmith.modeling.DFlashDraftModel` builds
    for :func:`draftsmith.drafter_config.build_drafter_config`'s config (no model is built).

    Per layer: ``q_proj``/``o_proj`` ``H x heads x head_dim`` each, ``k_proj``/``v_proj`` ``H x kv_heads x
    head_dim`` each, ``q_norm``/``k_norm`` ``head_dim`` each, the MLP ``3 x H x intermediate`` and two norms of
    ``H``; then ``fc`` ``num_taps x H x H``, ``hidden_norm`` and ``norm`` ``H`` each (no biases; the embedding and
    the head are the target's, not the drafter's). DFlash2 (:mod:`draftsmith.modeling_dflash2`) adds per layer two
    convolution pairs of ``2 x K x H`` static kernels and an ``H x 2K(H / group)`` kernel projection each, and the
    candidate selector: two ``vocab x rank`` codebooks and an ``H x rank`` projection (at a 27B target's 248K
    vocabulary and rank 256, 127M parameters: the largest DFlash2 addition).

    Args:
        target: a target model folder, its config.json, or a loaded HF config (its ``text_config`` when multimodal).
        size: the drafter keys; ``None`` ones take the target's value (heads, KV heads, head dim, MLP width).
    """
    cfg = _text_config(target, trust_remote_code)
    hidden = int(cfg.hidden_size)
    heads = int(size.num_attention_heads or cfg.num_attention_heads)
    kv_heads = int(size.num_key_value_heads or getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(size.head_dim or getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads)
    inter = int(size.intermediate_size or cfg.intermediate_size)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim
    layer = attention + 3 * hidden * inter + 2 * hidden
    selector = 0
    if size.architecture == "dflash2":
        k, groups = int(size.conv_kernel_size), hidden // int(size.conv_group_size)
        layer += 2 * (2 * k * hidden + hidden * 2 * k * groups)  # attention_conv and mlp_conv
        selector = 2 * int(cfg.vocab_size) * int(size.selector_rank) + hidden * int(size.selector_rank)
    return size.num_layers * layer + size.num_taps * hidden * hidden + 2 * hidden + selector


def reserve_bytes(target: Any, size: DrafterSize, *, keep_checkpoints: int, reserve_gb: float | None = None,
                  trust_remote_code: bool = False) -> int:
    """The disk a training run writes besides the features (the reserve the disk checks keep free).

    ``stream.reserve_gb`` (not None) replaces the computed figure: ``reserve_gb x 1e9``. Otherwise, with P =
    :func:`drafter_parameters`: ``keep_checkpoints + 2`` checkpoints of ``12 P`` bytes (float32 weights and two AdamW
    moments) + :data:`CHECKPOINT_EXTRA_BYTES` each (+2: the one being written before the oldest is deleted, and a
    phase-boundary one in stream mode), ``trained/`` (``4 P``, float32), ``final/`` (P x the export dtype's bytes)
    and :data:`RESERVE_SLACK_BYTES`.

    Args:
        target: see :func:`drafter_parameters` (not read when ``reserve_gb`` is given).
        keep_checkpoints: ``train.keep_checkpoints``.
        reserve_gb: ``stream.reserve_gb``.

    Raises:
        ValueError: an unknown ``export_dtype``, a negative ``reserve_gb``.
    """
    if reserve_gb is not None:
        if reserve_gb < 0:
            raise ValueError(f"stream.reserve_gb must be >= 0, got {reserve_gb}")
        return int(round(reserve_gb * GB))
    if size.export_dtype not in EXPORT_DTYPE_BYTES:
        raise ValueError(f"drafter.export_dtype {size.export_dtype!r} not in {list(EXPORT_DTYPE_BYTES)}")
    params = drafter_parameters(target, size, trust_remote_code=trust_remote_code)
    checkpoint = CHECKPOINT_BYTES_PER_PARAMETER * params + CHECKPOINT_EXTRA_BYTES
    return ((int(keep_checkpoints) + 2) * checkpoint + 4 * params + EXPORT_DTYPE_BYTES[size.export_dtype] * params
            + RESERVE_SLACK_BYTES)


# --------------------------------------------------------------------------------------------------
# what fits


@dataclass(frozen=True)
class DiskFit:
    """Whether the features of a run fit the free disk beside the reserve, and what would (:func:`disk_fit`).

    Attributes:
        num_tokens, num_samples: the whole data's (one pass over it).
        storage_dtype, bytes_per_token, feature_bytes: the configured storage and its projection of all features.
        slices, slices_on_disk: ``stream.slices`` (1 = offline) and ``stream.slices_on_disk``.
        on_disk_bytes: the features on disk at once: ``ceil(feature_bytes / slices) x min(slices_on_disk, slices)``.
        headroom: ``extract.disk_headroom`` (multiplies the features).
        reserve_bytes: :func:`reserve_bytes`; kept_bytes: features kept for the whole run (the held-out ones in
            stream mode).
        free_bytes, where: the free disk and the folder it was measured under (where the features go).
        reserve_free_bytes, reserve_where: the free disk where the reserve goes (the checkpoints and the trained
            drafter), when that is another file system than the features'; None when one file system holds both.
        needed_bytes: ``ceil(on_disk_bytes x headroom) + kept_bytes``, plus ``reserve_bytes`` on one file system;
            fits: ``needed <= free`` (and, on another file system, ``reserve_bytes <= reserve_free_bytes``).
        min_slices: the smallest ``stream.slices`` (1 = offline) whose slices fit, at ``slices_on_disk``; None when
            none does (the reserve alone exceeds the free disk, or one sample per slice does not fit).
        fp8_bytes_per_token, fp8_feature_bytes, fp8_min_slices: the same with ``extract.storage_dtype:
            float8_e4m3fn``.
        max_slices, steps_note: the largest ``stream.slices`` whose phases all get an optimizer step with
            ``train.max_steps`` (:func:`draftsmith.batch_plan.max_stream_slices`; None: not known here, or no
            limit) and how it was counted (``"about 40 steps a pass, train.max_steps 60"``). Advice never names
            more slices than that.
        leftovers_note: temporaries the check could not remove (:class:`Room`).
    """

    num_tokens: int
    num_samples: int
    storage_dtype: str
    bytes_per_token: int
    feature_bytes: int
    slices: int
    slices_on_disk: int
    on_disk_bytes: int
    headroom: float
    reserve_bytes: int
    kept_bytes: int
    free_bytes: int
    where: str
    needed_bytes: int
    min_slices: int | None
    fp8_bytes_per_token: int
    fp8_feature_bytes: int
    fp8_min_slices: int | None
    reserve_free_bytes: int | None = None
    reserve_where: str | None = None
    max_slices: int | None = None
    steps_note: str = ""
    leftovers_note: str = ""

    @property
    def reserve_fits(self) -> bool:
        """The reserve fits its own file system (always True when it shares the features')."""
        return self.reserve_free_bytes is None or self.reserve_bytes <= self.reserve_free_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes and self.reserve_fits

    def message(self) -> str:
        """What the features need, what is free, and what fits: the smallest ``stream.slices`` (within what
        ``train.max_steps`` allows) and float8 storage."""
        layout = ("all on disk at once" if self.slices == 1 else
                  f"{min(self.slices_on_disk, self.slices)} of stream.slices {self.slices} on disk at once "
                  f"({math.ceil(self.feature_bytes / self.slices) / GB:.3f} GB a slice)")
        kept = f" and {self.kept_bytes / GB:.3f} GB of kept features" if self.kept_bytes else ""
        features = (f"the features need {self.feature_bytes / GB:.3f} GB ({self.num_tokens} tokens x "
                    f"{self.bytes_per_token} bytes a token in {self.storage_dtype}); {layout}, x headroom "
                    f"{self.headroom} = {math.ceil(self.on_disk_bytes * self.headroom) / GB:.3f} GB")
        verdict = "fits" if self.fits else "does not fit"
        if self.reserve_free_bytes is None:
            text = (f"{features}, plus a reserve of {self.reserve_bytes / GB:.3f} GB for checkpoints and the trained "
                    f"drafter{kept} = {self.needed_bytes / GB:.3f} GB, with {self.free_bytes / GB:.3f} GB free under "
                    f"{self.where}: {verdict}. ")
        else:
            text = (f"{features}{kept} = {self.needed_bytes / GB:.3f} GB, with {self.free_bytes / GB:.3f} GB free "
                    f"under {self.where}; a reserve of {self.reserve_bytes / GB:.3f} GB for checkpoints and the "
                    f"trained drafter, with {self.reserve_free_bytes / GB:.3f} GB free under {self.reserve_where} "
                    f"(another file system): {verdict}. ")
        advice = self._advice(self.min_slices, "")
        text += advice[0].upper() + advice[1:]
        if self.storage_dtype != FP8:
            text += (f" With extract.storage_dtype: {FP8} ({self.fp8_bytes_per_token} bytes a token, "
                     f"{self.fp8_feature_bytes / GB:.3f} GB in all): " + self._advice(self.fp8_min_slices, "fp8"))
        return text + self.leftovers_note

    def _advice(self, min_slices: int | None, kind: str) -> str:
        if not self.reserve_fits:
            return (f"the reserve alone exceeds the free disk under {self.reserve_where}: free disk space there, "
                    "lower train.keep_checkpoints or set stream.reserve_gb.")
        room = self.free_bytes - self.kept_bytes - (self.reserve_bytes if self.reserve_free_bytes is None else 0)
        if min_slices is None and room <= 0:
            return ("the reserve alone exceeds the free disk: free disk space, lower train.keep_checkpoints or set "
                    "stream.reserve_gb." if self.reserve_free_bytes is None else
                    "the kept features alone exceed the free disk: free disk space or lower stream.heldout_samples.")
        if min_slices is None:
            return f"no stream.slices fits{' either' if kind else ''} (one sample per slice does not)."
        if self.max_slices is not None and min_slices > max(1, self.max_slices):
            limit = (f"at most {self.max_slices} give every phase an optimizer step" if self.max_slices > 1 else
                     "no stream.slices above 1 gives every phase an optimizer step")
            return (f"the smallest stream.slices that fits is {min_slices}, but with {self.steps_note}, {limit}: "
                    "raise train.max_steps (or unset it), lower train.epochs, or free disk space.")
        sod = f" with stream.slices_on_disk {self.slices_on_disk}" if min_slices > 1 else " (offline)"
        steps = (f" ({self.steps_note}: up to {self.max_slices} slices give every phase an optimizer step)"
                 if min_slices > 1 and self.max_slices is not None and self.steps_note else "")
        return f"the smallest stream.slices that fits is {min_slices}{sod}{steps}."

    def check(self) -> DiskFit:
        """``self`` when it fits.

        Raises:
            DiskSpaceError: it does not (the :meth:`message`).
        """
        if not self.fits:
            raise DiskSpaceError(self.message())
        return self


def _on_disk(feature_bytes: int, slices: int, slices_on_disk: int) -> int:
    return math.ceil(feature_bytes / slices) * min(slices_on_disk, slices)


def _min_slices(feature_bytes: int, num_samples: int, room: int, headroom: float, slices_on_disk: int) -> int | None:
    """The smallest slice count s in 1..num_samples with ``ceil(on_disk(s) x headroom) <= room``, else None."""
    def fits(s: int) -> bool:
        return needed_bytes(_on_disk(feature_bytes, s, slices_on_disk), headroom) <= room

    if room < 0:
        return None
    if fits(1):
        return 1
    per_slice = math.floor(room / (headroom * slices_on_disk))  # bytes a slice may hold
    s = max(2, slices_on_disk, math.ceil(feature_bytes / per_slice) if per_slice > 0 else num_samples + 1)
    while s <= num_samples and not fits(s):  # ceil rounding: a step or two at most
        s += 1
    return s if s <= max(num_samples, 1) else None


def disk_fit(*, num_tokens: int, num_samples: int, num_layers: int, hidden_size: int, storage_dtype: str,
             target_token: bool, free_bytes: int, reserve_bytes: int, headroom: float, slices: int = 1,
             slices_on_disk: int = 1, kept_bytes: int = 0, where: str | os.PathLike = "the results folder",
             room: Room | None = None, max_slices: int | None = None, steps_note: str = "",
             target_topk: int = 0) -> DiskFit:
    """Whether the features of ``num_tokens`` tokens (``num_samples`` samples) fit the free disk beside the reserve,
    whole (``slices`` 1, the offline mode) or cut into ``slices`` slices of which ``slices_on_disk`` are on disk at
    once, and the smallest ``stream.slices`` that fits, in the configured storage and in float8.

    A slice is taken as ``1 / slices`` of the features (slices cut the steps of a pass evenly, so their tokens are
    about equal); it fits when ``ceil(slice x min(slices_on_disk, slices) x headroom) + reserve + kept <= free``.
    ``slices`` above ``num_samples`` are never proposed.

    Used by extract_plan (``slices`` 1: the offline features), stream_plan (the configured slicing), disk_plan (the
    expected and the upper size before regeneration) and the extraction shards' refusals:
    ``disk_fit(...).check()`` refuses with :meth:`DiskFit.message`.

    Args:
        num_tokens, num_samples: one pass over the training data (held-out samples kept apart: ``kept_bytes``).
        num_layers, hidden_size, storage_dtype, target_token, target_topk: the tapped layers n, the target's H,
            ``extract.storage_dtype``, ``extract.store_target_tokens``, ``extract.store_target_topk``
            (:func:`bytes_per_token`).
        free_bytes: :func:`free_disk_bytes` of the results folder; reserve_bytes: :func:`reserve_bytes`.
        headroom: ``extract.disk_headroom``; slices, slices_on_disk: ``stream.slices`` / ``stream.slices_on_disk``.
        kept_bytes: features on disk for the whole run besides the slices (the held-out features).
        where: the folder ``free_bytes`` was measured under (named in the message).
        room: :func:`measure_room`'s measure; when given it replaces ``free_bytes`` and ``where``, and a reserve on
            another file system is held to that one's free bytes.
        max_slices, steps_note: the largest ``stream.slices`` ``train.max_steps`` allows and how it was counted
            (:class:`DiskFit`); the advice stays within it.

    Raises:
        ValueError: an unknown storage dtype, ``slices`` or ``slices_on_disk`` < 1.
    """
    if slices < 1 or slices_on_disk < 1:
        raise ValueError(f"stream.slices ({slices}) and stream.slices_on_disk ({slices_on_disk}) must be >= 1")
    if room is not None:
        free_bytes, where = room.free_bytes, room.features_where
    separate = room is not None and room.reserve_free_bytes is not None
    features = projected_bytes(num_tokens, num_samples, num_layers, hidden_size, storage_dtype, target_token,
                               target_topk=target_topk)
    fp8 = projected_bytes(num_tokens, num_samples, num_layers, hidden_size, FP8, target_token, target_topk=target_topk)
    here = kept_bytes + (0 if separate else reserve_bytes)  # what the features' file system holds besides them
    space = free_bytes - here
    on_disk = _on_disk(features, slices, slices_on_disk)
    return DiskFit(
        num_tokens=num_tokens, num_samples=num_samples, storage_dtype=storage_dtype,
        bytes_per_token=bytes_per_token(num_layers, hidden_size, storage_dtype, target_token, target_topk=target_topk),
        feature_bytes=features, slices=slices, slices_on_disk=slices_on_disk, on_disk_bytes=on_disk,
        headroom=headroom, reserve_bytes=reserve_bytes, kept_bytes=kept_bytes, free_bytes=free_bytes,
        where=str(where), needed_bytes=needed_bytes(on_disk, headroom, here),
        min_slices=_min_slices(features, num_samples, space, headroom, slices_on_disk),
        fp8_bytes_per_token=bytes_per_token(num_layers, hidden_size, FP8, target_token, target_topk=target_topk),
        fp8_feature_bytes=fp8,
        fp8_min_slices=_min_slices(fp8, num_samples, space, headroom, slices_on_disk),
        reserve_free_bytes=room.reserve_free_bytes if separate else None,
        reserve_where=room.reserve_where if separate else None, max_slices=max_slices, steps_note=steps_note,
        leftovers_note=room.leftovers_note if room is not None else "")


@dataclass(frozen=True)
class PlanDrafterOptions(SectionSettings):
    """The ``drafter`` keys that decide the tapped layers (:func:`draftsmith.extract.resolve_layer_ids`), and those
    that size the drafter's checkpoints for the disk reserve (:class:`DrafterSize`); read by extract_plan, disk_plan,
    stream_plan and extract_slice.

    ``num_target_features`` holds the effective count: with neither it nor ``target_layer_ids`` set,
    :meth:`from_mapping` takes it from ``drafter.num_layers`` (:func:`draftsmith.target_layers.num_tapped_layers`),
    the value the workflow passes as the rule's param (:mod:`draftsmith.stages`).
    """

    SECTION: ClassVar[str] = "drafter"
    target_layer_ids: tuple[int, ...] | None
    num_target_features: int | None
    num_layers: int
    intermediate_size: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    export_dtype: str
    architecture: str
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int

    @classmethod
    def from_mapping(cls, values: Any = None, **overrides: Any) -> PlanDrafterOptions:
        given = {**(values or {}), **overrides}
        if given.get("target_layer_ids") is None and given.get("num_target_features") is None:
            given["num_target_features"] = num_tapped_layers(None, None, given.get("num_layers"))
        return super().from_mapping(given)
