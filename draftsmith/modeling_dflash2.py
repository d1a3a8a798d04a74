"""The DFlash2 drafter (z-lab with Inco AI): DFlash plus two small modules, Hugging Face modeling-file style.

DFlash2 keeps DFlash's backbone, anchors, masks and target features (:mod:`draftsmith.modeling`) and adds

* a **grouped dynamic causal convolution** before and after every attention and MLP sublayer
  (:class:`GroupedDynamicCausalConv`): with ``x`` the sublayer's normed input, a kernel ``k_{t,j} = s_j + d_{t,j}``
  over the taps ``j = 0 .. K - 1`` (``K = conv_kernel_size``, 2: ``Conv(x)_t = k_{t,0} x_t + k_{t,1} x_{t-1}``),
  ``s`` a static per-channel kernel and ``d`` a content-dependent correction per group of ``conv_group_size``
  channels projected from ``x``; the pre-sublayer convolution mixes ``x``, the post-sublayer one the sublayer's
  output with a second kernel projected from the same ``x``. It runs inside a block only (causal, zero before the
  anchor), against the accuracy decay toward the end of a block;
* a **candidate selector** (:class:`CandidateSelector`): at each block position the ``selector_top_k`` tokens of
  the drafter's logits are rescored ``S_t(a, b) = z_t(b) + <A(a) * H(h_t), B(b)>`` (``a`` the token chosen at the
  previous position, the anchor for the first; ``h_t`` the position's hidden state; rank ``selector_rank``) and
  the draft is the greedy (or sampled) path through them. Verification stays a plain chain.

The inference interface, the decode semantics and the checkpoint format (``architectures: ["DFlash2DraftModel"]``,
``dflash_config`` with ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``; weights
``layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}``,
``candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}``) are those of the
official ``dflash`` package (``dflash/model.py`` 0.1.0, MIT: ``GroupedDynamicCausalConv``, ``CandidateSelector``,
``DFlash2DraftModel``, ``dflash_generate``); ``tests/test_dflash2.py`` checks both propose the same draft tokens.

Training (the objective is not published by z-lab; docs/design.md "DFlash2 training"): the backbone and the
convolutions learn DFlash's loss unchanged; the selector learns a K-way cross entropy over the unary top-k of each
slot with the gold token injected when it is missing (SpecForge #772, speculators #1006), teacher-forced on the
gold predecessor, weighted by the same slot decay; by default on detached hidden states and logits (the selector
reranks, it does not move the backbone), with ``train.selector_stop_gradient: false`` its gradient reaches the
backbone as in speculators 0.9.0. New modules start as the identity (convolutions) and a near-zero bilinear term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafter_config import DFlash2Config
from draftsmith.drafter_loss import candidate_logits, slot_head_loss, slot_loss_weights
from draftsmith.modeling import (
    DFlashDecoderLayer,
    DFlashDraftModel,
    DFlashTrainOutput,
    PackedBatch,
    accepted_prefix,
    block_targets,
    per_slot_sum,
    supervised_slots,
    supervised_soft_labels,
)


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, static: torch.Tensor, group_size: int
                         ) -> torch.Tensor:
    """Causal depthwise convolution with a static per-channel kernel plus a per-token, per-group correction.

    ``out_t = sum_j static[j] * x_{t-j} + dynamic[t, j, g(c)] * x_{t-j}`` (``x_{t-j} = 0`` before the start of
    the sequence axis), in the official ``dflash.model._grouped_dynamic_convolve`` order of operations.

    Args:
        x: ``[..., T, H]`` (T = the sequence axis: one block).
        dynamic: ``[..., T, K, H / group_size]`` per-token kernel corrections.
        static: ``[K, H]`` per-channel kernel.
        group_size: channels per group.

    Returns:
        ``[..., T, H]``, ``x``'s dtype.
    """
    *lead, T, H = x.shape
    groups = H // group_size
    xs = x.reshape(*lead, T, groups, group_size)
    out = torch.zeros_like(xs)
    for j in range(static.shape[0]):
        shifted = xs if j == 0 else F.pad(xs[..., :T - j, :, :], (0, 0, 0, 0, j, 0))
        out = out + static[j].view(groups, group_size).to(x.dtype) * shifted
        out = torch.addcmul(out, dynamic[..., j, :, None], shifted)
    return out.reshape(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer (z-lab names: ``base_kernel``, ``kernel_projection``).

    Attributes:
        base_kernel: ``[2, K, H]`` static kernels (0: before the sublayer, 1: after).
        kernel_projection: ``Linear(H, 2 * K * H / group_size)``, the per-token corrections of both.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = int(kernel_size), int(group_size)
        self.groups = hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Both convolutions the identity: ``base_kernel[:, 0] = 1``, other taps and the projection 0."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _blocks(self, t: torch.Tensor, block_len: int | None) -> torch.Tensor:
        if block_len is None or t.shape[-2] == block_len:
            return t
        if t.shape[-2] % block_len:
            raise ValueError(f"a stream of {t.shape[-2]} tokens is not whole blocks of {block_len}")
        return t.reshape(*t.shape[:-2], t.shape[-2] // block_len, block_len, t.shape[-1])

    def prepare(self, x: torch.Tensor, block_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved, and the post-sublayer corrections.

        Args:
            x: ``[b, Q, H]`` normed sublayer input; ``Q / block_len`` blocks (``None``: one block).

        Returns:
            ``(conv(x) [b, Q, H], dynamic [b, Q, K, H / group_size])``.
        """
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        blocks = self._blocks(x, block_len)
        pre = dynamic[..., 0, :, :].reshape(*blocks.shape[:-1], self.kernel_size, self.groups)
        out = grouped_dynamic_conv(blocks, pre, self.base_kernel[0], self.group_size)
        return out.reshape(x.shape), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        """The sublayer's output ``y [b, Q, H]`` convolved with the corrections :meth:`prepare` returned."""
        blocks = self._blocks(y, block_len)
        post = dynamic.reshape(*blocks.shape[:-1], self.kernel_size, self.groups)
        return grouped_dynamic_conv(blocks, post, self.base_kernel[1], self.group_size).reshape(y.shape)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """:class:`~draftsmith.modeling.DFlashDecoderLayer` with a convolution pair around attention and the MLP."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size,
                                                       config.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def forward(self, hidden_states: torch.Tensor, target_hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any = None,
                past_key_values: Any = None, block_len: int | None = None) -> torch.Tensor:
        """``[b, Q, H] -> [b, Q, H]``; ``block_len``: tokens per block of the stream (``None``: one block)."""
        residual = hidden_states
        h, kernel = self.attention_conv.prepare(self.input_layernorm(hidden_states), block_len)
        h = self.self_attn(h, target_hidden, position_embeddings, attention_mask, past_key_values)
        hidden_states = residual + self.attention_conv.finish(h, kernel, block_len)
        residual = hidden_states
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states), block_len)
        return residual + self.mlp_conv.finish(self.mlp(h), kernel, block_len)


class CandidateSelector(nn.Module):
    """Low-rank bilinear rescoring of each block position's top-k candidates (z-lab ``CandidateSelector``).

    ``S_t(a, b) = z_t(b) + sum_r A[a, r] H(h_t)[r] B[b, r]`` with ``A = predecessor_codebook [V, r]``,
    ``B = successor_codebook [V, r]``, ``H = hidden_projection``, ``z_t`` the drafter's logits.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        rank, self.top_k = int(config.selector_rank), int(config.selector_top_k)
        std = float(config.initializer_range)
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, rank) * std)
        self.successor_codebook = nn.Parameter(torch.randn(config.vocab_size, rank) * std)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def score(self, projected: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor,
              unary: torch.Tensor, successors: torch.Tensor | None = None) -> torch.Tensor:
        """``S(a, b)`` of ``candidates [..., k]`` after ``predecessor [...]`` given ``projected = H(h) [..., r]``
        and their logits ``unary [..., k]``: ``[..., k]`` float32. ``successors``: ``B[candidates] [..., k, r]``
        when the caller gathered them already (:meth:`select` does once per block)."""
        if successors is None:
            successors = self.successor_codebook[candidates]
        pair = torch.einsum("...r,...kr->...k", self.predecessor_codebook[predecessor] * projected, successors)
        return unary.float() + pair.float()

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The draft path through the top-k candidates, position by position.

        Args:
            hidden: ``[b, P, H]`` drafter hidden states of block slots 1..P.
            logits: ``[b, P, V]`` their logits (:meth:`DFlashDraftModel.compute_logits`).
            anchor_ids: ``[b]`` the block's first token (the predecessor of slot 1).
            temperature: 0 = argmax of ``S``; > 0 = sample from ``softmax(S / temperature)`` over the candidates.
            generator: RNG of the samples (default: torch's global one, as the official code draws).

        Returns:
            ``(tokens [b, P] int64, candidates [b, P, k] int64, q [b, P, k] float32 or None)``: ``q`` is the
            sampling distribution over ``candidates`` (rejection sampling needs it), ``None`` when greedy.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        successors = self.successor_codebook[candidates]  # [b, P, k, r]: one gather for the whole block
        predecessor, path, rows = anchor_ids, [], []
        for t in range(hidden.shape[1]):
            scores = self.score(projected[:, t], predecessor, candidates[:, t], unary[:, t], successors[:, t])
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                rows.append(q)
            else:
                index = scores.argmax(-1)
            predecessor = candidates[:, t].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, 1), candidates, torch.stack(rows, 1) if rows else None


