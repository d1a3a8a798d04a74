"""Muon under DDP with its Newton-Schulz orthogonalisations split across the ranks.

``torch.optim.Muon`` under DDP repeats the same work on every rank: after the gradient all-reduce each rank holds the
same gradients and orthogonalises every weight matrix with the same five Newton-Schulz iterations. At the 27B drafter
shape that is ~197 TFLOP a step (speculators 0.9.0's profile on one H200: 340 of its 1,330 ms;
docs/peers/README.md), the same on each of 8 GPUs. :class:`ShardedMuon` gives each matrix an owner rank
(:func:`muon_owners`, balanced by Newton-Schulz FLOPs); only the owner orthogonalises it and applies the update,
then broadcasts the new weights, so a rank does about 1/world of the work. The momentum buffers stay on every rank
(each rank updates all of them from the same gradients: elementwise, cheap), so the optimizer state and its
checkpoint are those of ``torch.optim.Muon``, complete on every rank. Moonshot's distributed Muon (Liu
et al. 2025, "Muon is Scalable for LLM Training") splits the work too, over ZeRO-1 shards of the state; this keeps
DDP's whole state on every rank and splits by matrix.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

#: The quintic Newton-Schulz coefficients (a, b, c) of Keller Jordan's Muon and ``torch.optim.Muon``'s defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_flops(shape: tuple[int, int] | torch.Size, ns_steps: int = 5) -> int:
    """FLOPs of orthogonalising an ``m x n`` matrix: ``ns_steps * (4 m^2 n + 2 m^3)`` with ``m`` the smaller side
    (per iteration ``X X^T``, then ``b A + c A A``, then ``a X + B X``; the same count as docs/peers/README.md)."""
    m, n = sorted(int(s) for s in shape[:2])
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def muon_owners(shapes: list[tuple[int, int]], world: int, ns_steps: int | list[int] = 5) -> list[int]:
    """The owner rank of each matrix: the largest first, each to the rank with the fewest Newton-Schulz FLOPs so
    far (the lowest rank on a tie). Deterministic: every rank computes the same list from the same shapes.
    ``ns_steps``: one count for all, or one per shape (each parameter group's own).

    Returns a list of ranks in ``range(world)``, one per shape, in the order of ``shapes``.
    """
    steps = ns_steps if isinstance(ns_steps, list) else [ns_steps] * len(shapes)
    cost = [newton_schulz_flops(s, n) for s, n in zip(shapes, steps)]
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += cost[i]
    return owners


def orthogonalize(update: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``update`` (2-D, any float dtype) orthogonalised by ``ns_steps`` quintic Newton-Schulz iterations in
    ``dtype`` (bf16 by default, as ``torch.optim.Muon`` does it; Jordan et al. 2024, "Muon: an optimizer for hidden
    layers in neural networks"): normalised by its Frobenius norm (at least ``eps``), then
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the transpose when the matrix is taller than wide.
    Returns a new ``dtype`` tensor of ``update``'s shape (``update`` is left as it was) whose singular values lie
    near 1 (roughly 0.5 to 1.5, not exactly 1: the coefficients trade convergence for speed)."""
    a, b, c = ns_coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # not in place: in float32, .to() may return update itself (a momentum buffer)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate, as ``torch.optim.Muon``: ``"match_rms_adamw"`` scales by
    ``0.2 sqrt(max(A, B))`` (Liu et al. 2025), ``None`` / ``"original"`` by ``sqrt(max(1, A / B))`` (Jordan)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn in (None, "original"):
        ratio = math.sqrt(max(1, rows / cols))
    else:
        ratio = 1.0
    return lr * ratio


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz orthogonalisations are split over the ranks of the default process
    group (DDP: every rank holds the same gradients when the optimizer steps).

    Each matrix has one owner (:func:`muon_owners`); the owner orthogonalises its momentum-corrected gradient,
    applies decoupled weight decay and the update (the arithmetic of ``torch.optim.Muon``'s step, op for op:
    :func:`orthogonalize`, :func:`adjusted_lr`), and broadcasts the new weights; every rank updates every momentum
    buffer. Without a process group, or with one rank, it is ``torch.optim.Muon``. The state (``momentum_buffer``
    per matrix) and ``state_dict`` are ``torch.optim.Muon``'s, complete on every rank.

    ``ns_dtype``: the orthogonalisations' dtype. bf16 (the default) is ``torch.optim.Muon``'s; float32 is for
    the CPU, where a processor without bf16 matrix instructions (AVX2-only x86) emulates bf16 products: on one
    such core (AMD EPYC, 2026-12-05) five iterations on a 1,536 x 576 matrix took 8.0 s in bf16 against 0.24 s in
    float32, so a CPU run's step took ~45 s instead of a few (docs/measurements.md). With float32 the step is this
    class's own loop at any world size (the same arithmetic, in float32).

    Args:
        params, **kwargs: as ``torch.optim.Muon``.
        ns_dtype: ``torch.bfloat16`` or ``torch.float32``.

    Raises:
        ValueError: as ``torch.optim.Muon`` (a parameter that is not 2-D, a negative learning rate, ...).
    """

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        if ns_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32, not {ns_dtype}")
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.assign_owners()

    def assign_owners(self) -> None:
        """Set :attr:`owner` (``id(param) -> rank``) and :attr:`largest_share` (the largest share of the
        orthogonalisation FLOPs one rank does: 1 / world at best, 1 with one rank) over every parameter group, each
        with its own ``ns_steps``. :meth:`step` calls it again when a group was added since."""
        pairs = [(p, group["ns_steps"]) for group in self.param_groups for p in group["params"]]
        owners = muon_owners([tuple(p.shape) for p, _ in pairs], self.world, [n for _, n in pairs])
        self.owner = {id(p): r for (p, _), r in zip(pairs, owners)}
        load = [0] * self.world
        for (p, n), r in zip(pairs, owners):
            load[r] += newton_schulz_flops(p.shape, n)
        self.largest_share = max(load) / max(sum(load), 1)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step: every rank updates every momentum buffer (fp32, the parameter's shape); each matrix's
        owner orthogonalises its Nesterov update (in :attr:`ns_dtype`), applies weight decay and the update to the
        fp32 weights; then every matrix is broadcast from its owner (asynchronously, all awaited before returning).
        Every rank must call it with the same gradients, as DDP leaves them. Returns ``closure()``'s loss, or
        None."""
        if self.world == 1 and self.ns_dtype == torch.bfloat16:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(id(p) not in self.owner for group in self.param_groups for p in group["params"]):
            self.assign_owners()  # a group added after construction
        pending = []
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                owner = self.owner[id(p)]
                # every matrix is broadcast, with a gradient or not: the collectives depend on the parameter list
                # only, so a rank whose gradient is missing cannot leave the others waiting
                if p.grad is not None:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - momentum)
                if p.grad is not None and owner == self.rank:
                    update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                    update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                           self.ns_dtype)
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
                if self.world > 1:
                    pending.append(dist.broadcast(p.data, src=owner, async_op=True))
        for work in pending:
            work.wait()
        return loss
