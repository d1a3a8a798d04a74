"""The training run, top to bottom: :func:`train` (offline: one index holds every sample) and :class:`Trainer`, the
pieces every run shares. Stream mode's phases (:mod:`~draftsmith.train.phases`) run the same loop over a step range
of the global plan.

Data (:mod:`~draftsmith.train.plan`) -> the frozen target embedding and head, the drafter, AdamW (:class:`Trainer`),
resume (:mod:`~draftsmith.train.checkpoint`) -> the loop (:meth:`Trainer.train_steps`: learning rate, micro-batches,
clip, step; log, held-out evaluation, checkpoint) -> ``trained/`` and ``trainer_state.json``
(:meth:`Trainer.final_outputs`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from draftsmith.batch_plan import pack_rows, seed_of
from draftsmith.drafter_config import default_loss_gamma, drafter_config_dict
from draftsmith.features import FeatureIndex, verify_chunk_sha256
from draftsmith.flops import step_flops
from draftsmith.io import save_pretrained_atomic, write_json
from draftsmith.modeling_dflash2 import DFlash2DraftModel, model_class_for
from draftsmith.progress import progress
from draftsmith.target import load_target_embeddings_and_head
from draftsmith.train.batches import Prefetcher, TrainItem, batch_maker, loss_weight
from draftsmith.train.checkpoint import (
    checkpoint_steps,
    chunks_to_verify,
    mark_finished,
    other_runs,
    read_finished,
    read_verified,
    record_verified,
    remove_checkpoints,
    remove_dead_saves,
    resume,
    run_fingerprint,
    save_checkpoint,
)
from draftsmith.train.distributed import Dist, all_reduce_sum, barrier, prepare_step, setup_device
from draftsmith.train.metrics import (
    Metrics,
    StepMemory,
    StepTimes,
    Throughput,
    evaluate,
    log_heldout,
    log_train_step,
    peak_memory_gib,
)
from draftsmith.train.model import build_model_config, make_optimizer, optimizer_summary, start_model_config
from draftsmith.train.plan import TrainData, lr_factor, plan_data, plan_summary
from draftsmith.train.profile import StepProfiler, profile_window
from draftsmith.train.settings import TrainPhaseSettings, TrainSettings
from draftsmith.warm_start import load_start_weights, start_digest

log = logging.getLogger("draftsmith.train")


class NonFiniteError(RuntimeError):
    """A training step's loss or gradient norm is not finite (:meth:`Trainer.check_finite`): the message names the
    step, the rows and the checkpoint kept. ``python -m draftsmith.train`` exits 1 with it."""


def train(index_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
          settings: TrainSettings, *, threads: int | None = None,
          stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train a DFlash drafter; resume automatically from ``<out_dir>/checkpoints``.

    The checkpoint folder is the run fingerprint's (settings and the features' content,
    :func:`~draftsmith.train.checkpoint.run_fingerprint`). An interrupted run resumes from its newest checkpoint; a
    finished run whose ``trained/trainer_state.json`` is gone (Snakemake removed it to rerun train) starts fresh.
    A fresh start first verifies every chunk file against the sha256 the index records (a rerun of a finished run
    before its checkpoints are removed); a resume hashes the chunks whose size or mtime changed since this run
    verified them (:meth:`Trainer.verify_features`).

    Writes ``<out_dir>/trained/{model.safetensors, config.json, trainer_state.json}`` (trainer_state last),
    checkpoints under ``<out_dir>/checkpoints/``, TensorBoard scalars under ``<out_dir>/tensorboard/``.

    The log line every ``train.log_every`` steps carries the loss, the learning rate, context tokens/s of all
    ranks and model TFLOP/s per GPU (:class:`~draftsmith.train.metrics.Throughput`); trainer_state.json keeps the
    last one (``last_train``) and each rank's peak GPU memory (``peak_memory_gib``, GiB).

    Args:
        index_path: ``results/features/index.json``.
        target_dir: the target's HF folder (config, tokenizer, safetensors with embedding / LM head).
        settings: the ``train`` and ``drafter`` keys (:class:`~draftsmith.train.settings.TrainSettings`).
        threads: CPU threads for all processes together (``torch.set_num_threads``).
        stop_after_steps: stop (after checkpointing) once this many steps are done, without writing
            ``trained/`` -- a controlled "kill" for resume tests.

    Returns:
        The trainer state dict (also written to ``trainer_state.json``), or ``{"stopped_at", "total_steps"}``
        when ``stop_after_steps`` stopped the run early.

    Raises:
        ValueError: inconsistent features / config (named), too few samples for one optimizer step, a checkpoint
            from a different configuration in ``checkpoints/``, or a chunk file whose sha256 is not the index's
            (the checkpoints kept).
        NonFiniteError: a step's loss or gradient norm is not finite (:meth:`Trainer.check_finite`: the step and
            its rows named; the newest checkpoint is the last good state).
    """
    t_start = time.time()
    device, ranks = setup_device(threads)

    # -- data: the features, the held-out split, the rows of every optimizer step
    data = plan_data(index_path, settings.train, ranks.world)
    # -- model: the frozen target embedding and head, the drafter, AdamW
    run = Trainer(data, target_dir, out_dir, settings, device, ranks)

    # -- resume: one checkpoint folder per run fingerprint (settings and the features' content). A changed
    # configuration or dataset starts fresh and leaves the other run's checkpoints alone; the same one resumes when
    # it was interrupted, and starts fresh when it finished and Snakemake reruns it (its output is gone)
    run.use_checkpoints(run_fingerprint(drafter_config_dict(run.config), settings.train, data.index.meta,
                                        ranks.world, start=run.start_digest))
    # the features are verified before anything of a finished run that is rerun is removed: a damaged chunk stops
    # the rerun with the finished run's checkpoints in place
    rerun = run.rerun_of_finished("run")
    if rerun:
        run.verify_features(data.index, full=True, rerun=True)
    finished = run.restart_finished("run")
    start_step, run.history, resumed = resume(run.ckpt_dir, run.fingerprint, run.model, run.optimizer, device,
                                              run.total_steps)
    if start_step == 0 and ranks.main:
        log.info("run %s: starting fresh", run.ckpt_dir)
    elif ranks.main and start_step == run.total_steps:
        log.info("%s at step %d%s: nothing left to train; writing trained/ again", "previous run finished" if finished
                 else "resuming interrupted run", start_step, " and its output is in place" if finished else "")
    if not rerun:  # a fresh start hashes every chunk; a resume those changed since this run verified them
        run.verify_features(data.index, full=start_step == 0, resuming=start_step or None)
    run.start(start_step, f"{data.plan.steps_per_epoch[0]} per epoch")
    run.restore_measurements(resumed)

    # -- the loop: steps start_step .. end_step - 1, then the final held-out metrics and trained/
    end_step = run.total_steps if stop_after_steps is None else min(run.total_steps, stop_after_steps)
    try:
        run.train_steps(start_step, end_step)
        if end_step < run.total_steps:  # stopped early on purpose (tests): checkpoint written, no final outputs
            return {"stopped_at": end_step, "total_steps": run.total_steps}
        state = run.final_outputs(t_start, resumed_from_step=start_step)
        if ranks.main:  # after trained/: its checkpoints are no point to resume from once trained/ is gone
            mark_finished(run.ckpt_dir, "run", run.ckpt_dir / f"step-{run.total_steps:08d}",
                          run.out_dir / "trained" / "trainer_state.json")
        return state
    finally:
        run.close()


