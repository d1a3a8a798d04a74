"""The drafter's training loss pieces: cross entropy through the target's frozen LM head in chunks (the ``[N, V]``
float32 logits of every supervised slot never held at once) and the per-slot weights of the DFlash loss: the fixed
decay ``exp(-(k - 1) / gamma)`` or D-PACE's confidence-derived weights (``train.loss_weighting``).

Shared by :class:`draftsmith.modeling.DFlashDraftModel`, :class:`draftsmith.modeling_dflash2.DFlash2DraftModel`
and the trainer's step weights (:func:`draftsmith.train.batches.loss_weight`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("draftsmith.train")

#: why the fused loss stopped being used in this process (its compilation failed), else None
FUSED_FAILED: str | None = None


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy through a frozen LM head, ``[N, V]`` logits never held at once.

    Forward walks the rows in chunks: float32 logits of the chunk, their log-sum-exp, CE and argmax, and the
    gradient of each row's CE with respect to its hidden state (``(softmax - onehot) * dz/dlogit @ W``), which
    is kept (``[N, H]``) so the backward is one scaling. The head is frozen, so no ``[V, H]`` gradient exists.
    With ``top_k > 0`` it also returns each row's ``top_k`` largest logits and their ids (DFlash2's candidates).
    With soft labels (``soft_ids``, ``soft_probs``: a distribution over k tokens per row) the differentiable output
    is the cross entropy against them, ``lse - sum_j p_j z_{id_j}`` (gradient ``softmax - sum_j p_j onehot(id_j)``),
    and the label's CE is returned beside it without gradient.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, multiplier, softcap, chunk_rows, top_k=0, fused=False,
                soft_ids=None, soft_probs=None):
        global FUSED_FAILED
        if fused and hidden.is_cuda and FUSED_FAILED is None:  # elsewhere the in-place chunks hold less memory
            try:
                return _fused_forward(ctx, hidden, head_weight, labels, multiplier, softcap, chunk_rows, top_k,
                                      soft_ids, soft_probs)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # a compiler failure must not stop a training run: the eager chunks below
                FUSED_FAILED = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                log.warning("the fused LM-head loss failed to compile or run (%s); this process uses the eager "
                            "chunks from here on", FUSED_FAILED)
        compute = head_weight.dtype
        n = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        soft = soft_ids is not None
        ce, pred, grad, top_val, top_idx, label_ce = _outputs(hidden, compute, top_k, need_grad, soft)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk_rows):
                y = labels[s:s + chunk_rows]
                z = F.linear(hidden[s:s + chunk_rows].to(compute), head_weight).float()
                dz = None  # d logit / d (h @ W.T), when not 1
                if multiplier != 1.0:
                    z.mul_(multiplier)
                    dz = multiplier
                if softcap:
                    z = torch.tanh(z.div_(softcap))
                    dz = (1.0 - z * z) * multiplier
                    z.mul_(softcap)
                lse = torch.logsumexp(z, dim=-1)
                ce[s:s + chunk_rows] = lse - z.gather(1, y[:, None])[:, 0]
                if soft:
                    sid, sp = soft_ids[s:s + chunk_rows], soft_probs[s:s + chunk_rows]
                    label_ce[s:s + chunk_rows] = ce[s:s + chunk_rows]
                    ce[s:s + chunk_rows] = lse - (z.gather(1, sid) * sp).sum(-1)
                pred[s:s + chunk_rows] = z.argmax(-1)
                if top_k:
                    top_val[s:s + chunk_rows], top_idx[s:s + chunk_rows] = torch.topk(z, top_k, dim=-1, sorted=False)
                if need_grad:
                    g = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                    if soft:
                        g.scatter_add_(1, sid, -sp)
                    else:
                        g[torch.arange(g.shape[0], device=g.device), y] -= 1.0
                    if dz is not None:
                        g.mul_(dz)
                    grad[s:s + chunk_rows] = g.to(compute) @ head_weight
        return _finish(ctx, hidden, ce, pred, grad, top_val, top_idx, label_ce)

    @staticmethod
    def backward(ctx, grad_ce, grad_pred, grad_top_val, grad_top_idx, grad_label_ce):
        (grad,) = ctx.saved_tensors
        return ((grad.float() * grad_ce[:, None]).to(ctx.hidden_dtype), None, None, None, None, None, None, None,
                None, None)


def _outputs(hidden: torch.Tensor, compute: torch.dtype, top_k: int, need_grad: bool, soft: bool = False):
    """The chunked loss's outputs, filled chunk by chunk: ``ce [n]`` float32, ``pred [n]`` int64, the gradient
    ``[n, H]`` in the head's dtype (None without ``need_grad``), ``top_val [n, top_k]`` float32, ``top_idx`` int64,
    ``label_ce [n]`` float32 with soft labels (else ``[0]``)."""
    n, device = hidden.shape[0], hidden.device
    return (torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.long, device=device),
            torch.empty(hidden.shape, dtype=compute, device=device) if need_grad else None,
            torch.empty(n, top_k, dtype=torch.float32, device=device),
            torch.empty(n, top_k, dtype=torch.long, device=device),
            torch.empty(n if soft else 0, dtype=torch.float32, device=device))


def _finish(ctx, hidden, ce, pred, grad, top_val, top_idx, label_ce):
    """Keep the gradient for the backward, mark the outputs that carry none; the forward's return value."""
    if grad is not None:
        ctx.save_for_backward(grad)
    ctx.hidden_dtype = hidden.dtype
    ctx.mark_non_differentiable(pred, top_val, top_idx, label_ce)
    return ce, pred, top_val, top_idx, label_ce


