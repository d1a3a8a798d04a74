"""The drafter a run trains: its config (from the target's config, the ``drafter`` settings and the features'
tapped layers) and its optimizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from draftsmith.drafter_config import build_drafter_config, resolve_mask_token_id
from draftsmith.features import FeatureIndex
from draftsmith.modeling import DFlashDraftModel
from draftsmith.target_layers import default_target_layer_ids, num_tapped_layers
from draftsmith.train.plan import FeatureMeta
from draftsmith.train.settings import DrafterOptions, TrainOptions

log = logging.getLogger("draftsmith.train")


def build_model_config(index: FeatureIndex | FeatureMeta, target_dir: Path, drafter: DrafterOptions,
                       vocab_size: int):
    """The drafter's config (:class:`~draftsmith.drafter_config.DFlashConfig`, or ``DFlash2Config`` for
    ``drafter.architecture: dflash2``) from the target config, the drafter settings and the features' layer ids
    (``index``: the features' index, or their :class:`~draftsmith.train.plan.FeatureMeta`).

    The mask token is ``drafter.mask_token_id``, else one the target's tokenizer offers
    (:func:`draftsmith.drafter_config.resolve_mask_token_id`); ``vocab_size`` is the rows of the target's
    embedding.

    Raises:
        ValueError: ``drafter.target_layer_ids`` differs from the layer ids the features were extracted at.
    """
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_dir)
    ids = None if drafter.target_layer_ids is None else list(drafter.target_layer_ids)
    if ids is not None and [int(i) for i in ids] != index.layer_ids:
        raise ValueError(f"drafter.target_layer_ids {ids} differ from the features' layer_ids {index.layer_ids} "
                         f"({index.path}); re-extract or fix the config")
    n_feat = num_tapped_layers(None, drafter.num_target_features, drafter.num_layers)
    if ids is None and index.layer_ids != default_target_layer_ids(index.num_target_layers, n_feat):
        log.warning("features were extracted at layers %s, not the default formula's %s; using the features' ids",
                    index.layer_ids, default_target_layer_ids(index.num_target_layers, n_feat))
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception as exc:  # a target folder without a tokenizer
        log.warning("no tokenizer in %s (%s); mask token falls back to config", target_dir, exc)
        tokenizer = None
    mask_id, why = resolve_mask_token_id(drafter.mask_token_id, tokenizer, vocab_size)
    log.info("mask token id %d (%s)", mask_id, why)
    return build_drafter_config(
        target_config, num_layers=drafter.num_layers, block_size=drafter.block_size,
        target_layer_ids=index.layer_ids, mask_token_id=mask_id, vocab_size=vocab_size,
        layer_types=None if drafter.layer_types is None else list(drafter.layer_types),
        sliding_window=drafter.sliding_window, is_causal=drafter.is_causal,
        intermediate_size=drafter.intermediate_size, num_attention_heads=drafter.num_attention_heads,
        num_key_value_heads=drafter.num_key_value_heads, head_dim=drafter.head_dim, rope_theta=drafter.rope_theta,
        architecture=drafter.architecture, conv_kernel_size=drafter.conv_kernel_size,
        conv_group_size=drafter.conv_group_size, selector_rank=drafter.selector_rank,
        selector_top_k=drafter.selector_top_k)


def make_optimizer(model: DFlashDraftModel, settings: TrainOptions, on_gpu: bool
                   ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW over the trainable parameters at ``train.lr``, ``train.weight_decay`` on matrices only (fused on a
    GPU); returns ``(optimizer, params)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr,
                                  fused=on_gpu or None)
    return optimizer, params