class Trainer:
    """One process's share of a training run over ``data``'s plan.

    Construction loads the frozen target embedding and LM head (tied: one copy on the device) and builds the
    drafter (seeded by ``train.seed``) and AdamW. Then: :meth:`use_checkpoints` (the run fingerprint names the
    checkpoint folder), a resume into :attr:`model` / :attr:`optimizer` / :attr:`history`, :meth:`start` (the
    step's module, the batch makers, TensorBoard), the loop :meth:`train_steps`, :meth:`heldout_metrics`,
    :meth:`final_outputs` (``trained/``), and :meth:`close`.

    Attributes:
        plan / total_steps / warmup: the batch plan (:class:`~draftsmith.batch_plan.BatchPlan` offline,
            :class:`~draftsmith.batch_plan.StreamPlan` in stream mode), its optimizer steps, the warmup steps.
        history: the held-out metrics of the run so far (restored from checkpoints).
        last: the last training log line's metrics (``{}`` before the first).
        evals: the held-out metrics computed by this process's :meth:`train_steps` calls.
    """

    def __init__(self, data: TrainData, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 settings: TrainSettings | TrainPhaseSettings, device: torch.device, ranks: Dist):
        cfg = settings.train
        self.data, self.cfg, self.device, self.ranks = data, cfg, device, ranks
        self.out_dir = Path(out_dir)
        self.on_gpu = device.type == "cuda"
        self.feature_dtype = torch.bfloat16 if self.on_gpu else torch.float32
        self.plan, self.total_steps = data.plan, data.plan.total_steps
        self.warmup = int(round(cfg.warmup_ratio * self.total_steps))

        embed, head = load_target_embeddings_and_head(Path(target_dir))
        #: drafter.init_from: the folder the drafter starts from (its config is the drafter's) and its digest
        self.start_dir = settings.drafter.init_from
        self.start_digest = None
        if self.start_dir:
            self.config = start_model_config(data.features, Path(target_dir), settings.drafter, embed.shape[0])
            self.start_digest = start_digest(self.start_dir)
        else:
            self.config = build_model_config(data.features, Path(target_dir), settings.drafter, embed.shape[0])
        tied = head is embed
        self.embed = embed.to(device=device, dtype=self.feature_dtype)
        self.head = self.embed if tied else head.to(device=device, dtype=self.feature_dtype)
        self.block = self.config.block_size
        self.gamma = float(cfg.loss_gamma or default_loss_gamma(self.block))
        # D-PACE's smoothing when the slots are weighted by the drafter's confidence, None for the fixed decay
        self.dpace_alpha = float(cfg.dpace_alpha) if cfg.loss_weighting == "dpace" else None
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # initialised where it trains: a large drafter built on one CPU thread is slow
            self.model = model_class_for(self.config.architectures)(self.config)
        if self.start_dir:  # the start's weights, exactly (a resumed checkpoint replaces them later)
            loaded = load_start_weights(self.model, self.start_dir)
            if ranks.main:
                log.info("drafter starts from %s (digest %s): %d tensors (%s in the file, now %s)%s", self.start_dir,
                         self.start_digest[:12], loaded["tensors"], ", ".join(loaded["dtypes"]),
                         str(next(self.model.parameters()).dtype).replace("torch.", ""),
                         "; read " + ", ".join(f"{a} as {b}" for a, b in loaded["aliases"].items())
                         if loaded["aliases"] else "")
        self.model.train()
        self.selector = isinstance(self.model, DFlash2DraftModel)  # DFlash2: the selector's metrics too
        self.optimizer, self.params = make_optimizer(self.model, cfg, self.on_gpu)
        self.fingerprint, self.ckpt_dir = "", self.out_dir / "checkpoints"
        self.history: list[dict] = []
        self.last: dict[str, Any] = {}
        self.evals: list[dict] = []
        self.writer = None

    def use_checkpoints(self, fingerprint: str) -> None:
        """Checkpoint under ``<out>/checkpoints/run-<fingerprint[:12]>/``. Rank 0 first removes the temporary folders
        of saves killed midway in every run folder (:func:`~draftsmith.train.checkpoint.remove_dead_saves`, named in
        the log). Other runs' folders (other settings or data) are left alone, to resume if the config goes back; a
        warning names them and the bytes they hold (:func:`~draftsmith.train.checkpoint.other_runs`), which no disk
        check counts as free."""
        self.fingerprint = fingerprint
        self.ckpt_dir = self.out_dir / "checkpoints" / f"run-{fingerprint[:12]}"
        if self.ranks.main:  # saves killed midway leave their temporary folders (a checkpoint's size each)
            remove_dead_saves(self.ckpt_dir.parent)
        barrier()
        others = other_runs(self.ckpt_dir)
        if others and self.ranks.main:
            held = sum(others.values())
            log.warning("%d checkpoint folder(s) of other configurations or data hold %.2f GB in %s (kept to resume "
                        "if the config goes back; delete those you will not): %s", len(others), held / 1e9,
                        self.ckpt_dir.parent, ", ".join(f"{name} {size / 1e9:.2f} GB" for name, size in others.items()))

    def restart_finished(self, name: str, steps: Collection[int] | None = None) -> bool:
        """Start ``name`` (``"run"``, ``"phase-<p>"``) afresh when it finished and is rerun: its record
        (:func:`~draftsmith.train.checkpoint.read_finished`) names an output that is gone, and Snakemake removes a
        job's outputs before running it (``--forcerun``; or an input that changed without changing the run
        fingerprint), so its final checkpoint is no point to resume from: rank 0 removes its checkpoints at
        ``steps`` (None: all) and the record. Every rank reads the record before any removes it. An interrupted
        run has no record and resumes. Returns whether it finished with its output still in place (a direct call
        on a finished run: nothing to train)."""
        record, in_place = read_finished(self.ckpt_dir, name)
        barrier()
        if record is not None and not in_place and self.ranks.main:
            removed = remove_checkpoints(self.ckpt_dir, name, steps)
            log.info("previous %s finished at step %s and its output %s is gone (Snakemake removes a rule's outputs "
                     "before rerunning it); starting fresh (removed its checkpoints at steps %s)",
                     name.replace("-", " "), record.get("step"), record.get("output"), removed or "none")
        barrier()
        return record is not None and in_place

    def rerun_of_finished(self, name: str) -> bool:
        """Whether ``name`` (``"run"``, ``"phase-<p>"``) finished and is rerun (its record names an output that is
        gone: :meth:`restart_finished` will remove its checkpoints). Reads only."""
        record, in_place = read_finished(self.ckpt_dir, name)
        return record is not None and not in_place

    def verify_features(self, index: FeatureIndex, *, full: bool, resuming: int | None = None,
                        rerun: bool = False) -> None:
        """Before training on ``index``: its chunk files against the sha256 the index records, this rank's share on
        torch's CPU threads (:func:`~draftsmith.features.verify_chunk_sha256`), before anything of a finished run is
        removed.

        ``full`` (a fresh start) hashes every chunk; otherwise only the chunks whose size or mtime differ from the
        run's record of the chunks it verified (:func:`~draftsmith.train.checkpoint.chunks_to_verify`; a chunk
        never verified by this run has no entry), so a resume costs a ``stat`` per unchanged chunk. Rank 0 then
        records every chunk as verified (``<checkpoint folder>/verified-chunks.json``: sha256, size, mtime_ns).

        Raises:
            ValueError: a chunk whose sha256 is not the index's (the index, the chunk, its file and both digests
                named); ``resuming`` (the step resumed from) or ``rerun`` (a finished run rerun) add that the run's
                checkpoints are kept and what to do.
        """
        t0 = time.time()
        record = read_verified(self.ckpt_dir)  # kept for the other indexes' chunks (a slice, the held-out features)
        todo, entries = chunks_to_verify(index, record, full=full)
        try:
            nbytes = verify_chunk_sha256(index, threads=torch.get_num_threads(),
                                         share=(self.ranks.rank, self.ranks.world), chunks=todo)
        except ValueError as exc:
            if resuming is None and not rerun:
                raise
            doing = f"resuming run {self.ckpt_dir} from step {resuming}" if resuming is not None else \
                f"rerunning the finished run {self.ckpt_dir}"
            raise ValueError(f"{exc}; {doing}: its checkpoints are kept. Put the chunk file back as merge indexed it "
                             "and rerun, or rerun extract and merge (features of other content train a new run)"
                             ) from None
        barrier()
        seconds = time.time() - t0
        if self.ranks.main:
            record_verified(self.ckpt_dir, record, entries)
            log.info("verified the sha256 of the chunk files of %s before training on them: %d of %d chunk file(s) "
                     "hashed, %s (rank 0's share: %.2f GB in %.1f s, %.2f GB/s)", index.path, len(todo),
                     len(index.files), "every one (a fresh start)" if full else
                     "the others unchanged since this run verified them (size and mtime)", nbytes / 1e9, seconds,
                     nbytes / 1e9 / max(seconds, 1e-9))

    def start(self, start_step: int, steps_note: str) -> None:
        """Log the drafter, wrap the step's module (DDP across ranks, compiled layers on a GPU), make the batch
        makers (this rank's share of the held-out rows packed like the training rows) and open TensorBoard from
        ``start_step`` on. ``steps_note`` describes the plan in the log line (``"12 per epoch"``)."""
        cfg, data, ranks = self.cfg, self.data, self.ranks
        n_params = sum(p.numel() for p in self.params)
        # the third step of this run (the optimizer state exists, DDP has rebuilt its buckets) by memory phase
        self.memory = StepMemory(self.device) if self.on_gpu else None
        self.memory_step = start_step + 2
        # train.time_phases: every step's time by phase (host and GPU; no added sync), medians in trainer_state
        self.step_times = StepTimes(self.device) if cfg.time_phases else None
        self.phase_summary = None
        selector = ""
        if self.selector:
            selector = (f", selector loss x {cfg.selector_loss_weight:g} "
                        + ("(stop-gradient)" if cfg.selector_stop_gradient else "(trains the backbone too)"))
        log.info("drafter: %s, %d layers, hidden %d, %d trainable parameters (%.1f M); block %d, %s%s, %s, labels "
                 "%s; %d steps (%s, warmup %d), %d process(es) on %s", self.config.ARCHITECTURE,
                 self.config.num_hidden_layers,
                 self.config.hidden_size, n_params, n_params / 1e6, self.block,
                 f"slot weights D-PACE (alpha {self.dpace_alpha:g})" if self.dpace_alpha is not None
                 else f"gamma {self.gamma:.3g}", selector, optimizer_summary(self.optimizer),
                 ("the target's top-k distribution" if self.cfg.labels == "target_topk" else "target tokens")
                 if data.use_target_tokens else "data tokens", self.total_steps, steps_note,
                 self.warmup, ranks.world, self.device)
        self.n_params = n_params
        self.step_model, self.ddp = prepare_step(self.model, cfg, self.device)
        self.chunk_bytes = int(cfg.logits_chunk_mib) << 20

        def maker(index):
            return None if index is None else batch_maker(index, cfg, block_size=self.block,
                                                          feature_dtype=self.feature_dtype, on_gpu=self.on_gpu)

        self.make_batch, self.make_heldout = maker(data.index), maker(data.heldout_index)
        self.heldout_rows = []
        if data.heldout_ids:
            self.heldout_rows = pack_rows(data.lengths, data.heldout_ids,
                                          int(cfg.tokens_per_batch))[ranks.rank::ranks.world]
        if ranks.main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step or None)

    def restore_measurements(self, state: Mapping) -> None:
        """Take back what the run measured before its checkpoint ``state``: the last training log line
        (:attr:`last`), the GPU memory by phase and the step times by phase (``train.time_phases``). A run resumed
        at its final step trains no step, and its trainer_state.json keeps them all the same; a step trained after
        the resume measures them anew."""
        self.last = dict(state.get("last_train") or {})
        if self.memory is not None and state.get("memory_by_phase_gib"):
            self.memory.phases = dict(state["memory_by_phase_gib"])
        if state.get("step_phases_ms"):
            self.phase_summary = dict(state["step_phases_ms"])

    def autocast(self):
        return (torch.autocast("cuda", dtype=torch.bfloat16) if self.on_gpu
                else torch.autocast("cpu", enabled=False))

    def prefetch(self, items: list, make) -> Prefetcher:
        return Prefetcher(items, make, depth=self.cfg.prefetch, pin=self.on_gpu, workers=self.cfg.loader_workers)

    def train_item(self, work: tuple[list[tuple[int, int]], int]) -> TrainItem:
        """The batch of a planned row ``(samples, anchor seed)``, its model FLOPs and its loss weight (runs on a
        prefetch worker)."""
        row, seed = work
        batch = self.make_batch(row, seed=seed)
        return TrainItem(batch, step_flops(self.model, batch, self.data.use_target_tokens),
                         loss_weight(batch, self.block, self.gamma, dpace=self.dpace_alpha is not None))

    def loss_scale(self, items: list[TrainItem]) -> torch.Tensor:
        """``world / W_step`` (0-dim float32 on the device): what each micro-batch's ``weighted_ce`` (``sum(CE * w)``)
        is multiplied by before its backward.

        ``W_step`` is the loss weight (:func:`~draftsmith.train.batches.loss_weight`) of the whole optimizer step:
        ``items``, this rank's micro-batches, summed over every rank (float64, one all-reduce of a scalar). DDP
        averages the ranks' gradients, hence the factor ``world``. So the step's gradient is that of
        ``sum(CE * w) / sum(w)`` over all its rows, whatever their split into micro-batches (``train.grad_accum``)
        and ranks: averaging each micro-batch's own mean instead over-weights the slots of rows with few supervised
        tokens (SpecForge made the same change, sgl-project/SpecForge#731: the DFlash loss normalised globally
        across ranks and accumulation steps). A step without any supervised slot has gradient 0.
        """
        weight = torch.tensor([sum(item.weight for item in items)], dtype=torch.float64)
        if self.on_gpu:  # page-locked: the copy does not wait for the GPU
            weight = weight.pin_memory().to(self.device, non_blocking=True)
        all_reduce_sum(weight)
        return (self.ranks.world / weight.clamp_min(1e-12)).float().reshape(())

    def check_finite(self, step: int, losses: list[torch.Tensor], grad_norm: torch.Tensor) -> None:
        """Stop the run (:class:`NonFiniteError`) when a micro-batch's loss of step ``step`` (0-based), on any rank,
        or the step's gradient norm is not finite.

        Called once the optimizer step is queued (its kernels overlap the GPU's backward) and before anything logs,
        evaluates or saves the step, so no checkpoint ever holds the non-finite update and the run stops at once: the
        newest checkpoint stays the run's last good state. Every rank raises (the values are all-reduced).
        Costs one all-reduce of ``world x grad_accum`` floats and one host sync per step.

        Stopping, not skipping: SpecForge skips and counts non-finite steps, but a non-finite value in the features
        comes back every epoch, and a diverging run rarely recovers by itself; a skipped step would also make the run
        differ from its plan (resume and stream phases replay the plan step by step). The error names the step and
        the tokenized rows (and their feature chunks) of the micro-batches whose loss is not finite, or of the whole
        step when only the gradient norm is.
        """
        world, accum = self.ranks.world, len(losses)
        sums = torch.zeros(world, accum, dtype=torch.float32, device=self.device)
        sums[self.ranks.rank] = torch.stack(losses).float()
        all_reduce_sum(sums)  # each slot holds one rank's value: a NaN or inf stays in its own slot
        values = torch.cat([sums.flatten(), grad_norm.detach().float().reshape(1)]).tolist()
        if all(math.isfinite(v) for v in values):
            return
        *loss_values, norm = values
        bad = [(i // accum, i % accum, v) for i, v in enumerate(loss_values) if not math.isfinite(v)]
        if bad:
            what = "; ".join(f"micro-batch {m} of rank {r}: weighted loss {v}, {self.describe_rows(step, r, m)}"
                             for r, m, v in bad)
            what = f"the loss is not finite ({what}); gradient norm {norm}"
        else:
            rows = "; ".join(f"micro-batch {m} of rank {r}: {self.describe_rows(step, r, m)}"
                             for r in range(world) for m in range(accum))
            what = f"the gradient norm is {norm} (every micro-batch's loss is finite; the step's rows: {rows})"
        done = [s for s in checkpoint_steps(self.ckpt_dir) if s <= step]
        kept = (f"the newest checkpoint, {self.ckpt_dir / f'step-{done[-1]:08d}'} (step {done[-1]}), is kept"
                if done else f"no checkpoint of this run in {self.ckpt_dir} yet")
        raise NonFiniteError(f"step {step + 1} of {self.total_steps}: {what}. Training stopped before this step "
                             f"was saved; {kept}. Look for NaN / inf in those rows' features, or for a divergence "
                             "(learning rate, gradient clipping)")

    def describe_rows(self, step: int, rank: int, micro: int) -> str:
        """``"tokenized rows 3 (48 tokens), 5 (12 tokens) in <chunk files>"``: micro-batch ``micro`` of ``rank`` at
        step ``step`` (the plan's row; the chunks of the features this run reads)."""
        _, key, r = list(self.plan.items(step, step + 1, rank))[micro]
        row = self.plan.rows(key)[r]
        index = self.data.index
        files = sorted({str(index.files[index.ref(s).chunk]) for s, _ in row if index.has_row(s)})
        return (f"tokenized rows {', '.join(f'{s} ({n} tokens)' for s, n in row)} in "
                f"{', '.join(files) or 'no chunk of ' + str(index.path)}")

    def heldout_metrics(self, step: int) -> dict | None:
        """Held-out loss, accuracies and τ (:func:`evaluate`) over every rank's share of the held-out rows."""
        if not self.data.heldout_ids:
            return None
        rows, rank = self.heldout_rows, self.ranks.rank
        batches = self.prefetch(list(range(len(rows))),
                                lambda j: self.make_heldout(rows[j], seed=seed_of(self.cfg.seed, "heldout", rank, j)))
        try:
            metrics = evaluate(self.model, batches, self.embed, self.head, gamma=self.gamma,
                               dpace_alpha=self.dpace_alpha, use_target_tokens=self.data.use_target_tokens,
                               device=self.device,
                               autocast=self.autocast, logits_chunk_bytes=self.chunk_bytes,
                               feature_dtype=self.feature_dtype)
        finally:
            batches.close()
        metrics["step"] = step
        log_heldout(self.writer, metrics, step)
        return metrics

    def checkpoint(self, step: int, extra: Callable[[], Mapping] | None = None, protect: Collection[int] = ()) -> None:
        """Rank 0 writes the checkpoint of ``step`` (its size and time logged; ``extra()`` joins its state, and the
        steps in ``protect`` are never pruned), then every rank waits for it."""
        if self.ranks.main:
            t0 = time.time()
            cfg, plan, total = self.cfg, self.plan, self.total_steps
            key = plan.locate(min(step, total - 1))[0]  # the epoch, or in stream mode (epoch, slice)
            state = {
                "fingerprint": self.fingerprint, "total_steps": total,
                "data_position": {"step": step, "epoch": key if isinstance(key, int) else key[0],
                                  "micro_batches_per_step": plan.per_step},
                "scheduler": {"warmup_steps": self.warmup, "total_steps": total, "min_lr_ratio": cfg.min_lr_ratio,
                              "lr": self.optimizer.param_groups[0]["lr"]},
                "history": self.history, "last_train": self.last,
                "memory_by_phase_gib": self.memory.phases if self.memory is not None else None,
                "step_phases_ms": self.phase_summary_now(),
                **(extra() if extra is not None else {})}
            path = save_checkpoint(self.ckpt_dir, step, self.model, self.optimizer, state,
                                   keep=int(cfg.keep_checkpoints), protect=protect)
            size = sum(f.stat().st_size for f in path.iterdir())
            log.info("checkpoint %s: %.2f GB in %.1f s", path, size / 1e9, time.time() - t0)
        barrier()

    def train_steps(self, start_step: int, end_step: int, *, extra: Callable[[], Mapping] | None = None,
                    protect: Collection[int] = ()) -> dict[str, Any]:
        """The loop: optimizer steps ``start_step .. end_step - 1`` of the plan. Every ``log_every`` steps (and at
        ``end_step``) a log line, every ``eval_every`` the held-out metrics (not at the plan's last step: the run's
        final evaluation does that), every ``save_every`` and at ``end_step`` a checkpoint (:meth:`checkpoint` with
        ``extra`` and ``protect``). Returns the last log line's metrics (:attr:`last`)."""
        cfg, plan, device, ranks = self.cfg, self.plan, self.device, self.ranks
        total_steps, accum, block = self.total_steps, cfg.grad_accum, self.block
        # the rows and anchor seeds of this rank's micro-batches, resolved here: workers only read features
        work = [(plan.rows(key)[r], plan.anchor_seed(key, r)) for _, key, r in plan.items(start_step, end_step,
                                                                                          ranks.rank)]
        items = self.prefetch(work, self.train_item)
        bar = progress(total_steps, "train", unit="step", logger=log, initial=start_step, disable=not ranks.main,
                       interval=float(cfg.progress_interval))
        throughput = Throughput(device)
        timer = self.step_times
        # train.profile_steps: a kernel trace of a few steps after the compile warm-up (rank 0), marked by phase
        window = profile_window(start_step, end_step, cfg.profile_steps) if ranks.main else None
        profiler = None
        if window is not None:
            profiler = StepProfiler(device, self.out_dir, window,
                                    warm=window[0] - 1 if window[0] - 1 > start_step else None)
            if timer is not None:
                timer.leave_out(profiler.steps_slowed)  # the profiled steps are slower: not in the medians
        marks = [m.mark for m in (timer, profiler) if m is not None]

        def tick(phase: str) -> None:
            for m in marks:
                m(phase)

        try:
            batches = iter(items)
            for step in range(start_step, end_step):
                if timer is not None:
                    timer.start(step + 1)
                if profiler is not None and profiler.start(step + 1):
                    throughput.skip()  # writing the profile is no training time
                factor = lr_factor(step, total_steps, self.warmup, cfg.min_lr_ratio)
                lr = cfg.lr * factor
                for group in self.optimizer.param_groups:  # Muon's group peaks at its own train.muon_lr
                    group["lr"] = group.get("peak_lr", cfg.lr) * factor
                metrics = Metrics(block - 1, device, selector=self.selector)
                phases = self.memory if step == self.memory_step else None  # one step's memory by phase (GPU)
                memory_mark = phases.mark if phases is not None else None

                def mark(phase: str) -> None:
                    if memory_mark is not None:
                        memory_mark(phase)
                    tick(phase)

                if phases is not None:
                    phases.start()
                # the step's micro-batches (read ahead by the prefetcher) and its loss weight over all ranks
                step_items = [next(batches) for _ in range(accum)]
                scale = self.loss_scale(step_items)
                tick("fetch")
                losses = []
                for micro, item in enumerate(step_items):  # DDP all-reduces the gradients on the last micro-batch
                    throughput.add(int((item.batch.doc_ids >= 0).sum()), item.flops)  # on the host: no GPU wait
                    # fp8 features travel as fp8 with their scales and are dequantised here, on the device
                    batch = item.batch.to(device, non_blocking=True).dequantize(self.feature_dtype)
                    tick("h2d")
                    no_sync = self.ddp and micro < accum - 1
                    with self.step_model.no_sync() if no_sync else contextlib.nullcontext(), self.autocast():
                        out = self.step_model(batch, self.embed, self.head, self.gamma, self.dpace_alpha,
                                              self.data.use_target_tokens,
                                              cfg.attention, self.chunk_bytes)
                        mark("forward")
                        (out.weighted_ce * scale).backward()
                        mark("backward")
                    metrics.add(out)
                    losses.append(out.weighted_ce.detach())
                    tick("metrics")
                del step_items
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                mark("clip")
                # the optimizer's kernels are queued before the finite check waits for the GPU: checked first, the
                # host launched them onto an idle GPU (a small drafter's Muon + AdamW: 677 kernels, 15 ms of host
                # time for 2.6 ms of GPU work, 2026-12-05 trace). Still checked before anything logs, evaluates or
                # saves this step, so no checkpoint ever holds a non-finite update.
                self.optimizer.step()
                mark("optimizer")
                self.check_finite(step, losses, grad_norm)
                tick("check")
                # under DDP the gradients are views into its buckets: zeroed in place, they stay views (set to None,
                # each backward would allocate them again and DDP copy them into its buckets)
                self.optimizer.zero_grad(set_to_none=not self.ddp)
                mark("zero_grad")
                if phases is not None and ranks.main:
                    log.info("GPU memory of step %d by phase (rank 0): %s", step + 1, phases.summary())

                done = step + 1
                if done % cfg.log_every == 0 or done == end_step:
                    self.last = log_train_step(self.writer, done, metrics, lr, grad_norm, throughput,
                                               world=ranks.world, on_gpu=self.on_gpu, bar=bar)
                bar.update(1)
                if done % cfg.eval_every == 0 and done != total_steps:
                    heldout = self.heldout_metrics(done)
                    if heldout is not None:
                        self.history.append(heldout)
                        self.evals.append(heldout)
                    throughput.skip()
                if done % cfg.save_every == 0 or done == end_step:
                    if timer is not None and done == end_step:  # the last step's times go into its checkpoint
                        tick("log")
                        self.write_phases(timer.collect(wait=True))
                    self.checkpoint(done, extra, protect)
                    throughput.skip()
                if timer is not None and done < end_step:
                    tick("log")
                    self.write_phases(timer.collect())
        finally:
            items.close()
            bar.close()
            if profiler is not None:
                profiler.close()
        if timer is not None:
            self.phase_summary = self.phase_summary_now()
            if timer.records and ranks.main:
                log.info("step time by phase (rank 0, medians of %d steps after the first %d): %s",
                         self.phase_summary["steps"], self.phase_summary["skipped"],
                         StepTimes.describe(self.phase_summary))
        return self.last

    def phase_summary_now(self) -> dict[str, Any] | None:
        """The step times by phase so far (:class:`StepTimes`' summary of the steps completed; a checkpoint's),
        else what an earlier process of the run measured."""
        now = self.step_times.summary() if self.step_times is not None else None
        return now if now is not None else self.phase_summary

    def write_phases(self, records: list[dict[str, Any]]) -> None:
        """TensorBoard scalars ``profile/<phase>_ms`` of steps timed by :class:`StepTimes` (the GPU's times on a
        GPU, else the host's; rank 0)."""
        if self.writer is None:
            return
        for rec in records:
            for phase, ms in (rec.get("gpu_ms") or rec["host_ms"]).items():
                self.writer.add_scalar(f"profile/{phase}_ms", ms, rec["step"])

    def final_outputs(self, t_start: float, *, resumed_from_step: int, earlier: Mapping | None = None,
                      extra: Mapping | None = None) -> dict[str, Any]:
        """The run's end: the final held-out metrics, peak memory per rank, ``trained/`` (weights, config) and
        ``trainer_state.json`` (written last; returned).

        Args:
            t_start: when this process started (the wall time counts from it).
            resumed_from_step: the step the training resumed from (0: a fresh run).
            earlier: what earlier processes of the run measured (stream mode: the last phase's marker):
                ``run_wall_s`` (added to the wall time), ``run_peak_memory_gib`` (a floor of the peaks),
                ``last_train`` and ``memory_by_phase_gib`` (taken as they are).
            extra: more fields of trainer_state.json.
        """
        wall_s = time.time() - t_start + (float(earlier["run_wall_s"]) if earlier else 0.0)
        final_eval = self.heldout_metrics(self.total_steps)
        if final_eval is not None:
            self.history.append(final_eval)
        peak = peak_memory_gib(self.device, self.memory.run_peak if self.memory is not None else 0)
        if earlier and earlier.get("run_peak_memory_gib"):
            peak = [max(a, b) for a, b in zip(peak or [0.0] * len(earlier["run_peak_memory_gib"]),
                                              earlier["run_peak_memory_gib"])]
        if peak is not None and self.ranks.main:
            log.info("peak GPU memory per rank: %s GiB", ", ".join(f"{p:.1f}" for p in peak))
        data, plan = self.data, self.plan
        steps_per_epoch, skipped = plan_summary(plan)
        state = {
            "format": "draftsmith.trainer_state/1", "steps": self.total_steps,
            "steps_per_epoch": steps_per_epoch, "world_size": plan.world, "device": str(self.device),
            "samples": {"total": data.num_samples, "train": len(data.train_ids),
                        "heldout": len(data.heldout_ids), "train_truncated": data.truncated},
            "rows_skipped_at_epoch_ends": skipped, "tokens_per_batch": int(self.cfg.tokens_per_batch),
            "architecture": self.config.ARCHITECTURE, "block_size": self.block, "gamma": self.gamma,
            "loss_weighting": self.cfg.loss_weighting, "dpace_alpha": self.dpace_alpha,
            "optimizer": self.cfg.optimizer,
            **({"selector_loss_weight": float(self.model.selector_loss_weight),  # as the drafter trained
                "selector_stop_gradient": bool(self.model.selector_stop_gradient)}
               if self.selector else {}),
            "labels": self.cfg.labels if data.use_target_tokens else "data",
            **({"soft_label_tokens": self.cfg.labels_topk or data.features.target_top_k}  # the width it trained on
               if self.cfg.labels == "target_topk" and data.use_target_tokens else {}),
            "trainable_parameters": self.n_params,
            "last_train": earlier["last_train"] if earlier else self.last, "peak_memory_gib": peak,
            "memory_by_phase_gib": (earlier["memory_by_phase_gib"] if earlier
                                    else self.memory.phases if self.memory is not None else None),
            "step_phases_ms": (earlier.get("step_phases_ms") if earlier else self.phase_summary),
            "heldout": final_eval, "history": self.history, "fingerprint": self.fingerprint,
            "resumed_from_step": resumed_from_step, "wall_s": wall_s, **(extra or {}),
        }
        if self.ranks.main:
            trained = self.out_dir / "trained"
            save_pretrained_atomic(self.model, trained)
            write_json(trained / "trainer_state.json", state)
            log.info("wrote %s (held-out tau_expected %s)", trained,
                     f"{final_eval['tau_expected']:.3f}" if final_eval else "n/a")
        barrier()
        return state

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