#: soft labels of at most this many tokens a row are subtracted from :func:`logit_statistics`' gradient by one
#: comparison per logit and token, unrolled in its compiled pass; more are scattered into it (``scatter_add``)
SOFT_UNROLL_MAX_K = 64


def logit_statistics(z: torch.Tensor, labels: torch.Tensor, multiplier: float, softcap: float | None,
                     need_grad: bool, top_k: int = 0, soft_ids: torch.Tensor | None = None,
                     soft_probs: torch.Tensor | None = None):
    """One chunk's statistics from its logits, written for ``torch.compile`` to fuse: a few reads of the chunk's
    logits in their own dtype (the row reductions, then the gradient) instead of the eager chunk's eight passes over
    a float32 copy. Eager, it holds several float32 ``[n, V]`` temporaries: :func:`head_cross_entropy` calls it
    compiled, on a GPU, only.

    Args:
        z: ``[n, V]`` logits ``hidden @ head_weight.T`` in the head's dtype (bf16 on a GPU).
        labels: ``[n]`` int64.
        multiplier, softcap: ``dflash_config``'s ``output_multiplier`` (> 0) and ``final_logit_softcapping``
            (None: off).
        need_grad: also return the CE's gradient with respect to ``z``.
        top_k: also return the ``top_k`` largest final logits (float32) and their ids (DFlash2's candidates),
            chosen on ``z`` itself (the multiplier and softcap keep the order) so that no float32 copy is made.
        soft_ids, soft_probs: ``[n, k]`` int64 / float32 soft labels (k distinct tokens per row, probabilities
            summing to 1), or None: ``ce`` and ``grad`` are then against them (``lse - sum_j p_j z_j``,
            ``softmax - sum_j p_j onehot(id_j)``: k comparisons per logit, fused like the label's one, up to
            :data:`SOFT_UNROLL_MAX_K`; a scatter of the k probabilities above it) and ``label_ce`` is the label's CE.

    Returns:
        ``(ce [n] float32, pred [n] int64, grad [n, V] in z's dtype or None, top_val [n, top_k] float32 or None,
        top_idx [n, top_k] int64 or None, label_ce [n] float32 or None)``; ``grad = (softmax - onehot) * d logit /
        d z``, as the eager chunk of :class:`_ChunkedHeadCrossEntropy` computes it (float32, then rounded to z's
        dtype).
    """

    def final(x):  # raw logits -> the drafter's logits, float32, and d final / d raw
        x = x.float()
        d = None
        if multiplier != 1.0:
            x = x * multiplier
            d = multiplier
        if softcap:
            t = torch.tanh(x / softcap)
            d = (1.0 - t * t) * multiplier
            x = t * softcap
        return x, d

    zf, dz = final(z)
    top = zf.amax(dim=-1, keepdim=True)  # log-sum-exp by hand: one max, one sum of exponentials
    lse = (top + torch.log(torch.exp(zf - top).sum(dim=-1, keepdim=True)))[:, 0]
    ce = lse - zf.gather(1, labels[:, None])[:, 0]
    label_ce = None
    if soft_ids is not None:
        label_ce, ce = ce, lse - (zf.gather(1, soft_ids) * soft_probs).sum(-1)
    pred = zf.argmax(-1)
    top_val = top_idx = None
    if top_k:
        raw_val, top_idx = torch.topk(z, top_k, dim=-1, sorted=False)
        top_val = final(raw_val)[0]
    if not need_grad:
        return ce, pred, None, top_val, top_idx, label_ce
    g = torch.exp(zf - lse[:, None])
    vocab = torch.arange(zf.shape[1], device=zf.device)[None, :]
    if soft_ids is None:
        g = g - (vocab == labels[:, None]).to(g.dtype)
    elif soft_ids.shape[1] <= SOFT_UNROLL_MAX_K:
        for j in range(soft_ids.shape[1]):  # k is static: unrolled, one fused pass
            g = g - torch.where(vocab == soft_ids[:, j:j + 1], soft_probs[:, j:j + 1], 0.0)
    else:  # more tokens than comparisons per logit pay for: their probabilities scattered in, one more pass
        g = g.scatter_add(1, soft_ids, -soft_probs.to(g.dtype))
    if dz is not None:
        g = g * dz
    return ce, pred, g.to(z.dtype), top_val, top_idx, label_ce


