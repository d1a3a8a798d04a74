"""The training run, top to bottom: :func:`train`.

Data (:mod:`~draftsmith.train.plan`) -> the frozen target embedding and head, the drafter, AdamW, resume
(:mod:`~draftsmith.train.model`, :mod:`~draftsmith.train.checkpoint`) -> the loop (learning rate, micro-batches,
clip, step; log, held-out evaluation, checkpoint) -> ``trained/`` and ``trainer_state.json``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.batch_plan import pack_rows, seed_of
from draftsmith.drafter_config import default_loss_gamma, drafter_config_dict
from draftsmith.flops import step_flops
from draftsmith.io import progress, write_json
from draftsmith.modeling import DFlashDraftModel
from draftsmith.target import load_target_embeddings_and_head
from draftsmith.train.batches import Prefetcher, TrainItem, batch_maker
from draftsmith.train.checkpoint import resume, run_fingerprint, save_checkpoint
from draftsmith.train.distributed import barrier, prepare_step, setup_device
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
from draftsmith.train.plan import lr_factor, plan_data
from draftsmith.train.settings import TrainSettings

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
    cfg, target_dir, out_dir = settings.train, Path(target_dir), Path(out_dir)
    device, ranks = setup_device(threads)
    on_gpu = device.type == "cuda"
    feature_dtype = torch.bfloat16 if on_gpu else torch.float32

    # -- data: the features, the held-out split, the rows of every optimizer step
    data = plan_data(index_path, cfg, ranks.world)
    plan, total_steps, row_tokens = data.plan, data.plan.total_steps, int(cfg.tokens_per_batch)
    warmup = int(round(cfg.warmup_ratio * total_steps))

    # -- model: the frozen target embedding and LM head (tied: one copy on the device), the drafter, AdamW
    embed, head = load_target_embeddings_and_head(target_dir)
    config = build_model_config(data.index, target_dir, settings.drafter, embed.shape[0])
    tied = head is embed
    embed = embed.to(device=device, dtype=feature_dtype)
    head = embed if tied else head.to(device=device, dtype=feature_dtype)
    block = config.dflash_config["block_size"]
    gamma = float(cfg.loss_gamma or default_loss_gamma(block))
    torch.manual_seed(cfg.seed)
    with torch.device(device):  # initialised where it trains: a large drafter built on one CPU thread is slow
        model = DFlashDraftModel(config)
    model.train()
    optimizer, params = make_optimizer(model, cfg, on_gpu)

    # -- resume: one checkpoint folder per run fingerprint. A rerun with the same configuration resumes; a changed
    # one (Snakemake reruns train when its params change) starts fresh and leaves the other run's checkpoints alone
    fingerprint = run_fingerprint(drafter_config_dict(config), cfg, data.index.meta, ranks.world)
    ckpt_dir = out_dir / "checkpoints" / f"run-{fingerprint[:12]}"
    others = sorted(p.name for p in ckpt_dir.parent.glob("run-*") if p != ckpt_dir) if ckpt_dir.parent.is_dir() else []
    if others and ranks.main:
        log.info("checkpoints of other configurations in %s (not resumed, not deleted): %s", ckpt_dir.parent,
                 ", ".join(others))
    start_step, history = resume(ckpt_dir, fingerprint, model, optimizer, device, total_steps)
    n_params = sum(p.numel() for p in params)
    # the third step of this run (the optimizer state exists, DDP has rebuilt its buckets) by memory phase
    memory = StepMemory(device) if on_gpu else None
    memory_step = start_step + 2
    log.info("drafter: %d layers, hidden %d, %d trainable parameters (%.1f M); block %d, gamma %.3g, labels "
             "%s; %d steps (%d per epoch, warmup %d), %d process(es) on %s", config.num_hidden_layers,
             config.hidden_size, n_params, n_params / 1e6, block, gamma,
             "target tokens" if data.use_target_tokens else "data tokens", total_steps, plan.steps_per_epoch[0],
             warmup, ranks.world, device)

    # -- the step's module (DDP across ranks, compiled layers on a GPU) under bf16 autocast; batches read ahead
    step_model, ddp = prepare_step(model, cfg, device)
    chunk_bytes = int(cfg.logits_chunk_mib) << 20
    make_batch = batch_maker(data.index, cfg, block_size=block, feature_dtype=feature_dtype, on_gpu=on_gpu)
    heldout_rows = []  # this rank's share of the held-out samples, packed like the training rows
    if data.heldout_ids:
        heldout_rows = pack_rows(data.lengths, data.heldout_ids, row_tokens)[ranks.rank::ranks.world]
    writer = None
    if ranks.main:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step or None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)

    def prefetch(items: list, make) -> Prefetcher:
        return Prefetcher(items, make, depth=cfg.prefetch, pin=on_gpu, workers=cfg.loader_workers)

    def train_item(item: tuple[int, int, int]) -> TrainItem:
        """The batch of plan item ``(step, epoch, row)`` and its model FLOPs (runs on a prefetch worker)."""
        _, epoch, r = item
        batch = make_batch(plan.rows(epoch)[r], seed=seed_of(cfg.seed, "anchors", epoch, r))
        return TrainItem(batch, step_flops(model, batch, data.use_target_tokens))

    def heldout_metrics(step: int) -> dict | None:
        """Held-out loss, accuracies and τ (:func:`evaluate`) over every rank's share of the held-out rows."""
        if not data.heldout_ids:
            return None
        batches = prefetch(list(range(len(heldout_rows))),
                           lambda j: make_batch(heldout_rows[j], seed=seed_of(cfg.seed, "heldout", ranks.rank, j)))
        try:
            metrics = evaluate(model, batches, embed, head, gamma=gamma, use_target_tokens=data.use_target_tokens,
                               device=device, autocast=autocast, logits_chunk_bytes=chunk_bytes)
        finally:
            batches.close()
        metrics["step"] = step
        log_heldout(writer, metrics, step)
        return metrics

    def checkpoint(step: int) -> None:
        """Rank 0 writes the checkpoint of ``step`` (its size and time logged), then every rank waits for it."""
        if ranks.main:
            t0 = time.time()
            path = save_checkpoint(ckpt_dir, step, model, optimizer, {
                "fingerprint": fingerprint, "total_steps": total_steps,
                "data_position": {"step": step, "epoch": plan.locate(min(step, total_steps - 1))[0],
                                  "micro_batches_per_step": plan.per_step},
                "scheduler": {"warmup_steps": warmup, "total_steps": total_steps, "min_lr_ratio": cfg.min_lr_ratio,
                              "lr": optimizer.param_groups[0]["lr"]},
                "history": history}, keep=int(cfg.keep_checkpoints))
            size = sum(f.stat().st_size for f in path.iterdir())
            log.info("checkpoint %s: %.2f GB in %.1f s", path, size / 1e9, time.time() - t0)
        barrier()

    # -- the loop: steps start_step .. end_step - 1; every log_every a log line, every eval_every the held-out
    # metrics, every save_every (and at the end) a checkpoint
    end_step = total_steps if stop_after_steps is None else min(total_steps, stop_after_steps)
    accum, last = cfg.grad_accum, {}
    try:
        items = prefetch(list(plan.items(start_step, end_step, ranks.rank)), train_item)
        bar = progress(total_steps, "train", unit="step", logger=log, initial=start_step, disable=not ranks.main,
                       interval=float(cfg.progress_interval))
        throughput = Throughput(device)
        try:
            batches = iter(items)
            for step in range(start_step, end_step):
                lr = cfg.lr * lr_factor(step, total_steps, warmup, cfg.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                metrics = Metrics(block - 1, device)
                phases = memory if step == memory_step else None  # one step's memory by phase (GPU)
                mark = phases.mark if phases is not None else lambda phase: None
                if phases is not None:
                    phases.start()
                for micro in range(accum):  # DDP all-reduces the gradients on the last micro-batch
                    item = next(batches)
                    throughput.add(int((item.batch.doc_ids >= 0).sum()), item.flops)  # on the host: no GPU wait
                    batch = item.batch.to(device, non_blocking=True)
                    no_sync = ddp and micro < accum - 1
                    with step_model.no_sync() if no_sync else contextlib.nullcontext(), autocast():
                        out = step_model(batch, embed, head, gamma, data.use_target_tokens, cfg.attention,
                                         chunk_bytes)
                        mark("forward")
                        (out.loss / accum).backward()
                        mark("backward")
                    metrics.add(out)
                # the norm before clipping stays a device tensor (reading it would wait for the GPU every step)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                mark("clip")
                optimizer.step()
                mark("optimizer")
                # under DDP the gradients are views into its buckets: zeroed in place, they stay views (set to None,
                # each backward would allocate them again and DDP copy them into its buckets)
                optimizer.zero_grad(set_to_none=not ddp)
                mark("zero_grad")
                if phases is not None and ranks.main:
                    log.info("GPU memory of step %d by phase (rank 0): %s", step + 1, phases.summary())

                done = step + 1
                if done % cfg.log_every == 0 or done == end_step:
                    last = log_train_step(writer, done, metrics, lr, grad_norm, throughput, world=ranks.world,
                                          on_gpu=on_gpu, bar=bar)
                bar.update(1)
                if done % cfg.eval_every == 0 and done != total_steps:
                    heldout = heldout_metrics(done)
                    if heldout is not None:
                        history.append(heldout)
                    throughput.skip()
                if done % cfg.save_every == 0 or done == end_step:
                    checkpoint(done)
                    throughput.skip()
        finally:
            items.close()
            bar.close()
        if end_step < total_steps:  # stopped early on purpose (tests): checkpoint written, no final outputs
            return {"stopped_at": end_step, "total_steps": total_steps}

        # -- outputs: the final held-out metrics, peak memory per rank, trained/ (weights, config) and
        # trainer_state.json (written last)
        wall_s = time.time() - t_start
        final_eval = heldout_metrics(total_steps)
        if final_eval is not None:
            history.append(final_eval)
        peak = peak_memory_gib(device, memory.run_peak if memory is not None else 0)
        if peak is not None and ranks.main:
            log.info("peak GPU memory per rank: %s GiB", ", ".join(f"{p:.1f}" for p in peak))
        state = {
            "format": "draftsmith.trainer_state/1", "steps": total_steps,
            "steps_per_epoch": plan.steps_per_epoch, "world_size": ranks.world, "device": str(device),
            "samples": {"total": len(data.index.samples), "train": len(data.train_ids),
                        "heldout": len(data.heldout_ids), "train_truncated": data.truncated},
            "rows_skipped_at_epoch_ends": plan.skipped_rows, "tokens_per_batch": row_tokens,
            "block_size": block, "gamma": gamma, "labels": "target" if data.use_target_tokens else "data",
            "trainable_parameters": n_params, "last_train": last, "peak_memory_gib": peak,
            "memory_by_phase_gib": memory.phases if memory is not None else None,
            "heldout": final_eval, "history": history, "fingerprint": fingerprint,
            "resumed_from_step": start_step, "wall_s": wall_s,
        }
        if ranks.main:
            trained = out_dir / "trained"
            model.save_pretrained(trained)
            write_json(trained / "trainer_state.json", state)
            log.info("wrote %s (held-out tau_expected %s)", trained,
                     f"{final_eval['tau_expected']:.3f}" if final_eval else "n/a")
        barrier()
        return state
    finally:
        if writer is not None:
            writer.close()
