"""Processes and devices: torch.distributed under torchrun, this rank's device, and the step's module (DDP,
compiled layers).

:func:`setup_device` picks ``cuda:LOCAL_RANK`` (or the CPU), sets the CPU threads and starts the process group
(:func:`setup_distributed`, :class:`Dist`); :func:`barrier` waits for every rank and :func:`all_reduce_sum` sums
over them; :func:`prepare_step` wraps the drafter for the training step: DDP whenever a process group exists,
activation checkpointing, and on a GPU compiled layers (:func:`whole_layer_graphs_under_ddp` under DDP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from draftsmith.modeling import DFlashDraftModel
from draftsmith.modeling_dflash2 import DFlash2DraftModel
from draftsmith.train.settings import TrainOptions


@dataclass
class Dist:
    """This process's place: ``rank`` of ``world`` processes, ``local_rank`` on its node (its GPU)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


#: How long a collective waits for the other ranks before torch.distributed aborts the job (torch's default for
#: NCCL: 10 min). Rank 0 writes every checkpoint while the other ranks wait at a barrier: at a 27B-class drafter a
#: checkpoint is 21.4 GB (fp32 weights + AdamW moments), quick to local NVMe (docs/rehearsal-x2/README.md) but
#: over 10 min to a shared file system below 36 MB/s.
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


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over every rank, in place (nothing without a process group)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def setup_device(threads: int | None) -> tuple[torch.device, Dist]:
    """This process's device (``cuda:LOCAL_RANK`` when CUDA is there), torch.distributed, CPU threads
    (``threads`` for all processes together: each of ``world`` ranks takes ``threads // world``)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads:
        torch.set_num_threads(max(1, int(threads)))
    ranks = setup_distributed(device.type)
    if ranks.world > 1 and threads:
        torch.set_num_threads(max(1, int(threads) // ranks.world))
    return device, ranks


class _TrainStep(torch.nn.Module):
    """DDP needs ``forward``: this wrapper's forward is the drafter's training forward."""

    def __init__(self, drafter: DFlashDraftModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, embed, head, gamma, dpace_alpha, use_target_tokens, backend, logits_chunk_bytes):
        return self.drafter.training_forward(batch, embed, head, gamma=gamma, dpace_alpha=dpace_alpha,
                                             use_target_tokens=use_target_tokens, backend=backend,
                                             logits_chunk_bytes=logits_chunk_bytes)


def prepare_step(model: DFlashDraftModel, settings: TrainOptions, device: torch.device
                 ) -> tuple[torch.nn.Module, bool]:
    """The module the training step calls, ``step_model(batch, embed, head, gamma, dpace_alpha, use_target_tokens,
    backend, logits_chunk_bytes)`` -> the drafter's training output, and whether it is DDP.

    DDP whenever a process group exists: :func:`setup_distributed` makes one for WORLD_SIZE > 1; bench_train's
    ``--ddp-overhead`` makes a one-process group to measure DDP's own memory and speed cost on one GPU. Sets
    ``train.activation_checkpointing`` (and, on a DFlash2 drafter, ``train.selector_loss_weight`` and
    ``selector_stop_gradient``) on the drafter; with ``train.compile`` on a GPU compiles each layer in place
    (state-dict names unchanged) and fuses the LM-head loss's chunks (:func:`draftsmith.drafter_loss.logit_statistics`).
    """
    on_gpu = device.type == "cuda"
    step_model: torch.nn.Module = _TrainStep(model)
    ddp = dist.is_initialized()
    if ddp:
        # gradients as views into DDP's all-reduce buckets: no second copy of them (DDP's remaining extra memory
        # per rank was dynamo's graph cuts: whole_layer_graphs_under_ddp, docs/measurements.md)
        step_model = torch.nn.parallel.DistributedDataParallel(
            step_model, device_ids=[device.index] if on_gpu else None, gradient_as_bucket_view=True)
    model.activation_checkpointing = bool(settings.activation_checkpointing)
    model.fused_loss = bool(settings.compile and on_gpu)  # the LM-head loss's chunks compiled too
    if isinstance(model, DFlash2DraftModel):
        model.selector_loss_weight = float(settings.selector_loss_weight)
        model.selector_stop_gradient = bool(settings.selector_stop_gradient)
    if settings.compile and on_gpu:
        if ddp:
            whole_layer_graphs_under_ddp()
        for layer in model.layers:
            layer.compile()  # in place: state-dict names unchanged
    if on_gpu:
        allow_recompiles()
    return step_model, ddp


def whole_layer_graphs_under_ddp() -> None:
    """Compile each drafter layer as one graph under DDP (``torch._dynamo.config.optimize_ddp = False``).

    By default dynamo's DDPOptimizer splits every graph compiled inside DDP's forward into pieces of DDP's bucket
    size (25 MB of parameters), so that the all-reduce of one piece's gradients overlaps the backward of the next
    (torch/_dynamo/backends/distributed.py). The trainer compiles layer by layer: a 27B-class drafter layer (330 M
    parameters) would become ~50 graphs, each fused and partitioned on its own (no fusion across the cuts, and the
    activations at every cut saved for the backward). Layer boundaries already give that overlap: DDP's reducer
    all-reduces a layer's buckets while the layers below it run their backward. With dynamo's cuts, DDP cost each
    GPU some of its model FLOP/s, and more memory over one process than its persistent gradients account for
    (docs/rehearsal-x2/README.md).
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.optimize_ddp = False


def allow_recompiles() -> None:
    """Compiled flex_attention sees one shape per anchor bucket: let dynamo keep them all."""
    import torch._dynamo.config as dynamo_config

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