_COMPILED_STATISTICS = None


def _compiled_statistics():
    """:func:`logit_statistics` compiled once, whole (``fullgraph``: a graph break would run it eagerly, with its
    float32 temporaries); the row count is marked dynamic at each call (the last chunk and each step's count
    differ), the vocabulary and the scalars stay static."""
    global _COMPILED_STATISTICS
    if _COMPILED_STATISTICS is None:
        _COMPILED_STATISTICS = torch.compile(logit_statistics, fullgraph=True)
    return _COMPILED_STATISTICS


def _fused_forward(ctx, hidden, head_weight, labels, multiplier, softcap, chunk_rows, top_k, soft_ids=None,
                   soft_probs=None):
    """:class:`_ChunkedHeadCrossEntropy`'s forward with each chunk's statistics from the compiled
    :func:`logit_statistics` (CUDA only): the same outputs, a fraction of the memory traffic."""
    if top_k and multiplier <= 0:
        raise ValueError(f"output_multiplier {multiplier}: the fused loss needs a positive one (it picks the top-k "
                         "candidates before the multiplier)")
    compute = head_weight.dtype
    n = hidden.shape[0]
    need_grad = ctx.needs_input_grad[0]
    stats = _compiled_statistics()
    soft = soft_ids is not None
    ce, pred, grad, top_val, top_idx, label_ce = _outputs(hidden, compute, top_k, need_grad, soft)
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            z = F.linear(hidden[s:e].to(compute), head_weight)
            y = labels[s:e]
            sid, sp = (soft_ids[s:e], soft_probs[s:e]) if soft else (None, None)
            for t in (z, y, sid, sp):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            c, p, g, tv, ti, lc = stats(z, y, multiplier, softcap, need_grad, top_k, sid, sp)
            ce[s:e], pred[s:e] = c, p
            if soft:
                label_ce[s:e] = lc
            if top_k:
                top_val[s:e], top_idx[s:e] = tv, ti
            if need_grad:
                torch.matmul(g, head_weight, out=grad[s:e])
            del z, g  # the next chunk's logits are not allocated beside this one's
    return _finish(ctx, hidden, ce, pred, grad, top_val, top_idx, label_ce)


