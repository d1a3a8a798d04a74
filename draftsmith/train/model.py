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
from draftsmith.train.muon import ShardedMuon
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


class MuonAdamW:
    """Muon over the drafter's weight matrices, AdamW over the rest: one optimizer to the training loop.

    ``torch.optim.Muon`` (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; the
    ``match_rms_adamw`` learning-rate adjustment of Liu et al. 2025, "Muon is Scalable for LLM Training", so that
    ``train.muon_lr`` is on AdamW's scale) takes every trainable 2D parameter with both sides above 1 (attention and
    MLP projections, ``fc``; DFlash2's convolution and selector projections) except vocabulary-sized tables
    (:data:`MUON_EXCLUDED_NAMES`: DFlash2's selector codebooks), ``torch.optim.AdamW`` the others (norms, DFlash2's
    static convolution kernels and codebooks), as speculators 0.9.0 splits them (``speculators.train.optimizers``).
    The drafter's embedding and LM head are the target's, frozen, so neither group holds them.

    It offers what the loop and the checkpoints use: ``param_groups`` (AdamW's first; each group's ``peak_lr`` is
    the peak the schedule scales), ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict`` in
    ``torch.optim.Optimizer``'s format (the two optimizers' states numbered one after the other).
    """

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer):
        self.optimizers = (adamw, muon)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + int(pid): st for pid, st in sd["state"].items()})
            groups += [dict(g, params=[offset + int(p) for p in g["params"]]) for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Raises ValueError: ``state_dict``'s groups do not match this optimizer's (another split of the
        parameters: a checkpoint of another ``train.optimizer``)."""
        groups, offset, first = state_dict["param_groups"], 0, 0
        for opt in self.optimizers:
            n_groups = len(opt.param_groups)
            mine = groups[first:first + n_groups]
            n_params = sum(len(g["params"]) for g in opt.param_groups)
            if len(mine) != n_groups or [len(g["params"]) for g in mine] != [len(g["params"]) for g in
                                                                           opt.param_groups]:
                raise ValueError("optimizer state: its parameter groups do not match Muon + AdamW's "
                                 f"({[len(g['params']) for g in groups]} parameters a group)")
            ids = {offset + i for i in range(n_params)}
            opt.load_state_dict({
                "state": {int(pid) - offset: st for pid, st in state_dict["state"].items() if int(pid) in ids},
                "param_groups": [dict(g, params=[int(p) - offset for p in g["params"]]) for g in mine]})
            first, offset = first + n_groups, offset + n_params


#: 2-D parameters Muon leaves to AdamW by name: vocabulary-sized tables (DFlash2's selector codebooks), whose rows
#: are looked up per token like an embedding's. Muon orthogonalises the update of hidden layers' matrices (Jordan et
#: al. 2024 keep embeddings and heads on AdamW; speculators 0.9.0's ``_ADAMW_NAME_HINTS`` has "codebook")
MUON_EXCLUDED_NAMES = ("codebook", "embed_tokens", "lm_head")


def muon_matrices(named_params: list[tuple[str, torch.nn.Parameter]]) -> list[torch.nn.Parameter]:
    """The parameters Muon takes (``train.optimizer: muon``) of ``named_params`` (``(name, parameter)`` pairs):
    every 2-D one with both sides above 1 whose name holds none of :data:`MUON_EXCLUDED_NAMES`."""
    return [p for name, p in named_params
            if p.dim() == 2 and min(p.shape) > 1 and not any(hint in name for hint in MUON_EXCLUDED_NAMES)]


def make_optimizer(model: DFlashDraftModel, settings: TrainOptions, on_gpu: bool
                   ) -> tuple[torch.optim.Optimizer | MuonAdamW, list[torch.nn.Parameter]]:
    """The run's optimizer over the trainable parameters and ``(optimizer, params)``.

    ``train.optimizer: adamw``: AdamW at ``train.lr``, ``train.weight_decay`` on matrices only (fused on a GPU).
    ``muon``: :class:`MuonAdamW`: Muon at ``train.muon_lr`` (default ``train.lr``), momentum 0.95 (Nesterov), 5
    Newton-Schulz steps, weight decay ``train.muon_weight_decay``; AdamW at ``train.lr`` without weight decay on
    the rest. Under DDP the Muon group is a :class:`~draftsmith.train.muon.ShardedMuon`: each rank orthogonalises
    about 1/world of the matrices and broadcasts them (one process: ``torch.optim.Muon``'s step). Off the GPU
    the orthogonalisations run in float32 (``ShardedMuon``'s ``ns_dtype``: bf16 products are emulated on CPUs
    without bf16 instructions, ~33x float32's time). Every group records its peak learning rate as ``peak_lr``.
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if settings.optimizer == "muon":
        matrices = muon_matrices(named)
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        muon_lr = float(settings.muon_lr if settings.muon_lr is not None else settings.lr)
        adamw = torch.optim.AdamW([{"params": rest, "weight_decay": 0.0, "peak_lr": settings.lr}], lr=settings.lr,
                                  fused=on_gpu or None)
        muon = ShardedMuon([{"params": matrices, "peak_lr": muon_lr}], lr=muon_lr, momentum=0.95, nesterov=True,
                           ns_steps=5, weight_decay=settings.muon_weight_decay, adjust_lr_fn="match_rms_adamw",
                           ns_dtype=torch.bfloat16 if on_gpu else torch.float32)
        return MuonAdamW(adamw, muon), params
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay, "peak_lr": settings.lr},
                                   {"params": no_decay, "weight_decay": 0.0, "peak_lr": settings.lr}],
                                  lr=settings.lr, fused=on_gpu or None)
    return optimizer, params


def optimizer_summary(optimizer: torch.optim.Optimizer | MuonAdamW) -> str:
    """One phrase for the log: ``"AdamW"`` or ``"Muon (N matrices, lr X) + AdamW (M tensors)"``, with how the
    orthogonalisations are split under DDP."""
    if isinstance(optimizer, MuonAdamW):
        adamw, muon = optimizer.optimizers
        count = lambda opt: sum(len(g["params"]) for g in opt.param_groups)  # noqa: E731
        split = (f"; Newton-Schulz split over {muon.world} ranks, at most {muon.largest_share:.0%} of it on one"
                 if muon.world > 1 else "")
        return (f"Muon ({count(muon)} matrices, lr {muon.param_groups[0]['peak_lr']:.3g}{split}) + AdamW "
                f"({count(adamw)} tensors)")
    return "AdamW"
