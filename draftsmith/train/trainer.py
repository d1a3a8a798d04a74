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
import os
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from draftsmith.batch_plan import pack_rows, seed_of
from draftsmith.drafter_config import default_loss_gamma, drafter_config_dict
from draftsmith.flops import step_flops
from draftsmith.io import progress, write_json
from draftsmith.modeling_dflash2 import DFlash2DraftModel, model_class_for
from draftsmith.target import load_target_embeddings_and_head
from draftsmith.train.batches import Prefetcher, TrainItem, batch_maker
from draftsmith.train.checkpoint import resume, run_fingerprint, save_checkpoint
from draftsmith.train.distributed import Dist, barrier, prepare_step, setup_device
from draftsmith.train.metrics import (
    Metrics,
    StepMemory,
    Throughput,
    evaluate,
    log_heldout,
    log_train_step,
    peak_memory_gib,
)
from draftsmith.train.model import build_model_config, make_optimizer
from draftsmith.train.plan import TrainData, lr_factor, plan_data, plan_summary
from draftsmith.train.settings import TrainPhaseSettings, TrainSettings

log = logging.getLogger("draftsmith.train")


def train(index_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
          settings: TrainSettings, *, threads: int | None = None,
          stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train a DFlash drafter; resume automatically from ``<out_dir>/checkpoints``.

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
        ValueError: inconsistent features / config (named), too few samples for one optimizer step, or a
            checkpoint from a different configuration in ``checkpoints/``.
    """
    t_start = time.time()
    device, ranks = setup_device(threads)

    # -- data: the features, the held-out split, the rows of every optimizer step
    data = plan_data(index_path, settings.train, ranks.world)
    # -- model: the frozen target embedding and head, the drafter, AdamW
    run = Trainer(data, target_dir, out_dir, settings, device, ranks)

    # -- resume: one checkpoint folder per run fingerprint. A rerun with the same configuration resumes; a changed
    # one (Snakemake reruns train when its params change) starts fresh and leaves the other run's checkpoints alone
    run.use_checkpoints(run_fingerprint(drafter_config_dict(run.config), settings.train, data.index.meta,
                                        ranks.world))
    start_step, run.history = resume(run.ckpt_dir, run.fingerprint, run.model, run.optimizer, device,
                                     run.total_steps)
    run.start(start_step, f"{data.plan.steps_per_epoch[0]} per epoch")

    # -- the loop: steps start_step .. end_step - 1, then the final held-out metrics and trained/
    end_step = run.total_steps if stop_after_steps is None else min(run.total_steps, stop_after_steps)
    try:
        run.train_steps(start_step, end_step)
        if end_step < run.total_steps:  # stopped early on purpose (tests): checkpoint written, no final outputs
            return {"stopped_at": end_step, "total_steps": run.total_steps}
        return run.final_outputs(t_start, resumed_from_step=start_step)
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
        self.config = build_model_config(data.features, Path(target_dir), settings.drafter, embed.shape[0])
        tied = head is embed
        self.embed = embed.to(device=device, dtype=self.feature_dtype)
        self.head = self.embed if tied else head.to(device=device, dtype=self.feature_dtype)
        self.block = self.config.block_size
        self.gamma = float(cfg.loss_gamma or default_loss_gamma(self.block))
        torch.manual_seed(cfg.seed)
        with torch.device(device):  # initialised where it trains: a large drafter built on one CPU thread is slow
            self.model = model_class_for(self.config.architectures)(self.config)
        self.model.train()
        self.selector = isinstance(self.model, DFlash2DraftModel)  # DFlash2: the selector's metrics too
        self.optimizer, self.params = make_optimizer(self.model, cfg, self.on_gpu)
        self.fingerprint, self.ckpt_dir = "", self.out_dir / "checkpoints"
        self.history: list[dict] = []
        self.last: dict[str, Any] = {}
        self.evals: list[dict] = []
        self.writer = None

    def use_checkpoints(self, fingerprint: str) -> None:
        """Checkpoint under ``<out>/checkpoints/run-<fingerprint[:12]>/`` (other runs' folders: named, left alone)."""
        self.fingerprint = fingerprint
        self.ckpt_dir = self.out_dir / "checkpoints" / f"run-{fingerprint[:12]}"
        parent = self.ckpt_dir.parent
        others = sorted(p.name for p in parent.glob("run-*") if p != self.ckpt_dir) if parent.is_dir() else []
        if others and self.ranks.main:
            log.info("checkpoints of other configurations in %s (not resumed, not deleted): %s", parent,
                     ", ".join(others))

    def start(self, start_step: int, steps_note: str) -> None:
        """Log the drafter, wrap the step's module (DDP across ranks, compiled layers on a GPU), make the batch
        makers (this rank's share of the held-out rows packed like the training rows) and open TensorBoard from
        ``start_step`` on. ``steps_note`` describes the plan in the log line (``"12 per epoch"``)."""
        cfg, data, ranks = self.cfg, self.data, self.ranks
        n_params = sum(p.numel() for p in self.params)
        # the third step of this run (the optimizer state exists, DDP has rebuilt its buckets) by memory phase
        self.memory = StepMemory(self.device) if self.on_gpu else None
        self.memory_step = start_step + 2
        log.info("drafter: %s, %d layers, hidden %d, %d trainable parameters (%.1f M); block %d, gamma %.3g, labels "
                 "%s; %d steps (%s, warmup %d), %d process(es) on %s", self.config.ARCHITECTURE,
                 self.config.num_hidden_layers,
                 self.config.hidden_size, n_params, n_params / 1e6, self.block, self.gamma,
                 "target tokens" if data.use_target_tokens else "data tokens", self.total_steps, steps_note,
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

    def autocast(self):
        return (torch.autocast("cuda", dtype=torch.bfloat16) if self.on_gpu
                else torch.autocast("cpu", enabled=False))

    def prefetch(self, items: list, make) -> Prefetcher:
        return Prefetcher(items, make, depth=self.cfg.prefetch, pin=self.on_gpu, workers=self.cfg.loader_workers)

    def train_item(self, work: tuple[list[tuple[int, int]], int]) -> TrainItem:
        """The batch of a planned row ``(samples, anchor seed)`` and its model FLOPs (runs on a prefetch worker)."""
        row, seed = work
        batch = self.make_batch(row, seed=seed)
        return TrainItem(batch, step_flops(self.model, batch, self.data.use_target_tokens))

    def heldout_metrics(self, step: int) -> dict | None:
        """Held-out loss, accuracies and τ (:func:`evaluate`) over every rank's share of the held-out rows."""
        if not self.data.heldout_ids:
            return None
        rows, rank = self.heldout_rows, self.ranks.rank
        batches = self.prefetch(list(range(len(rows))),
                                lambda j: self.make_heldout(rows[j], seed=seed_of(self.cfg.seed, "heldout", rank, j)))
        try:
            metrics = evaluate(self.model, batches, self.embed, self.head, gamma=self.gamma,
                               use_target_tokens=self.data.use_target_tokens, device=self.device,
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
                "history": self.history, **(extra() if extra is not None else {})}
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
        try:
            batches = iter(items)
            for step in range(start_step, end_step):
                lr = cfg.lr * lr_factor(step, total_steps, self.warmup, cfg.min_lr_ratio)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                metrics = Metrics(block - 1, device, selector=self.selector)
                phases = self.memory if step == self.memory_step else None  # one step's memory by phase (GPU)
                mark = phases.mark if phases is not None else lambda phase: None
                if phases is not None:
                    phases.start()
                for micro in range(accum):  # DDP all-reduces the gradients on the last micro-batch
                    item = next(batches)
                    throughput.add(int((item.batch.doc_ids >= 0).sum()), item.flops)  # on the host: no GPU wait
                    # fp8 features travel as fp8 with their scales and are dequantised here, on the device
                    batch = item.batch.to(device, non_blocking=True).dequantize(self.feature_dtype)
                    no_sync = self.ddp and micro < accum - 1
                    with self.step_model.no_sync() if no_sync else contextlib.nullcontext(), self.autocast():
                        out = self.step_model(batch, self.embed, self.head, self.gamma, self.data.use_target_tokens,
                                              cfg.attention, self.chunk_bytes)
                        mark("forward")
                        (out.loss / accum).backward()
                        mark("backward")
                    metrics.add(out)
                # the norm before clipping stays a device tensor (reading it would wait for the GPU every step)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                mark("clip")
                self.optimizer.step()
                mark("optimizer")
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
                    self.checkpoint(done, extra, protect)
                    throughput.skip()
        finally:
            items.close()
            bar.close()
        return self.last

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
            "labels": "target" if data.use_target_tokens else "data",
            "trainable_parameters": self.n_params,
            "last_train": earlier["last_train"] if earlier else self.last, "peak_memory_gib": peak,
            "memory_by_phase_gib": (earlier["memory_by_phase_gib"] if earlier
                                    else self.memory.phases if self.memory is not None else None),
            "heldout": final_eval, "history": self.history, "fingerprint": self.fingerprint,
            "resumed_from_step": resumed_from_step, "wall_s": wall_s, **(extra or {}),
        }
        if self.ranks.main:
            trained = self.out_dir / "trained"
            self.model.save_pretrained(trained)
            write_json(trained / "trainer_state.json", state)
            log.info("wrote %s (held-out tau_expected %s)", trained,
                     f"{final_eval['tau_expected']:.3f}" if final_eval else "n/a")
        barrier()
        return state

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
