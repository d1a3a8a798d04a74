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


def start_model_config(index: FeatureIndex | FeatureMeta, target_dir: Path, drafter: DrafterOptions,
                       vocab_size: int):
    """The drafter's config for a run from ``drafter.init_from``: the start folder's own ``config.json``
    (:func:`~draftsmith.drafter_config.drafter_config_from_dict`; its RoPE, norms and sizes as they were trained),
    after the checks planning made, again, against what this process reads.

    Checks (every failure in one message): the tensor set against the folder's config; a ``drafter`` setting that is
    neither null, nor the schema's default, nor the folder's value (planning replaced the defaults with the folder's
    values, so a library caller's defaults are not contradictions); the features' layer ids against the folder's
    taps; ``num_target_layers``, ``hidden_size`` and ``vocab_size`` (``vocab_size``: the target embedding's rows)
    against the target; the mask token against the target's whole stop policy
    (:func:`draftsmith.chat.stop_token_ids`, chat template's end of turn included), unless ``drafter.mask_token_id``
    confirms it.

    Raises:
        ValueError: the start cannot start this run (each reason named, with the folder's and the other value).
    """
    from transformers import AutoConfig

    from draftsmith.chat import load_tokenizer, stop_token_ids
    from draftsmith.config import schema_defaults
    from draftsmith.drafter_config import drafter_config_from_dict
    from draftsmith.target import text_config
    from draftsmith.warm_start import read_start, start_config_errors

    start = read_start(drafter.init_from)
    defaults = schema_defaults("drafter")
    given = {k: v for k, v in drafter.to_dict().items()
             if k != "init_from" and v is not None and v != defaults.get(k)}
    errors = start_config_errors(start, given, index.layer_ids)
    target = text_config(AutoConfig.from_pretrained(target_dir))
    cfg, where = start.config, start.config_path
    L = int(target.num_hidden_layers)
    if cfg.get("num_target_layers") is not None and int(cfg["num_target_layers"]) != L:
        errors.append(f"{where} num_target_layers {cfg['num_target_layers']}, but the target {target_dir} has {L} "
                      "decoder layers")
    if int(cfg["hidden_size"]) != int(target.hidden_size):
        errors.append(f"{where} hidden_size {cfg['hidden_size']}, the target's {target.hidden_size}")
    if int(cfg["vocab_size"]) != int(vocab_size):
        errors.append(f"{where} vocab_size {cfg['vocab_size']}, the target's embedding has {vocab_size} rows")
    try:
        tokenizer = load_tokenizer(target_dir)
    except Exception as exc:  # a target folder without a tokenizer: planning refused it already, unless a test
        log.warning("no tokenizer in %s (%s): the start's mask token is not checked against its stop policy",
                    target_dir, exc)
        tokenizer = None
    if tokenizer is not None:
        kwargs = (getattr(index, "meta", None) or {}).get("chat_template_kwargs") or {}
        stops = stop_token_ids(tokenizer, target_dir, kwargs)
        if start.mask_token_id in stops and drafter.mask_token_id != start.mask_token_id:
            errors.append(f"{where} dflash_config.mask_token_id {start.mask_token_id} is one of the target's stop "
                          f"tokens {stops}; if the drafter was trained with it for this target, confirm it with "
                          f"drafter.mask_token_id: {start.mask_token_id}")
    if errors:
        raise ValueError(f"drafter.init_from: {start.folder} cannot start this run:\n  " + "\n  ".join(errors))
    config = drafter_config_from_dict(start.config)
    log.info("drafter config from %s: %s, %d layers, block %d, taps %s, mask token %d", where,
             config.ARCHITECTURE, config.num_hidden_layers, config.block_size, config.target_layer_ids,
             config.mask_token_id)
    return config


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
