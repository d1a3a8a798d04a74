"""train: the DFlash drafter on the extracted target features (single process or torchrun DDP).

Reading order, nanoGPT style: :mod:`.settings` (:class:`TrainSettings`, the ``train`` and ``drafter`` keys),
:mod:`.plan` (held-out split, packed rows, :class:`BatchPlan`, the learning-rate schedule), :mod:`.batches`
(:func:`make_batch` / :func:`pack_documents`: packed rows with document ids and per-document anchors;
:class:`Prefetcher`, a background reader that overlaps reading with compute), :mod:`.model` (the drafter's config
and optimizer), :mod:`.checkpoint` (:func:`save_checkpoint`, :func:`load_latest_checkpoint`, the run fingerprint),
:mod:`.metrics` (:func:`evaluate`: held-out loss, per-position accuracy, expected acceptance length; throughput,
GPU memory), :mod:`.distributed` (torchrun, DDP, compiled layers), :mod:`.trainer`, whose :func:`train` is the
offline run and :class:`Trainer` the pieces and the loop every run shares, and finally :mod:`.phases`, stream mode
(``docs/stream.md``): :func:`train_phase` trains one phase of the global plan on one slice's features,
:func:`train_final` ends the run. ``python -m draftsmith.train`` (:mod:`.__main__`) is one process of any of them;
:mod:`.launch` is the rules' side (lease the GPUs, torchrun, the output to the rule's log).

The batch plan is a pure function of (seed, epoch): epoch ``e`` shuffles the training samples (named by their
tokenized train rows) with seed ``(seed, e)`` and packs them greedily into rows of at most ``tokens_per_batch``
tokens; optimizer step ``s`` of rank ``r`` takes row ``(s_e * accum + m) * world + r`` for micro-batch ``m``
(``s_e`` = step within the epoch, :class:`BatchPlan`); the anchors of a row are drawn from a generator seeded by
(seed, epoch, row). So a resumed run replays exactly the batches an uninterrupted one would see, and "data
position" is the step counter. Stream mode cuts the same plan into phases (:class:`StreamPlan`).

Checkpoints (``<out>/checkpoints/run-<fingerprint>/step-XXXXXXXX/``, one folder per configuration and, offline,
features' content: :func:`run_fingerprint`):
``model.safetensors`` (drafter weights), ``optimizer.safetensors``
(AdamW moments and step counts), ``rng.safetensors`` (torch CPU / CUDA generator states), ``state.json`` (step,
epoch, scheduler, data position, run fingerprint, sha256 of the other files; written last). A folder is
assembled under a temporary name and renamed into place, then ``latest.json`` is replaced atomically; resume
verifies the hashes, so a half-written checkpoint is never accepted. In stream mode every phase of a run shares the
folder; a phase's checkpoints also record the phase and the ``state.json`` sha256 of the checkpoint it started from
(``"phase"``) and the digest of its slice's chunks, and its marker ``<out>/phases/phase-{p}.json``
(:data:`PHASE_FORMAT`) names its last checkpoint. A finished run or phase records its output in
``finished-<run|phase-p>.json`` beside its checkpoints; once that output is gone (Snakemake reruns the job) it starts
fresh instead of resuming (:mod:`.checkpoint`). ``verified-chunks.json`` beside them records the feature chunks the
run verified (sha256, size, mtime_ns): a resume hashes only the chunks that differ from it. A save killed midway
leaves ``.step-XXXXXXXX.tmp-<pid>@<host>``, which the next run removes.
"""

from draftsmith.batch_plan import BatchPlan, StreamPlan, heldout_subset, pack_rows, seed_of, split_samples
from draftsmith.train.batches import (
    Prefetcher,
    TrainItem,
    batch_maker,
    cap_anchors,
    loss_weight,
    make_batch,
    pack_documents,
)
from draftsmith.train.checkpoint import (
    CHECKPOINT_FORMAT,
    load_latest_checkpoint,
    load_optimizer_tensors,
    optimizer_tensors,
    restore,
    resume,
    run_fingerprint,
    save_checkpoint,
    state_sha256,
    verify_checkpoint,
)
from draftsmith.train.distributed import (
    COLLECTIVE_TIMEOUT_S,
    Dist,
    all_reduce_sum,
    barrier,
    prepare_step,
    setup_device,
    setup_distributed,
    whole_layer_graphs_under_ddp,
)
from draftsmith.train.metrics import (
    Metrics,
    StepMemory,
    StepTimes,
    Throughput,
    evaluate,
    expected_acceptance_length,
    peak_memory_gib,
)
from draftsmith.train.model import MuonAdamW, build_model_config, make_optimizer
from draftsmith.train.phases import PHASE_FORMAT, phase_record, read_marker, train_final, train_phase
from draftsmith.train.plan import FeatureMeta, TrainData, lr_factor, plan_data, plan_stream_data
from draftsmith.train.settings import (
    CADENCE_KEYS,
    DrafterOptions,
    StreamOptions,
    TrainOptions,
    TrainPhaseSettings,
    TrainSettings,
)
from draftsmith.train.trainer import NonFiniteError, Trainer, train

__all__ = [
    "BatchPlan", "CADENCE_KEYS", "CHECKPOINT_FORMAT", "COLLECTIVE_TIMEOUT_S", "Dist", "DrafterOptions", "FeatureMeta",
    "Metrics", "MuonAdamW", "NonFiniteError", "PHASE_FORMAT", "Prefetcher", "StepMemory", "StepTimes", "StreamOptions",
    "StreamPlan", "Throughput", "TrainData", "TrainItem", "TrainOptions", "TrainPhaseSettings", "TrainSettings",
    "Trainer", "all_reduce_sum", "barrier", "batch_maker", "build_model_config", "cap_anchors", "evaluate",
    "expected_acceptance_length", "heldout_subset", "load_latest_checkpoint", "load_optimizer_tensors", "loss_weight",
    "lr_factor", "make_batch", "make_optimizer", "optimizer_tensors", "pack_documents", "pack_rows", "peak_memory_gib",
    "phase_record", "plan_data", "plan_stream_data", "prepare_step", "read_marker", "restore", "resume",
    "run_fingerprint", "save_checkpoint", "seed_of", "setup_device", "setup_distributed", "split_samples",
    "state_sha256", "train", "train_final", "train_phase", "verify_checkpoint", "whole_layer_graphs_under_ddp",
]