@dataclass
class DFlash2TrainOutput(DFlashTrainOutput):
    """:class:`~draftsmith.modeling.DFlashTrainOutput` plus the selector's statistics (teacher-forced).

    Attributes:
        loss: ``DFlash loss + selector_loss_weight * selector loss``.
        weighted_ce: ``sum(CE * w) + selector_loss_weight * sum(CE_sel * w)`` (differentiable; the trainer divides
            it by the whole optimizer step's loss weight).
        selector_loss: scalar float32, ``sum(CE_sel * w) / sum(w)`` over valid slots.
        selector_ce_sum: ``[B - 1]`` float32 selector CE summed per slot.
        selector_correct: ``[B - 1]`` int64 slots whose best-scored candidate (serving candidates: the gold token
            not injected) is the label.
        candidate_recall: ``[B - 1]`` int64 slots whose label is among the unary top-k.
    """

    selector_loss: torch.Tensor | None = None
    selector_ce_sum: torch.Tensor | None = None
    selector_correct: torch.Tensor | None = None
    candidate_recall: torch.Tensor | None = None


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash2 drafter (z-lab format; the inference interface of ``dflash.model.DFlash2DraftModel``)."""

    config_class = DFlash2Config
    _no_split_modules = ["DFlash2DecoderLayer"]
    LAYER_CLASS = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        #: weight of the selector's loss in :meth:`training_forward` (``train.selector_loss_weight``)
        self.selector_loss_weight = 1.0
        #: the selector's loss trains only the selector (``train.selector_stop_gradient``), else the backbone too
        self.selector_stop_gradient = True
        for layer in self.layers:  # post_init may have drawn the projections: start as the identity
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module | torch.Tensor,
                temperature: float, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft tokens of one block: :meth:`CandidateSelector.select` on the logits of ``hidden [b, P, H]``."""
        return self.candidate_selector.select(hidden, self.compute_logits(hidden, output_head), anchor_ids,
                                              temperature, generator)

    def training_forward(self, batch: PackedBatch, embed_weight: torch.Tensor, head_weight: torch.Tensor, *,
                         gamma: float, dpace_alpha: float | None = None, use_target_tokens: bool = False,
                         masks: dict | None = None, backend: str = "auto",
                         logits_chunk_bytes: int = 1 << 30) -> DFlash2TrainOutput:
        """DFlash's loss (:meth:`DFlashDraftModel.training_forward`) plus :attr:`selector_loss_weight` x the
        selector's.

        Selector loss per valid slot k (label ``y_k``, predecessor ``y_{k-1}``, the anchor token for k = 1):
        candidates = the unary top-k of the slot's logits, ``y_k`` replacing the lowest one when missing;
        ``CE_sel = logsumexp_b S(y_{k-1}, b) - S(y_{k-1}, y_k)``; weighted by ``exp(-(k - 1) / gamma)`` (or
        D-PACE's weight of the slot, ``dpace_alpha``) and normalised as the DFlash loss. With
        :attr:`selector_stop_gradient` (the default) on detached hidden states and logits: it trains the selector
        only. Without, its gradient also reaches the backbone through the selector's hidden projection and the
        candidates' logits (:func:`~draftsmith.drafter_loss.candidate_logits`), as speculators 0.9.0 trains it.

        Raises:
            ValueError: as :meth:`DFlashDraftModel.training_forward`.
        """
        if batch.feature_scales is not None:
            raise ValueError("training_forward: the batch's features are float8 with scales; call "
                             "PackedBatch.dequantize(dtype) first")
        B, k = self.block_size, self.candidate_selector.top_k
        hidden = self.block_hidden(batch, embed_weight, masks, backend)[:, :, 1:]  # [R, A, B-1, H]
        labels, valid = block_targets(batch, B, use_target_tokens)
        anchor_tok = torch.gather(batch.input_ids, 1, batch.anchors)
        predecessors = torch.cat([anchor_tok[:, :, None], labels[:, :, :-1]], dim=2)
        index, slot = supervised_slots(valid)
        tgt, prev = labels.view(-1).index_select(0, index), predecessors.reshape(-1).index_select(0, index)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        head = self.head_loss_options(logits_chunk_bytes)
        multiplier, softcap = head["multiplier"], head["softcap"]
        soft = supervised_soft_labels(batch, B, index)  # the backbone's labels; the selector and D-PACE: the greedy
        loss_rows, ce, pred, top_val, top_idx = slot_head_loss(h, head_weight, tgt, soft, top_k=k, **head)
        w, weight_sum = slot_loss_weights(ce, slot, index, valid, gamma=gamma, dpace_alpha=dpace_alpha)
        loss = (loss_rows * w).sum() / weight_sum.clamp_min(1e-12)
        # the selector: teacher-forced on the gold predecessor, gold injected into the loss's candidates
        with torch.no_grad():
            gold_hit = top_idx == tgt[:, None]
            recalled = gold_hit.any(-1)
            gold_logit = (h.to(head_weight.dtype) * head_weight[tgt]).sum(-1).float() * multiplier
            if softcap:
                gold_logit = torch.tanh(gold_logit / softcap) * softcap
            lowest = top_val.argmin(-1)
            inject = torch.where(recalled, gold_hit.float().argmax(-1), lowest)
            loss_idx, loss_val = top_idx.clone(), top_val.clone()
            rows = torch.arange(tgt.shape[0], device=tgt.device)
            loss_idx[rows, inject] = tgt
            loss_val[rows, inject] = gold_logit
        if self.selector_stop_gradient:
            projected = self.candidate_selector.hidden_projection(h.detach())
        else:  # the selector's loss trains the backbone too: through its projection and the candidates' logits
            projected = self.candidate_selector.hidden_projection(h)
            loss_val = candidate_logits(h, loss_val, loss_idx, head_weight, multiplier=multiplier, softcap=softcap)
        scores = self.candidate_selector.score(projected, prev, loss_idx, loss_val)
        sel_ce = torch.logsumexp(scores, -1) - scores[rows, inject]
        sel_loss = (sel_ce * w).sum() / weight_sum.clamp_min(1e-12)
        total = loss + float(self.selector_loss_weight) * sel_loss
        # the step-normalised form the trainer backpropagates (sum, not mean: see DFlashTrainOutput.weighted_ce)
        weighted_ce = (loss_rows * w).sum() + float(self.selector_loss_weight) * (sel_ce * w).sum()
        with torch.no_grad():
            nslot = B - 1
            serving = self.candidate_selector.score(projected.detach(), prev, top_idx, top_val)
            sel_hit = top_idx[rows, serving.argmax(-1)] == tgt
            hit = pred == tgt
            per_slot = lambda values: per_slot_sum(slot, nslot, values)  # noqa: E731
            accept_sum, full_blocks = accepted_prefix(valid, index, hit)
            return DFlash2TrainOutput(
                total, weighted_ce, weight_sum, per_slot(ce.detach()), per_slot(hit), per_slot(torch.ones_like(slot)),
                accept_sum, full_blocks, selector_loss=sel_loss.detach(), selector_ce_sum=per_slot(sel_ce.detach()),
                selector_correct=per_slot(sel_hit), candidate_recall=per_slot(recalled))


def model_class_for(architectures: list[str] | None) -> type[DFlashDraftModel]:
    """:class:`DFlash2DraftModel` when ``architectures`` (a ``config.json``'s) names it, else
    :class:`~draftsmith.modeling.DFlashDraftModel`."""
    return DFlash2DraftModel if "DFlash2DraftModel" in (architectures or []) else DFlashDraftModel


__all__ = ["DFlash2DraftModel", "model_class_for", "DFlash2DecoderLayer", "GroupedDynamicCausalConv",
           "CandidateSelector", "DFlash2TrainOutput", "grouped_dynamic_conv"]
