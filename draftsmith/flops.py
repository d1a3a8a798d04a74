"""Model FLOPs of a DFlash training step, for MFU (model FLOPs utilisation) in the trainer's log and the
benchmarks.

Counted as in the PaLM paper's MFU (Chowdhery et al. 2022, appendix B): the matmuls the model needs, 2 FLOPs per
multiply-accumulate, forward + backward, no recomputation (activation checkpointing does not count). The
attention term counts only the (query, key) pairs the DFlash mask lets through (from the interval form of the
mask, :func:`draftsmith.modeling.dflash_visible_intervals`: no queries x keys grid is built).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from draftsmith.drafter_config import draft_value
from draftsmith.modeling import DFlashDraftModel, PackedBatch, block_targets, dflash_visible_intervals


def training_flops(config: Qwen3Config, *, ctx_tokens: int, block_tokens: int, head_tokens: int,
                   attended_pairs: float) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward), by part. Matmuls count 2 FLOPs per MAC.

    * layers (trainable): ``6 * block_tokens * P_layer`` (forward 2, input grad 2, weight grad 2) plus the
      ctx K/V projections ``6 * ctx_tokens * 2 * H * kv * hd`` per layer;
    * fc: ``4 * ctx_tokens * n * H * H`` (forward + weight grad; its input, the target features, needs no grad);
    * LM head (frozen: forward + input grad only): ``4 * head_tokens * H * V``;
    * attention: ``4 * heads * hd * attended_pairs`` forward (QK and PV), x 3 with backward
      (``attended_pairs`` = visible (query, key) pairs summed over queries, per layer total);
    * DFlash2 (a config with ``conv_group_size``, :mod:`draftsmith.modeling_dflash2`): each layer's two convolution
      pairs add their kernel projections, ``H x 2K(H / group)`` each, to ``P_layer`` (the convolutions themselves
      are elementwise: not counted); the selector (``selector``) adds its hidden projection on the supervised
      slots, ``4 * head_tokens * H * rank`` (forward + weight grad: it reads detached hidden states), and the
      bilinear scores of the top-k, ``8 * head_tokens * k * rank`` (the loss's forward and backward, and the
      serving candidates' scores of the step's selector accuracy)
      (its codebook rows are gathered, not multiplied).

    Args:
        config: the drafter's config (``hidden_size``, ``head_dim``, heads, ``intermediate_size``, layers,
            ``vocab_size``, ``dflash_config.target_layer_ids``).
        ctx_tokens: context (non-padding) tokens of the step; block_tokens: anchors x block size (padding blocks
        included: they are computed); head_tokens: supervised slots (the LM head runs on those only).

    Returns:
        dict of FLOPs per part (``layers``, ``fc``, ``lm_head``, ``attention``; DFlash2: ``selector``) and
        ``total``.
    """
    H, hd, V = config.hidden_size, config.head_dim, config.vocab_size
    L = config.num_hidden_layers
    n_feat = len(draft_value(config, "target_layer_ids"))
    per_layer = (H * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
                 + 3 * H * config.intermediate_size)
    group = getattr(config, "conv_group_size", None)
    if group:  # DFlash2: two convolution pairs a layer, each with an H x 2K(H / group) kernel projection
        per_layer += 2 * H * 2 * config.conv_kernel_size * (H // group)
    out = {
        "layers": 6.0 * block_tokens * per_layer * L + 6.0 * ctx_tokens * 2 * H * config.num_key_value_heads * hd * L,
        "fc": 4.0 * ctx_tokens * n_feat * H * H,
        "lm_head": 4.0 * head_tokens * H * V,
        "attention": 3.0 * 4.0 * config.num_attention_heads * hd * attended_pairs,
    }
    if group:
        out["selector"] = (4.0 * H + 8.0 * config.selector_top_k) * head_tokens * config.selector_rank
    out["total"] = sum(out.values())
    return out


def attended_pairs(model: DFlashDraftModel, batch: PackedBatch) -> float:
    """Visible (query, key) pairs of ``batch`` summed over the drafter's layers (each layer's own causality and
    sliding window), from the interval form of the DFlash mask."""
    anchor_doc = torch.where(batch.anchor_valid, torch.gather(batch.doc_ids, 1, batch.anchors),
                             torch.full_like(batch.anchors, -2))
    total, seen = 0.0, {}
    for layer in model.layers:
        key = layer.self_attn.mask_key  # (is_causal, sliding_window): layers of one kind see the same pairs
        if key not in seen:
            lo, hi, blo, bhi = dflash_visible_intervals(batch.doc_ids, batch.anchors, anchor_doc, model.block_size,
                                                        is_causal=key[0], sliding_window=key[1])
            seen[key] = float((hi - lo).clamp_min(0).sum() + (bhi - blo).clamp_min(0).sum())
        total += seen[key]
    return total


def step_flops(model: DFlashDraftModel, batch: PackedBatch, use_target_tokens: bool) -> float:
    """Model FLOPs (forward + backward) of one training step of ``model`` on ``batch`` (:func:`training_flops`
    with the batch's context tokens, blocks, supervised slots and visible pairs). Runs on the batch's device;
    on host tensors too, cheaply (interval arithmetic per anchor, no mask grid)."""
    _, valid = block_targets(batch, model.block_size, use_target_tokens)
    return training_flops(model.config, ctx_tokens=int((batch.doc_ids >= 0).sum()),
                          block_tokens=batch.anchors.shape[1] * model.block_size, head_tokens=int(valid.sum()),
                          attended_pairs=attended_pairs(model, batch))["total"]


__all__ = ["training_flops", "attended_pairs", "step_flops"]