def head_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, *,
                       multiplier: float = 1.0, softcap: float | None = None, chunk_bytes: int = 1 << 30,
                       fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy of ``logits = softcap(multiplier * hidden @ head_weight.T)`` against ``labels``, chunked.

    The dominant memory of DFlash training at a large vocabulary is the float32 logits of every supervised
    slot (``N x V``: 60 GB for 60K slots at V = 248,320). This computes the same per-row CE in chunks of about
    ``chunk_bytes`` of float32 logits and never materialises them all; the head is frozen (no gradient). On
    float32 inputs the result and the gradient equal ``F.cross_entropy(reduction="none")`` of the full logits up
    to summation order (tested). Logits are computed in ``head_weight``'s dtype, then promoted to float32, as
    the unchunked path does under bf16 autocast. Softcap and multiplier follow ``dflash_config``
    (``final_logit_softcapping``: ``c * tanh(z / c)``).

    Args:
        hidden: ``[N, H]`` drafter hidden states (differentiable).
        head_weight: ``[V, H]`` the target's LM head (frozen).
        labels: ``[N]`` int64 token ids.
        chunk_bytes: float32 logits per chunk.
        fused: on a GPU, each chunk's softmax, CE, argmax and gradient by the compiled :func:`logit_statistics`
            (``train.compile``): a few reads of the chunk's logits in the head's dtype instead of eight passes over
            a float32 copy; results equal the eager chunk's up to summation order. Ignored off a GPU.

    Returns:
        ``(ce [N] float32, differentiable w.r.t. hidden; argmax prediction [N] int64)``.
    """
    rows = max(1, int(chunk_bytes) // (4 * head_weight.shape[0]))
    ce, pred, _, _, _ = _ChunkedHeadCrossEntropy.apply(hidden, head_weight, labels, float(multiplier),
                                                       float(softcap) if softcap else None, rows, 0, bool(fused))
    return ce, pred


def head_cross_entropy_topk(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, top_k: int, *,
                            multiplier: float = 1.0, softcap: float | None = None, chunk_bytes: int = 1 << 30,
                            fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`head_cross_entropy` plus each row's ``top_k`` largest logits, from the same chunks (no second pass
    through the head): ``(ce [N], pred [N], top_logits [N, top_k] float32, top_ids [N, top_k] int64)``; the
    top-k are in ``torch.topk(sorted=False)`` order, as the official DFlash2 selector takes them, and carry no
    gradient. ``fused``: as :func:`head_cross_entropy`'s."""
    rows = max(1, int(chunk_bytes) // (4 * head_weight.shape[0]))
    return _ChunkedHeadCrossEntropy.apply(hidden, head_weight, labels, float(multiplier),
                                          float(softcap) if softcap else None, rows, int(top_k), bool(fused))[:4]


def head_soft_cross_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                            soft_ids: torch.Tensor, soft_probs: torch.Tensor, *, top_k: int = 0,
                            multiplier: float = 1.0, softcap: float | None = None, chunk_bytes: int = 1 << 30,
                            fused: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross entropy against soft labels, chunked as :func:`head_cross_entropy` (one pass through the head, the
    same memory): ``soft_ce = lse(z) - sum_j p_j z_{id_j}`` per row, which is ``KL(p || softmax(z)) + H(p)``, so its
    gradient is the KL's (distillation from the target's distribution, as speculators 0.9.0's DFlash2 loss
    ``kl_div``; here over the target's stored top k, renormalised: ``train.labels: target_topk``).

    Args:
        hidden: ``[N, H]`` drafter hidden states (differentiable).
        head_weight: ``[V, H]`` the target's LM head (frozen).
        labels: ``[N]`` int64 hard labels (the target's greedy token): ``label_ce``, ``pred``'s hits and D-PACE's
            confidence use them.
        soft_ids: ``[N, k]`` int64 distinct token ids per row.
        soft_probs: ``[N, k]`` float32 their probabilities, each row summing to 1 (:func:`topk_soft_labels`).
        top_k: also return each row's ``top_k`` largest logits and their ids, as :func:`head_cross_entropy_topk`.
        multiplier, softcap, chunk_bytes, fused: as :func:`head_cross_entropy`'s.

    Returns:
        ``(soft_ce [N] float32 differentiable w.r.t. hidden, label_ce [N] float32 without gradient, pred [N]
        int64, top_logits [N, top_k] float32, top_ids [N, top_k] int64)``.

    Raises:
        ValueError: ``soft_ids`` and ``soft_probs`` of another shape than ``[N, k]`` each.
    """
    if soft_ids.shape != soft_probs.shape or soft_ids.dim() != 2 or soft_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"soft labels: ids {tuple(soft_ids.shape)} and probabilities {tuple(soft_probs.shape)} "
                         f"must both be [N, k] with N = {hidden.shape[0]} rows")
    rows = max(1, int(chunk_bytes) // (4 * head_weight.shape[0]))
    ce, pred, top_val, top_idx, label_ce = _ChunkedHeadCrossEntropy.apply(
        hidden, head_weight, labels, float(multiplier), float(softcap) if softcap else None, rows, int(top_k),
        bool(fused), soft_ids, soft_probs.float())
    return ce, label_ce, pred, top_val, top_idx


def slot_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                   soft: tuple[torch.Tensor, torch.Tensor] | None = None, *, top_k: int = 0, **head
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's per-slot loss through the head, hard or soft labels alike (what both drafters' training
    forwards call): :func:`head_cross_entropy_topk` of ``labels``, or with ``soft = (ids [N, k], probs [N, k])``
    :func:`head_soft_cross_entropy`.

    Args:
        hidden, head_weight, labels, top_k: as :func:`head_soft_cross_entropy`'s.
        soft: the supervised slots' soft labels (:func:`draftsmith.modeling.supervised_soft_labels`), or None.
        head: ``multiplier``, ``softcap``, ``chunk_bytes``, ``fused``, as :func:`head_cross_entropy`'s.

    Returns:
        ``(loss_rows [N] differentiable, label_ce [N], pred [N], top_logits [N, top_k], top_ids [N, top_k])``; with
        hard labels ``loss_rows`` is the label's CE and ``label_ce`` the same tensor.
    """
    if soft is None:
        ce, pred, top_val, top_idx = head_cross_entropy_topk(hidden, head_weight, labels, top_k, **head)
        return ce, ce, pred, top_val, top_idx
    return head_soft_cross_entropy(hidden, head_weight, labels, *soft, top_k=top_k, **head)


def topk_soft_labels(logprobs: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The soft labels' probabilities from the target's top-k log-probabilities: ``softmax(logprobs / T)`` over
    the k stored tokens, i.e. the target's distribution restricted to them and renormalised (the mass outside
    the top k, typically a few percent, is left out).

    Args:
        logprobs: ``[..., k]`` float log-probabilities under the target's full distribution (features'
            ``target_topk_logprobs``).
        temperature: > 0; 1 keeps the target's distribution.

    Returns:
        ``[..., k]`` float32 probabilities, summing to 1 over the last dimension.
    """
    return torch.softmax(logprobs.float() / float(temperature), dim=-1)


class _CandidateLogits(torch.autograd.Function):
    """The logits of a few candidate tokens per row, already computed, made differentiable w.r.t. the hidden state.

    Forward returns ``values`` as they are; backward is ``dL/dh_n = sum_k dL/dz_nk * dz_nk/dlogit * W[ids_nk]`` by
    one ``embedding_bag`` (the ``[N, k, H]`` rows of the head are never gathered).
    """

    @staticmethod
    def forward(ctx, hidden, values, ids, head_weight, multiplier, softcap):
        ctx.save_for_backward(values, ids, head_weight)
        ctx.multiplier, ctx.softcap, ctx.hidden_dtype = multiplier, softcap, hidden.dtype
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        values, ids, head_weight = ctx.saved_tensors
        scale = grad.float() * ctx.multiplier
        if ctx.softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (value / c)^2
            scale = scale * (1.0 - (values.float() / ctx.softcap) ** 2)
        dh = F.embedding_bag(ids, head_weight, per_sample_weights=scale.to(head_weight.dtype), mode="sum")
        return dh.to(ctx.hidden_dtype), None, None, None, None, None


def candidate_logits(hidden: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, head_weight: torch.Tensor, *,
                     multiplier: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Differentiable logits of ``k`` candidate tokens per row whose values the chunked head pass already computed
    (:func:`head_cross_entropy_topk`'s top-k, DFlash2's candidates), so a loss on them trains the hidden states
    through the frozen head without a second ``[N, V]`` matmul: speculators 0.9.0's DFlash2 selector loss reaches
    the backbone this way (``unary_logits.gather``; ``train.selector_stop_gradient: false``).

    Args:
        hidden: ``[N, H]`` the rows' hidden states (differentiable).
        values: ``[N, k]`` float32 ``softcap(multiplier * hidden @ head_weight[ids].T)``, computed under no grad.
        ids: ``[N, k]`` int64 candidate token ids.
        head_weight: ``[V, H]`` the frozen LM head.
        multiplier, softcap: as the head pass's (``dflash_config``); ``None`` or 0: no softcap.

    Returns:
        ``[N, k]`` float32, equal to ``values``; its gradient w.r.t. ``hidden`` is the true logits' gradient
        (tested against autograd through ``head_weight[ids]``).
    """
    return _CandidateLogits.apply(hidden, values, ids, head_weight, float(multiplier),
                                  float(softcap) if softcap else None)


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """``[B - 1]`` float32 decay weights ``exp(-(k - 1) / gamma)`` for slots k = 1..B-1 (SpecForge DFlash loss)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE per-slot loss weights of draft blocks (Dynamic Position-Aware Cross-Entropy, arXiv 2605.18810,
    Eq. 7-8): ``w_j = sum_{m >= j} prod_{i <= m} q~_i`` over a block's slots, with the smoothed confidence
    ``q~_i = (1 - alpha) * q_i + alpha`` (Eq. 7) of the drafter's probability ``q_i = exp(-CE_i)`` of slot i's label.

    ``w_j`` is how much of the block's expected accepted length depends on slot j: the probability that slots
    1..m are all accepted, summed over the m >= j that slot j gates. Early slots weigh most while the drafter is
    unsure of them, and the weight moves to later slots as the early ones become reliable (the fixed decay
    ``exp(-(k - 1) / gamma)`` never moves). An invalid slot (no label: past the document or the loss mask) has
    weight 0 and does not break the product (``q~ = 1`` there), as speculators 0.9.0 computes it
    (``speculators.losses.utils.dpace_loss_decay``).

    Args:
        confidence: ``[..., S]`` float, ``q_i`` in [0, 1] per slot (any value where ``valid`` is False); the last
            dimension is the block's slots 1..B-1 in order.
        valid: ``[..., S]`` bool, the slots that have a label.
        alpha: smoothing in (0, 1]; 1 weighs slot j by the number of valid slots from j on.

    Returns:
        ``[..., S]`` float32 weights, 0 on invalid slots, no gradient.

    Raises:
        ValueError: ``alpha`` outside (0, 1] (0 would zero every weight past the first unsure slot).
    """
    if not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"D-PACE alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        mask = valid.to(torch.float32)
        smooth = torch.where(valid, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(mask))
        prefix = torch.cumprod(smooth, dim=-1)
        return (prefix * mask).flip(-1).cumsum(-1).flip(-1) * mask


def slot_loss_weights(ce: torch.Tensor, slot: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, *,
                      gamma: float, dpace_alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of a batch's supervised slots and their normaliser, for the loss ``sum(CE * w) / normaliser``.

    Fixed decay (``dpace_alpha`` None): ``w = exp(-(k - 1) / gamma)`` (:func:`slot_weights`), normaliser
    ``sum(w)``. D-PACE (``dpace_alpha`` set): ``w`` from :func:`dpace_weights` of ``q = exp(-CE)``, normaliser the
    number of supervised slots, as speculators and the paper reduce it (D-PACE's weights are not known before the
    forward, the count is: :func:`draftsmith.train.batches.loss_weight`).

    Args:
        ce: ``[N]`` float32 cross entropy of the supervised slots (``valid``'s True entries, in order).
        slot: ``[N]`` int64 their slot index 0..B-2 (slot k = index + 1).
        index: ``[N]`` int64 their positions in ``valid`` flattened (:func:`draftsmith.modeling.supervised_slots`:
            indexing by it needs no host sync, a boolean mask does).
        valid: ``[R, A, B - 1]`` bool.

    Returns:
        ``(w [N] float32 without gradient, normaliser 0-dim float32)``.
    """
    if dpace_alpha is None:
        w = slot_weights(valid.shape[-1] + 1, gamma, ce.device)[slot]
        return w, w.sum()
    confidence = torch.zeros(valid.numel(), dtype=torch.float32, device=ce.device)
    confidence.index_copy_(0, index, torch.exp(-ce.detach().float()))
    w = dpace_weights(confidence.view(valid.shape), valid, float(dpace_alpha)).view(-1).index_select(0, index)
    return w, valid.sum().to(torch.float32)
