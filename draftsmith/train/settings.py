"""The train stage's settings: the ``train``, ``drafter`` (and in stream mode ``stream``) config keys it reads, frozen.

Fields are exactly the keys :data:`draftsmith.stages.STAGE_KEYS` lists for rule ``train`` (:class:`TrainSettings`)
and rule ``train_phase`` (:class:`TrainPhaseSettings`), output keys first, then runtime keys; defaults come from the
schema (:mod:`draftsmith.settings`). ``scripts/train.py`` / ``scripts/train_phase.py`` build them with
``from_rule`` and hand ``to_dict()`` to ``python -m draftsmith.train --args``, which rebuilds them with
``from_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from draftsmith.gpu import GpuOptions
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.stages import STAGE_KEYS


@dataclass(frozen=True)
class TrainOptions(SectionSettings):
    """The ``train`` section: optimisation, batching and labels (output keys), then checkpoint / eval / log
    cadence, loader and memory switches (runtime keys)."""

    SECTION: ClassVar[str] = "train"
    # output keys: the trained weights depend on them
    gpus: int
    seed: int
    epochs: float
    max_steps: int | None
    lr: float
    weight_decay: float
    warmup_ratio: float
    min_lr_ratio: float
    grad_clip: float
    tokens_per_batch: int
    grad_accum: int
    num_anchors: int
    max_anchors_per_row: int | None
    loss_gamma: float | None
    loss_weighting: str  # exp | dpace
    dpace_alpha: float
    optimizer: str  # adamw | muon
    muon_lr: float | None
    muon_weight_decay: float
    labels: str
    labels_topk: int | None  # labels target_topk: the first k stored tokens (None: all)
    eval_fraction: float
    attention: str
    compile: bool
    selector_loss_weight: float  # DFlash2 drafters only
    selector_stop_gradient: bool  # DFlash2 drafters only
    # runtime keys: how the run goes, not what it trains
    save_every: int
    eval_every: int
    keep_checkpoints: int
    prefetch: int
    log_every: int
    loader_workers: int
    progress_interval: float
    logits_chunk_mib: int
    activation_checkpointing: bool
    time_phases: bool
    profile_steps: int


@dataclass(frozen=True)
class DrafterOptions(SectionSettings):
    """The ``drafter`` section: the drafter's architecture and shape, its tapped target layers and its mask token."""

    SECTION: ClassVar[str] = "drafter"
    init_from: str | None  # a drafter folder to start from (draftsmith.warm_start); None: random initialisation
    num_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...] | None
    num_target_features: int | None
    mask_token_id: int | None
    layer_types: tuple[str, ...] | None
    sliding_window: int | None
    intermediate_size: int | None
    is_causal: bool | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    rope_theta: float | None
    architecture: str  # dflash | dflash2
    conv_kernel_size: int  # the conv_* / selector_* keys: dflash2 only
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclass(frozen=True)
class TrainSettings(StageSettings):
    """Everything the train stage reads: ``settings.train.lr``, ``settings.drafter.block_size``, ..."""

    STAGE: ClassVar[str] = "train"
    train: TrainOptions
    drafter: DrafterOptions
    gpu: GpuOptions


@dataclass(frozen=True)
class StreamOptions(SectionSettings):
    """The ``stream`` keys a phase reads: the slicing of the global plan and the held-out samples kept."""

    SECTION: ClassVar[str] = "stream"
    slices: int
    reuse: int
    heldout_samples: int


@dataclass(frozen=True)
class TrainPhaseSettings(StageSettings):
    """Everything one phase of a stream-mode run reads (rule ``train_phase``): the ``train`` and ``drafter`` keys of
    rule ``train`` plus ``settings.stream``."""

    STAGE: ClassVar[str] = "train_phase"
    train: TrainOptions
    drafter: DrafterOptions
    stream: StreamOptions
    gpu: GpuOptions


#: The ``train`` keys that leave the training trajectory alone (save / eval / log cadence, loader, memory-saving
#: switches: the rule's runtime keys, which Snakemake does not rerun training for either), plus ``gpus``, which
#: enters the run fingerprint as the world size. :func:`draftsmith.train.checkpoint.run_fingerprint` leaves them out.
CADENCE_KEYS: frozenset[str] = frozenset(STAGE_KEYS["train"]["train"]["runtime"]) | {"gpus"}
