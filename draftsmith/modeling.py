"""The DFlash drafter (block-diffusion speculative drafter, arXiv 2602.06036), Hugging Face modeling-file style.

The drafter has no embedding and no LM head of its own: the block's tokens are embedded with the *target's*
input embedding and its logits come from the *target's* LM head (both frozen). What it owns:

* ``fc``: ``Linear(n * H, H)`` over the concatenated context features of the ``n`` tapped target layers
  (layer id i = output of target decoder layer i = HF ``output_hidden_states[i + 1]``), then ``hidden_norm``;
* ``num_hidden_layers`` Qwen3-style decoder layers whose attention takes its queries from the block stream and
  its keys / values from ``cat(ctx, block)`` where ``ctx = hidden_norm(fc(features))`` (the same ctx feeds every
  layer, not passed through the layer's ``input_layernorm``), with RoPE at absolute positions;
* a final ``norm``.

The inference interface (``forward``, ``compute_logits``, ``block_size``, ``mask_token_id``,
``target_layer_ids``, ``config``, ``from_pretrained``) and the checkpoint format (``config.json`` with
``dflash_config``, ``model.safetensors`` with the names ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*``) are
those of the official z-lab ``dflash`` package (``dflash/model.py``, 0.1.0, MIT), so an exported folder loads in
it, in vLLM and in SGLang unchanged. The numerics match it (tested in ``tests/test_modeling.py``).

Training (:meth:`DFlashDraftModel.training_forward`) runs the *same* layers on packed rows of several documents:
anchors ``a`` sampled per document where ``loss_mask[a]`` and ``loss_mask[a + 1]``; block
``[token at a, mask x (B - 1)]`` at positions ``a .. a + B - 1``; the block sees context features at positions
``< a`` of its own document only (sliding layers: only ``>= a + k - (W - 1)`` for slot k), itself bidirectionally
in full-attention layers and causally in sliding ones, and never another block. One mask function
(:func:`dflash_mask_mod`) is used both as a ``flex_attention`` ``BlockMask`` (CUDA) and as a dense SDPA boolean
mask (CPU). Loss: cross entropy x ``exp(-(k - 1) / gamma)`` on slots ``k >= 1`` normalised by the weight sum
(SpecForge's DFlash recipe, gamma = 7 for B = 16); the trainer normalises the weighted sum by the weight of the
whole optimizer step instead (``weighted_ce``, :mod:`draftsmith.train.trainer`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from draftsmith.drafter_config import (
    DFlashConfig,
    draft_value,
    drafter_config_dict,
    drafter_config_from_dict,
    layer_is_causal,
    layer_window,
)
from draftsmith.drafter_loss import slot_head_loss, slot_loss_weights, slot_weights, topk_soft_labels
from draftsmith.io import atomic_path

log = logging.getLogger("draftsmith.modeling")



# ---------------------------------------------------------------------------------------------------------------
# Attention masks (one definition for inference, dense SDPA and flex_attention)
# ---------------------------------------------------------------------------------------------------------------

def inference_attention_mask(q_len: int, k_len: int, *, is_causal: bool, sliding_window: int | None,
                             device: torch.device) -> torch.Tensor:
    """Boolean visibility ``[1, 1, q_len, k_len]`` of one decode step (keys = cached ctx + new ctx + block).

    Keys are contiguous positions ending with the block, so key index differences are position differences
    (the official ``dflash.model._attention_mask``): causal -> key <= query; sliding -> query - key < W (and
    key - query < W when not causal).
    """
    q_pos = k_len - q_len + torch.arange(q_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if is_causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
        if not is_causal:
            visible &= k_pos - q_pos < sliding_window
    return visible[None, None]


def dflash_mask_mod(doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_doc: torch.Tensor, block_size: int, *,
                    is_causal: bool, sliding_window: int | None) -> Callable:
    """The training visibility rule as a ``flex_attention`` ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Keys are laid out as ``[ctx positions 0 .. S - 1, block tokens 0 .. A * B - 1]`` (inference order: context
    first); query ``q_idx`` is slot ``k = q_idx % B`` of block ``j = q_idx // B``.

    * ctx key ``p`` is visible iff ``doc_ids[b, p] == anchor_doc[b, j]`` and ``p < anchors[b, j]`` (strictly before
      the anchor, same document); sliding layers also need ``anchors[b, j] + k - p < W``.
    * block key ``(j', k')`` is visible iff ``j' == j`` and, for causal layers, ``k' <= k`` (sliding layers also
      ``|k - k'| < W``). A block always sees its own slot, so no query row is fully masked (padding blocks,
      ``anchor_doc == -2``, see only themselves).

    The function works on scalar indices (flex_attention's vmap) and on broadcast index tensors (dense masks).

    Args:
        doc_ids: ``[R, S]`` int64 document id per row position (``-1`` for padding).
        anchors: ``[R, A]`` int64 row index of each block's anchor (any value for padding blocks).
        anchor_doc: ``[R, A]`` int64 document id of each anchor (``-2`` for padding blocks).
    """
    S = doc_ids.shape[1]
    B = block_size

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // B
        slot = q_idx % B
        a = anchors[b, j]
        p = torch.clamp(kv_idx, max=S - 1)
        ctx_ok = (doc_ids[b, p] == anchor_doc[b, j]) & (p < a)
        if sliding_window is not None:
            ctx_ok = ctx_ok & (a + slot - p < sliding_window)
        kb = torch.clamp(kv_idx - S, min=0)
        blk_ok = (kb // B) == j
        k2 = kb % B
        if is_causal:
            blk_ok = blk_ok & (k2 <= slot)
        if sliding_window is not None:
            blk_ok = blk_ok & (slot - k2 < sliding_window) & (k2 - slot < sliding_window)
        return torch.where(kv_idx < S, ctx_ok, blk_ok)

    return mask_mod


def dflash_visible_intervals(doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_doc: torch.Tensor,
                             block_size: int, *, is_causal: bool, sliding_window: int | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys each query sees under :func:`dflash_mask_mod`, as two half-open intervals.

    Documents are contiguous in a packed row, so query ``q`` (slot ``k`` of block ``j``, anchor ``a``) sees exactly
    the context keys ``[ctx_lo, ctx_hi)`` = ``[start of a's document, a)`` (sliding layers: from
    ``a + k - W + 1``) and the block keys ``[blk_lo, blk_hi)`` = its own block's slots (causal: up to ``k``;
    sliding: within ``W`` of ``k``), offset by ``S``. Padding blocks (``anchor_doc == -2``) see no context.

    Args: as :func:`dflash_mask_mod`.

    Returns:
        ``(ctx_lo, ctx_hi, blk_lo, blk_hi)``, each ``[R, A * B]`` int64 key indices (empty when ``lo >= hi``).
    """
    R, S = doc_ids.shape
    A, B = anchors.shape[1], block_size
    device = doc_ids.device
    pos = torch.arange(S, device=device)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.cummax(torch.where(is_start, pos, torch.zeros_like(pos)), dim=1).values  # [R, S]
    a = anchors.clamp(0, S - 1)
    valid = (anchor_doc >= 0) & (torch.gather(doc_ids, 1, a) == anchor_doc)
    slot = torch.arange(B, device=device)
    ctx_lo = torch.gather(doc_start, 1, a)[:, :, None].expand(R, A, B)
    ctx_hi = a[:, :, None].expand(R, A, B)
    if sliding_window is not None:
        ctx_lo = torch.maximum(ctx_lo, a[:, :, None] + slot - sliding_window + 1)
    ctx_lo = torch.where(valid[:, :, None], ctx_lo, torch.zeros_like(ctx_lo))
    ctx_hi = torch.where(valid[:, :, None], ctx_hi, torch.zeros_like(ctx_hi))
    base = S + torch.arange(A, device=device)[:, None] * B  # [A, 1]
    blk_lo = base + (torch.clamp(slot - sliding_window + 1, min=0) if sliding_window is not None
                     else torch.zeros_like(slot))
    blk_hi = base + (slot + 1 if is_causal else torch.full_like(slot, B))
    if sliding_window is not None and not is_causal:
        blk_hi = torch.minimum(blk_hi, base + slot + sliding_window)
    flat = lambda t: t.reshape(R, A * B)  # noqa: E731
    return flat(ctx_lo), flat(ctx_hi), flat(blk_lo.expand(R, A, B)), flat(blk_hi.expand(R, A, B))


def dflash_block_mask(doc_ids: torch.Tensor, anchors: torch.Tensor, anchor_doc: torch.Tensor, block_size: int, *,
                      is_causal: bool, sliding_window: int | None, tile: int = 128):
    """The flex_attention ``BlockMask`` of :func:`dflash_mask_mod`, built from the block structure.

    ``create_block_mask`` evaluates ``mask_mod`` on the whole ``rows x queries x keys`` grid (68 GiB at 16,384 row
    tokens and 256 anchors per document); here each query's visible keys are two intervals
    (:func:`dflash_visible_intervals`), so which ``tile x tile`` blocks are partly or fully visible follows from
    interval arithmetic in ``O(R * (Q + Q/tile * KV/tile))`` memory. The classification is exact: the same
    partial / full blocks as ``create_block_mask`` (tested), with ``mask_mod`` applied inside partial blocks.

    Args:
        doc_ids, anchors, anchor_doc, block_size, is_causal, sliding_window: as :func:`dflash_mask_mod`.
        tile: flex_attention's block size (queries and keys).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` for ``Q = A * B`` queries, ``KV = S + A * B`` keys, one head
        (broadcast over heads).
    """
    from torch.nn.attention.flex_attention import BlockMask

    R, S = doc_ids.shape
    A = anchors.shape[1]
    q_len, kv_len = A * block_size, S + A * block_size
    nq, nk = -(-q_len // tile), -(-kv_len // tile)
    device = doc_ids.device
    intervals = dflash_visible_intervals(doc_ids, anchors, anchor_doc, block_size, is_causal=is_causal,
                                         sliding_window=sliding_window)
    q_tile = torch.arange(q_len, device=device) // tile
    touched = torch.zeros(R, nq, nk + 1, dtype=torch.int32, device=device)
    k_start = torch.arange(nk, device=device) * tile
    full = torch.zeros(R, nq, nk, dtype=torch.bool, device=device)
    pad = nq * tile - q_len
    big = torch.iinfo(torch.long).max
    rows = torch.arange(R, device=device)[:, None].expand(R, q_len)
    qt = q_tile[None].expand(R, q_len)
    for lo, hi in (intervals[:2], intervals[2:]):
        nonempty = hi > lo
        ones = nonempty.to(torch.int32)
        touched.index_put_((rows, qt, torch.where(nonempty, lo // tile, 0)), ones, accumulate=True)
        touched.index_put_((rows, qt, torch.where(nonempty, (hi - 1) // tile + 1, 0)), -ones, accumulate=True)
        # fully visible: every query of the query tile covers the key tile (padded / empty queries never do)
        max_lo = F.pad(torch.where(nonempty, lo, big), (0, pad), value=big).view(R, nq, tile).amax(-1)
        min_hi = F.pad(torch.where(nonempty, hi, 0), (0, pad), value=0).view(R, nq, tile).amin(-1)
        full |= (k_start >= max_lo[:, :, None]) & (k_start + tile <= min_hi[:, :, None])
    any_visible = torch.cumsum(touched, dim=-1)[:, :, :nk] > 0
    partial = any_visible & ~full

    def layout(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1, dtype=torch.int32)[:, None]  # [R, 1, nq]
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return num, order

    kv_num, kv_idx = layout(partial)
    full_num, full_idx = layout(full)
    mask_mod = dflash_mask_mod(doc_ids, anchors, anchor_doc, block_size, is_causal=is_causal,
                               sliding_window=sliding_window)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


def dense_mask(mask_mod: Callable, rows: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full grid: boolean ``[rows, 1, q_len, kv_len]`` for SDPA (True = attend)."""
    b = torch.arange(rows, device=device)[:, None, None]
    q = torch.arange(q_len, device=device)[None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, h, q, kv).expand(rows, q_len, kv_len)[:, None]


_COMPILED_FLEX: Callable | None = None


def _flex_attention(q, k, v, block_mask, scale):
    """``flex_attention`` (compiled once on CUDA, eager elsewhere) with grouped-query heads."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda:
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (RoPE, GPT-NeoX layout as in Qwen3)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE for DFlash: keys ``[b, h, C + Q, d]`` at every position, queries ``[b, h, Q, d]`` at the last Q.

    ``cos`` / ``sin``: ``[b, C + Q, d]`` from the rotary embedding at the key positions.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.shape[-2]
    q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k = k * cos + rotate_half(k) * sin
    return q, k


class DFlashAttention(nn.Module):
    """Qwen3 attention whose queries come from the block and keys / values from ``cat(ctx, block)``.

    ``q = q_norm(q_proj(x))``, ``k = k_norm(cat(k_proj(ctx), k_proj(x)))``, ``v = cat(v_proj(ctx), v_proj(x))``
    with ``x`` the block stream after ``input_layernorm`` and ``ctx = hidden_norm(fc(features))``.
    """

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.is_causal = layer_is_causal(config, layer_idx)
        self.sliding_window = layer_window(config, layer_idx)
        self.mask_key = (self.is_causal, self.sliding_window)

    def forward(self, hidden_states: torch.Tensor, target_hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any = None,
                past_key_values: Any = None) -> torch.Tensor:
        """``hidden_states [b, Q, H]``, ``target_hidden [b, C, H]`` (normed ctx) -> ``[b, Q, H]``.

        ``attention_mask``: ``None`` (inference rule of this layer), a boolean / additive tensor broadcastable to
        ``[b, heads, Q, K]``, a flex_attention ``BlockMask``, or a dict ``{(is_causal, window): mask}`` from which
        this layer takes its own entry. ``past_key_values``: an HF ``Cache`` (context K/V of earlier steps).
        """
        bsz, q_len, _ = hidden_states.shape
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        k = self.k_norm(k.view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = v.view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"sin": sin, "cos": cos})
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask[self.mask_key]
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = inference_attention_mask(q_len, k.shape[2], is_causal=self.is_causal,
                                                      sliding_window=self.sliding_window, device=q.device)
        # Under autocast the q / k norms (fp32 weights) upcast; attention runs in the projections' dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):  # flex BlockMask
            out = _flex_attention(q, k, v, attention_mask, self.scaling)
        else:
            if self.num_heads != self.num_kv_heads:
                # repeat K / V per group, as HF's repeat_kv: SDPA's enable_gqa leaves only some kernels (the math
                # one with a mask), and the drafter's K / V are small (context + one block)
                groups = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer with :class:`DFlashAttention` (ctx bypasses ``input_layernorm``)."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, target_hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any = None,
                past_key_values: Any = None, block_len: int | None = None) -> torch.Tensor:
        """``[b, Q, H] -> [b, Q, H]``; see :meth:`DFlashAttention.forward` for the arguments. ``block_len`` (tokens
        per block of the stream) is not read here: the attention mask holds the block structure (DFlash2's
        convolutions read it, :mod:`draftsmith.modeling_dflash2`)."""
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), target_hidden, position_embeddings,
                                       attention_mask, past_key_values)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


# ---------------------------------------------------------------------------------------------------------------
# Training batch and outputs
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class PackedBatch:
    """Packed training rows: several documents per row, concatenated, right-padded.

    Attributes:
        features: ``[R, S, n * H]`` context features (target layers ``target_layer_ids``, concatenated).
        input_ids: ``[R, S]`` int64 data tokens.
        loss_mask: ``[R, S]`` bool, True where the target generates the token (assistant turns).
        doc_ids: ``[R, S]`` int64 document index within the row, ``-1`` on padding.
        position_ids: ``[R, S]`` int64 position of each token within its document.
        anchors: ``[R, A]`` int64 row index of each block's anchor (sorted; padding blocks: 0).
        anchor_valid: ``[R, A]`` bool, False for padding blocks.
        target_token: ``[R, S]`` int64 target's greedy prediction of the *next* token at each position, or None.
        feature_scales: ``[R, S, n]`` float32 per token and tapped layer when ``features`` are still float8_e4m3fn
            as stored (:func:`draftsmith.features.quantize_fp8`; padding 0), else None. :meth:`dequantize` decodes
            them; the drafter's forward takes decoded features only.
        target_topk_ids: ``[R, S, k]`` int32 (as stored; any integer dtype) the target's k most likely *next*
            tokens at each position (``extract.store_target_topk``; padding 0), or None: the soft labels of
            ``train.labels: target_topk``.
        target_topk_logprobs: ``[R, S, k]`` float16 (as stored; any float dtype) their log-probabilities under the
            target's full distribution (padding 0), or None.
    """

    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    target_token: torch.Tensor | None = None
    feature_scales: torch.Tensor | None = None
    target_topk_ids: torch.Tensor | None = None
    target_topk_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """Move every tensor to ``device``."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return PackedBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))

    def dequantize(self, dtype: torch.dtype) -> "PackedBatch":
        """The batch with float8 ``features`` decoded to ``dtype`` where they are (on the GPU after the copy: half
        the bytes of bf16 cross the bus), one tapped layer at a time (a float32 temporary of ``1 / n`` of the
        features); itself when they are decoded already. The same function as the loader's decoding
        (:func:`draftsmith.features.dequantize_fp8`), so both give the same values bit for bit."""
        if self.feature_scales is None:
            return self
        from draftsmith.features import dequantize_fp8

        R, S, width = self.features.shape
        n = self.feature_scales.shape[-1]
        q = self.features.reshape(R * S, n, width // n)
        scales = self.feature_scales.reshape(R * S, n)
        out = torch.empty(R * S, n, width // n, dtype=dtype, device=self.features.device)
        for j in range(n):
            out[:, j] = dequantize_fp8(q[:, j], scales[:, j:j + 1], dtype)
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return PackedBatch(**dict(fields, features=out.view(R, S, width), feature_scales=None))

    def pin_memory(self) -> "PackedBatch":
        """Page-locked copies (for asynchronous host-to-GPU copies); tensors already page-locked are kept."""
        pin = lambda t: t if t is None or t.is_pinned() else t.pin_memory()  # noqa: E731
        return PackedBatch(*(pin(getattr(self, f)) for f in self.__dataclass_fields__))


@dataclass
class DFlashTrainOutput:
    """Result of :meth:`DFlashDraftModel.training_forward`.

    Attributes:
        loss: scalar float32, ``sum(CE * w) / weight_sum`` with ``w = valid * exp(-(k - 1) / gamma)`` (or D-PACE's
            weights, ``train.loss_weighting: dpace``).
        weighted_ce: scalar float32, ``sum(CE * w)`` (differentiable): the trainer divides it by the loss weight of
            the whole optimizer step, so the gradient does not depend on how the step's rows are split.
        weight_sum: scalar float32, the loss's normaliser: ``sum(w)`` of the fixed decay, the number of valid slots
            with D-PACE (0 when the batch has no valid slot; the loss is then 0).
        ce_sum: ``[B - 1]`` float32 unweighted CE summed per slot k = 1..B-1 over valid slots.
        correct: ``[B - 1]`` int64 argmax == label counts per slot.
        count: ``[B - 1]`` int64 valid predictions per slot.
        accept_sum: scalar int64, sum over full blocks (all B-1 slots valid) of the accepted prefix length.
        full_blocks: scalar int64, number of such blocks.
    """

    loss: torch.Tensor
    weighted_ce: torch.Tensor
    weight_sum: torch.Tensor
    ce_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    accept_sum: torch.Tensor
    full_blocks: torch.Tensor


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Anchors of one packed row: up to ``num_anchors`` per document, uniformly without replacement, sorted.

    Position ``a`` is eligible iff ``loss_mask[a]`` and ``loss_mask[a + 1]`` and ``a + 1`` is in the same
    document (the anchor token is a target-generated token and slot 1 has a supervised label).

    Args:
        loss_mask: ``[S]`` bool / int.
        doc_ids: ``[S]`` int64 (``-1`` padding).
        generator: CPU generator (deterministic given its seed).

    Returns:
        ``[A]`` int64 sorted row indices (``A`` may be 0).
    """
    lm = loss_mask.bool()
    eligible = torch.zeros_like(lm)
    eligible[:-1] = lm[:-1] & lm[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    picked = []
    for doc in torch.unique(doc_ids[doc_ids >= 0]).tolist():
        cand = torch.nonzero(eligible & (doc_ids == doc)).flatten()
        if cand.numel() > num_anchors:
            cand = cand[torch.randperm(cand.numel(), generator=generator)[:num_anchors]]
        picked.append(cand)
    if not picked:
        return torch.zeros(0, dtype=torch.long)
    return torch.sort(torch.cat(picked)).values


def block_targets(batch: PackedBatch, block_size: int, use_target_tokens: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity of slots 1..B-1 of every block.

    Slot k of the block anchored at ``a`` predicts the token at ``a + k``: the data token ``input_ids[a + k]``,
    or, with ``use_target_tokens``, the target's own prediction ``target_token[a + k - 1]`` (the next-token
    argmax at position ``a + k - 1``). Valid iff ``a + k`` is inside the row, in the anchor's document, has
    ``loss_mask`` set, and the block is not padding.

    Returns:
        ``labels [R, A, B - 1]`` int64 and ``valid [R, A, B - 1]`` bool.
    """
    R, S = batch.input_ids.shape
    k = torch.arange(1, block_size, device=batch.anchors.device)
    pos = batch.anchors[:, :, None] + k  # [R, A, B-1]
    inside = pos < S
    pos_c = pos.clamp(max=S - 1)
    gather = lambda t, idx: torch.gather(t, 1, idx.reshape(R, -1)).reshape(idx.shape)  # noqa: E731
    anchor_doc = torch.gather(batch.doc_ids, 1, batch.anchors)
    valid = (inside & (gather(batch.doc_ids, pos_c) == anchor_doc[:, :, None]) & gather(batch.loss_mask.bool(), pos_c)
             & batch.anchor_valid[:, :, None])
    if use_target_tokens:
        if batch.target_token is None:
            raise ValueError("labels = target but the batch has no target_token")
        labels = gather(batch.target_token, (pos - 1).clamp(max=S - 1))
    else:
        labels = gather(batch.input_ids, pos_c)
    return labels, valid


def supervised_soft_labels(batch: PackedBatch, block_size: int, index: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The soft labels of the supervised slots, or None when the batch carries none (``train.labels`` other than
    ``target_topk``): slot k of the block anchored at ``a`` learns the target's top-k distribution at position
    ``a + k - 1`` (its prediction of token ``a + k``, as :func:`block_targets`' target label), renormalised over
    the k stored tokens (:func:`~draftsmith.drafter_loss.topk_soft_labels`).

    Args:
        batch: with ``target_topk_ids`` / ``target_topk_logprobs`` ``[R, S, k]``.
        index: ``[N]`` the supervised slots' flat positions in ``[R, A, B - 1]`` (:func:`supervised_slots`).

    Returns:
        ``(ids [N, k] int64, probs [N, k] float32)``.
    """
    if batch.target_topk_ids is None:
        return None
    R, S, k = batch.target_topk_ids.shape
    pos = batch.anchors[:, :, None] + torch.arange(block_size - 1, device=batch.anchors.device)  # a + k - 1
    flat = (pos.clamp(max=S - 1) + S * torch.arange(R, device=pos.device)[:, None, None]).view(-1)
    rows = flat.index_select(0, index)
    ids = batch.target_topk_ids.reshape(R * S, k).index_select(0, rows).long()
    return ids, topk_soft_labels(batch.target_topk_logprobs.reshape(R * S, k).index_select(0, rows))


def supervised_slots(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The supervised slots of ``valid [R, A, B - 1]`` (bool): ``(index [N] int64, slot [N] int64)``, ``index`` the
    flattened positions of the True entries in order and ``slot`` their slot 0..B-2.

    One ``nonzero`` (the training forward's one host sync before the loss): the tensors are then gathered by
    ``index`` (``index_select``), which needs none, where boolean masks would each wait for the GPU.
    """
    index = valid.reshape(-1).nonzero().squeeze(1)
    return index, index.remainder(valid.shape[-1])


def per_slot_sum(slot: torch.Tensor, nslot: int, values: torch.Tensor) -> torch.Tensor:
    """``[nslot]`` sums of ``values [N]`` by the supervised slots' ``slot [N]``: float32 for floating values, int64
    for counts and hits (bool), by ``index_add_`` (no host sync, where ``bincount`` has one)."""
    dtype = torch.float32 if values.is_floating_point() else torch.long
    return torch.zeros(nslot, dtype=dtype, device=slot.device).index_add_(0, slot, values.to(dtype))


def accepted_prefix(valid: torch.Tensor, index: torch.Tensor, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced accepted length of the fully supervised blocks: ``(sum over them of the number of leading
    hits, their count)``, 0-dim int64 each; ``hit [N]`` bool of the supervised slots at ``index``."""
    grid = torch.zeros(valid.numel(), dtype=torch.long, device=valid.device)
    grid.index_copy_(0, index, hit.long())
    full = valid.all(-1)  # blocks whose every slot is supervised
    prefix = grid.view(valid.shape).cumprod(-1).sum(-1)  # accepted draft tokens
    return (prefix * full).sum(), full.sum()


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------

class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter (z-lab format; same inference interface as ``dflash.model.DFlashDraftModel``).

    Attributes:
        block_size: B, tokens per draft block (anchor included).
        mask_token_id: id whose (target) embedding fills slots 1..B-1.
        target_layer_ids: tapped target layers, id i = HF ``output_hidden_states[i + 1]``.
        config: the :class:`~draftsmith.drafter_config.DFlashConfig`.
    """

    config_class = DFlashConfig
    _no_split_modules = ["DFlashDecoderLayer"]
    #: the decoder layer class (DFlash2 subclasses its layers)
    LAYER_CLASS: type[nn.Module] = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        layer_ids = draft_value(config, "target_layer_ids")
        if layer_ids is None:
            raise ValueError("drafter config has no dflash_config.target_layer_ids (refusing to guess them: "
                             "SGLang #37475); build it with build_drafter_config")
        self.target_layer_ids = [int(i) for i in layer_ids]
        self.block_size = int(draft_value(config, "block_size", 16))
        mask = draft_value(config, "mask_token_id")
        self.mask_token_id = None if mask is None else int(mask)
        self.layers = nn.ModuleList([self.LAYER_CLASS(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        #: recompute each layer's activations in the backward pass instead of keeping them (training only):
        #: activation memory ~ one layer instead of all, for ~1/3 more layer compute
        self.activation_checkpointing = False
        self.fused_loss = False  # the LM-head loss's chunks fused by torch.compile (train.compile on a GPU)
        self.post_init()

    # -- inference ------------------------------------------------------------------------------------------

    def forward(self, position_ids: torch.LongTensor, attention_mask: Any = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False, block_len: int | None = None,
                **kwargs) -> torch.Tensor:
        """Draft hidden states of a block (decode) or of the blocks of packed rows (training).

        Args:
            position_ids: ``[b, C + Q]`` int64 absolute positions of the new context features then the block.
            attention_mask: ``None`` = each layer's inference rule (full layers see everything); or a mask
                accepted by :meth:`DFlashAttention.forward`.
            noise_embedding: ``[b, Q, H]`` target embedding of ``[anchor, mask x (Q - 1)]`` (x input scale).
            target_hidden: ``[b, C, n * H]`` raw target features at the new context positions.
            past_key_values: HF ``Cache`` holding earlier context K/V (crop it back after each step).
            block_len: the stream is ``Q / block_len`` blocks of ``block_len`` tokens (training); ``None`` = one
                block of ``Q`` tokens (decode). Passed to the layers (DFlash2's convolutions stay inside a block).

        Returns:
            ``[b, Q, H]`` final-normed hidden states (same dtype as ``noise_embedding``).
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        hidden_states = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                hidden_states = torch.utils.checkpoint.checkpoint(
                    layer, hidden_states, ctx, position_embeddings, attention_mask, past_key_values, block_len,
                    use_reentrant=False)
            else:
                hidden_states = layer(hidden_states, ctx, position_embeddings, attention_mask, past_key_values,
                                      block_len)
        return self.norm(hidden_states)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module | torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` from hidden states ``[..., H]`` through the target's LM head.

        ``output_head`` is the target's head module or its weight ``[V, H]``. Applies ``output_multiplier`` and
        tanh ``final_logit_softcapping`` from ``dflash_config`` when set (official semantics).
        """
        logits = F.linear(hidden, output_head) if isinstance(output_head, torch.Tensor) else output_head(hidden)
        multiplier = float(draft_value(self.config, "output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        softcap = draft_value(self.config, "final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    # -- training -------------------------------------------------------------------------------------------

    def attention_masks(self, batch: PackedBatch, backend: str = "auto") -> dict:
        """One mask per distinct (is_causal, sliding window) of the layers, for a packed batch.

        Args:
            backend: ``flex`` (``BlockMask``), ``sdpa`` (dense boolean ``[R, 1, A*B, S + A*B]``) or ``auto`` =
                flex on CUDA, sdpa elsewhere.
        """
        if backend == "auto":
            backend = "flex" if batch.input_ids.is_cuda else "sdpa"
        if backend not in ("flex", "sdpa"):
            raise ValueError(f"unknown attention backend {backend!r} (flex, sdpa, auto)")
        R, S = batch.input_ids.shape
        A = batch.anchors.shape[1]
        q_len, kv_len = A * self.block_size, S + A * self.block_size
        anchor_doc = torch.where(batch.anchor_valid, torch.gather(batch.doc_ids, 1, batch.anchors),
                                 torch.full_like(batch.anchors, -2))
        masks = {}
        for layer in self.layers:
            key = layer.self_attn.mask_key
            if key in masks:
                continue
            if backend == "flex":  # from the block structure: no rows x queries x keys grid is built
                masks[key] = dflash_block_mask(batch.doc_ids, batch.anchors, anchor_doc, self.block_size,
                                               is_causal=key[0], sliding_window=key[1])
            else:
                mod = dflash_mask_mod(batch.doc_ids, batch.anchors, anchor_doc, self.block_size,
                                      is_causal=key[0], sliding_window=key[1])
                masks[key] = dense_mask(mod, R, q_len, kv_len, batch.input_ids.device)
        return masks

    def block_hidden(self, batch: PackedBatch, embed_weight: torch.Tensor, masks: dict | None = None,
                     backend: str = "auto", input_embedding_scale: float | None = None) -> torch.Tensor:
        """Drafter hidden states of every block of a packed batch: ``[R, A, B, H]``.

        Block j = ``[input_ids[a_j], mask x (B - 1)]`` embedded with the target's frozen ``embed_weight [V, H]``
        at positions ``pos(a_j) .. pos(a_j) + B - 1`` (document-relative); context = all ``S`` row positions at
        their document positions, with visibility from :func:`dflash_mask_mod`.
        """
        if self.mask_token_id is None:
            raise ValueError("the drafter has no mask_token_id")
        R, S = batch.input_ids.shape
        A, B = batch.anchors.shape[1], self.block_size
        anchor_tok = torch.gather(batch.input_ids, 1, batch.anchors)  # [R, A]
        block_ids = torch.full((R, A, B), self.mask_token_id, dtype=torch.long, device=anchor_tok.device)
        block_ids[:, :, 0] = anchor_tok
        scale = float(draft_value(self.config, "input_embedding_scale", 1.0)
                      if input_embedding_scale is None else input_embedding_scale)
        noise = F.embedding(block_ids.view(R, A * B), embed_weight)
        if scale != 1.0:
            noise = noise * scale
        anchor_pos = torch.gather(batch.position_ids, 1, batch.anchors)  # [R, A]
        block_pos = (anchor_pos[:, :, None] + torch.arange(B, device=anchor_pos.device)).view(R, A * B)
        position_ids = torch.cat([batch.position_ids, block_pos], dim=1)
        if masks is None:
            masks = self.attention_masks(batch, backend)
        hidden = self(position_ids=position_ids, attention_mask=masks, noise_embedding=noise,
                      target_hidden=batch.features, block_len=B)
        return hidden.view(R, A, B, -1)

    def head_loss_options(self, logits_chunk_bytes: int) -> dict:
        """The chunked head loss's options (:func:`~draftsmith.drafter_loss.slot_head_loss`): ``dflash_config``'s
        ``output_multiplier`` (float) and ``final_logit_softcapping`` (None when unset or 0), the chunk size and
        :attr:`fused_loss`."""
        softcap = draft_value(self.config, "final_logit_softcapping")
        return dict(multiplier=float(draft_value(self.config, "output_multiplier", 1.0)),
                    softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None,
                    chunk_bytes=logits_chunk_bytes, fused=self.fused_loss)

    def training_forward(self, batch: PackedBatch, embed_weight: torch.Tensor, head_weight: torch.Tensor, *,
                         gamma: float, dpace_alpha: float | None = None, use_target_tokens: bool = False,
                         masks: dict | None = None, backend: str = "auto",
                         logits_chunk_bytes: int = 1 << 30) -> DFlashTrainOutput:
        """DFlash training loss of a packed batch (and the statistics held-out metrics need).

        Only valid slots go through the LM head (``[N, H] x [H, V]``), the dominant matmul, in chunks of about
        ``logits_chunk_bytes`` of float32 logits (:func:`~draftsmith.drafter_loss.slot_head_loss`): memory does not
        grow with ``N x V``.

        Args:
            embed_weight: ``[V, H]`` target input embedding (frozen).
            head_weight: ``[V, H]`` target LM head (frozen; the embedding when tied).
            gamma: slot decay, see :func:`default_loss_gamma`.
            dpace_alpha: None for the fixed decay; else D-PACE's slot weights with this smoothing
                (:func:`~draftsmith.drafter_loss.slot_loss_weights`), normalised by the supervised slots' count.
            use_target_tokens: labels from ``batch.target_token`` instead of the data.

        With soft labels in the batch (``target_topk_ids``, ``train.labels: target_topk``) each slot's loss is the
        cross entropy against the target's renormalised top-k distribution (:func:`supervised_soft_labels`,
        :func:`~draftsmith.drafter_loss.head_soft_cross_entropy`) in place of the label's; D-PACE's confidence and
        the statistics (``ce_sum``, hits) stay the label's.

        Returns:
            :class:`DFlashTrainOutput`; ``loss`` is differentiable w.r.t. the drafter's parameters.

        Raises:
            ValueError: the batch's features are still float8 (:meth:`PackedBatch.dequantize` first).
        """
        if batch.feature_scales is not None:
            raise ValueError("training_forward: the batch's features are float8 with scales; call "
                             "PackedBatch.dequantize(dtype) first")
        hidden = self.block_hidden(batch, embed_weight, masks, backend)[:, :, 1:]  # [R, A, B-1, H]
        labels, valid = block_targets(batch, self.block_size, use_target_tokens)
        index, slot = supervised_slots(valid)
        tgt = labels.view(-1).index_select(0, index)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        soft = supervised_soft_labels(batch, self.block_size, index)
        head = self.head_loss_options(logits_chunk_bytes)
        loss_rows, ce, pred, _, _ = slot_head_loss(h, head_weight, tgt, soft, **head)  # [N]
        w, weight_sum = slot_loss_weights(ce, slot, index, valid, gamma=gamma, dpace_alpha=dpace_alpha)
        weighted_ce = (loss_rows * w).sum()
        loss = weighted_ce / weight_sum.clamp_min(1e-12)
        with torch.no_grad():
            hit = pred == tgt
            nslot = self.block_size - 1
            ce_sum, correct = per_slot_sum(slot, nslot, ce.detach()), per_slot_sum(slot, nslot, hit)
            count = per_slot_sum(slot, nslot, torch.ones_like(slot))
            accept_sum, full_blocks = accepted_prefix(valid, index, hit)
        return DFlashTrainOutput(loss, weighted_ce, weight_sum, ce_sum, correct, count, accept_sum, full_blocks)

    # -- checkpoint I/O -------------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The z-lab weights (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*``), contiguous, on the CPU."""
        return {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype | None = None, **_) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the z-lab format, each atomically.

        Args:
            dtype: cast the weights (e.g. ``torch.bfloat16``); default: as they are. ``config.dtype`` follows.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = self.trainable_state_dict()
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        cfg = drafter_config_dict(self.config)
        cfg["dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
        with atomic_path(folder / "model.safetensors") as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        with atomic_path(folder / "config.json") as tmp:
            tmp.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, *args, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None, **kwargs) -> "DFlashDraftModel":
        """Load a z-lab format folder (``config.json`` + ``model.safetensors``), strictly.

        Weights take ``dtype`` (default: the file's); the RoPE inverse frequencies stay float32 (a bfloat16
        ``inv_freq`` is off by up to 2e-3 relative: tens of radians at position 1e5).

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: the config is not a drafter config of this class (``architectures``) or lacks
                ``target_layer_ids`` / ``mask_token_id``; the weights miss a tensor, have an extra one or a wrong
                shape (names listed).
        """
        folder = Path(folder)
        cfg_path, w_path = folder / "config.json", folder / "model.safetensors"
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} does not exist (a DFlash drafter folder has config.json and "
                                        "model.safetensors)")
        with open(cfg_path, encoding="utf-8") as fh:
            raw = json.load(fh)
        dflash = raw.get("dflash_config") or {}
        for key in ("target_layer_ids", "mask_token_id"):
            if dflash.get(key, raw.get(key)) is None:
                raise ValueError(f"{cfg_path}: dflash_config.{key} is missing; a drafter must state it explicitly")
        try:
            config = drafter_config_from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{cfg_path}: {exc}") from None
        if cls.config_class is not type(config):
            raise ValueError(f"{cfg_path}: architectures {raw.get('architectures')} is not a {cls.__name__} "
                             f"(load it with {config.ARCHITECTURE})")
        model = cls(config)
        with safe_open(str(w_path), framework="pt") as fh:
            state = {k: fh.get_tensor(k) for k in fh.keys()}
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
        if missing or extra or wrong:
            raise ValueError(f"{w_path}: missing tensors {missing[:8]}, unexpected {extra[:8]}, "
                             f"wrong shapes {[(k, tuple(state[k].shape)) for k in wrong[:8]]}")
        model.load_state_dict(state, strict=True)
        if dtype is None:
            dtype = next(iter(state.values())).dtype if state else None
        if dtype is not None:
            model = model.to(dtype)
            model.rotary_emb = Qwen3RotaryEmbedding(config)  # float32 inv_freq, as transformers' from_pretrained
        if device is not None:
            model = model.to(device)
        return model.eval()


__all__ = [
    "DFlashDraftModel", "DFlashAttention", "DFlashDecoderLayer", "PackedBatch", "DFlashTrainOutput",
    "sample_anchors", "block_targets", "slot_weights", "supervised_slots", "per_slot_sum", "accepted_prefix",
    "dflash_mask_mod", "dense_mask", "inference_attention_mask",
]
