"""The drafter's configuration, as transformers splits configuration from modeling.

A DFlash drafter's config is a :class:`DFlashConfig`, a ``Qwen3Config`` (``model_type: "qwen3"``) whose DFlash
fields are attributes: ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``num_target_layers``,
``is_causal``. :class:`DFlash2Config` extends it, as transformers configurations extend one another, with the
DFlash2 fields ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``. Serialised
(:func:`drafter_config_dict`), the drafter fields go into ``dflash_config`` and ``architectures`` names the model
class (``DFlashDraftModel`` / ``DFlash2DraftModel``): the checkpoint contract of the official z-lab ``dflash``
package, vLLM and SGLang. Here too: building it from the target's config (:func:`build_drafter_config`), the mask
token choice, the loss decay, and which layers are causal or sliding. Used by train, export and evaluate;
:mod:`draftsmith.modeling` / :mod:`draftsmith.modeling_dflash2` hold the models and
:mod:`draftsmith.target_layers` the rule for the tapped target layers.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

from draftsmith.target import text_config

log = logging.getLogger("draftsmith.drafter_config")

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"
#: ``drafter.architecture`` -> the model class name written into ``architectures``
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": ARCHITECTURE_2}
FULL = "full_attention"
SLIDING = "sliding_attention"
# Weight names of a z-lab DFlash checkpoint besides the per-layer ones.
TOP_LEVEL_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# RoPE types the drafter's Qwen3 rotary embedding computes (transformers' ROPE_INIT_FUNCTIONS) and vLLM / SGLang /
# the official dflash package read from a Qwen3 config; "proportional" and others are refused.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Multimodal RoPE axes: with text positions (every axis the same position) M-RoPE is 1-D RoPE, so they are dropped.
TEXT_POSITION_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def target_rope_parameters(target_config: Any) -> tuple[dict[str, Any], str]:
    """The target's full-attention RoPE as one flat transformers-5 ``rope_parameters`` dict, and where it was read.

    Sources, first found: ``rope_parameters["full_attention"]`` (transformers 5, nested per layer type, as in
    Gemma 3), a flat ``rope_parameters``, the legacy top-level ``rope_scaling`` (``type`` or ``rope_type``) with
    ``rope_theta``. A top-level ``partial_rotary_factor`` is folded in as transformers'
    ``RotaryEmbeddingConfigMixin.standardize_rope_params`` does. The theta defaults to the config's
    ``default_theta`` (transformers: 1e4) when the config names none.

    Returns:
        ``(parameters, key)``: ``parameters`` always has ``rope_type`` and ``rope_theta``; ``key`` is the config
        key they came from (``rope_parameters.full_attention``, ``rope_parameters`` or ``rope_scaling``).

    Raises:
        ValueError: ``rope_parameters`` is nested per layer type without a ``full_attention`` entry (or with
            ``null`` there: no RoPE on full-attention layers).
    """
    cfg = text_config(target_config)
    rope = getattr(cfg, "rope_parameters", None)
    nested = isinstance(rope, dict) and (FULL in rope or any(isinstance(v, dict) for v in rope.values()))
    if nested:
        if not isinstance(rope.get(FULL), dict):
            raise ValueError(f"target config rope_parameters is nested per layer type ({sorted(rope)}) but "
                             f"rope_parameters.{FULL} is {rope.get(FULL)!r}: the drafter takes the target's "
                             "full-attention RoPE and cannot represent a target without one")
        params, key = dict(rope[FULL]), f"rope_parameters.{FULL}"
    elif isinstance(rope, dict) and rope:
        params, key = dict(rope), "rope_parameters"
    else:
        params, key = dict(getattr(cfg, "rope_scaling", None) or {}), "rope_scaling"
    if "type" in params:  # legacy spelling of rope_type
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or getattr(cfg, "default_theta", 1e4))
    if getattr(cfg, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    if params["rope_type"] in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings", getattr(
            cfg, "original_max_position_embeddings", None) or int(getattr(cfg, "max_position_embeddings")))
    return params, key


def drafter_rope_parameters(target_config: Any, rope_theta: float | None = None) -> dict[str, Any]:
    """The drafter's ``rope_parameters``: the target's full-attention RoPE (theta, type and its scaling keys).

    ``rope_theta`` (config ``drafter.rope_theta``) replaces the theta only. Two keys are not carried, on purpose:
    ``mrope_section`` / ``mrope_interleaved`` (text positions make M-RoPE 1-D RoPE) and ``partial_rotary_factor``:
    the DFlash checkpoint's Qwen3 layers (official ``dflash/model.py``, vLLM, SGLang) rotate the whole head, so a
    drafter of a partially rotary target (Qwen3.5, Qwen3-Next: 0.25) rotates its whole head with the target's theta
    and scaling (logged). The parameters are checked by computing them with transformers' own
    ``ROPE_INIT_FUNCTIONS`` when the drafter is built (:func:`build_drafter_config`).

    Raises:
        ValueError: a RoPE the drafter cannot represent, naming the target config key: a ``rope_type`` outside
            :data:`ROPE_TYPES`, a key transformers' ``RopeParameters`` does not define, a nested config without
            full-attention RoPE.
    """
    params, key = target_rope_parameters(target_config)
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"target config {key}.rope_type = {params['rope_type']!r}: the drafter (Qwen3 layers of the "
                         f"DFlash format) cannot represent it; supported: {', '.join(ROPE_TYPES)}")
    for name in TEXT_POSITION_ROPE_KEYS:
        params.pop(name, None)
    partial = params.pop("partial_rotary_factor", None)
    if partial is not None and float(partial) != 1.0:
        log.warning("target config %s.partial_rotary_factor = %s: the drafter rotates its whole head (DFlash "
                    "checkpoints have no partial rotation) with the target's theta and scaling", key, partial)
    unknown = sorted(set(params) - set(RopeParameters.__annotations__))
    if unknown:
        raise ValueError(f"target config {key} has RoPE key(s) the drafter cannot represent: "
                         + ", ".join(f"{key}.{name}" for name in unknown))
    if rope_theta is not None:
        params["rope_theta"] = float(rope_theta)
    params["rope_theta"] = float(params["rope_theta"])
    return params


def _check_rope(config: Qwen3Config, target_config: Any) -> None:
    """Compute the drafter's inverse frequencies with transformers' RoPE functions; ValueError naming the key."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return
    _, key = target_rope_parameters(target_config)
    try:
        ROPE_INIT_FUNCTIONS[rope_type](config)
    except Exception as exc:  # a missing / mis-sized scaling key, surfaced with the config key it came from
        raise ValueError(f"target config {key} ({rope_type}): the drafter (head_dim {config.head_dim}) cannot "
                         f"compute this RoPE: {type(exc).__name__}: {exc}") from exc


@strict
class DFlashConfig(Qwen3Config):
    """A DFlash drafter's config: a ``Qwen3Config`` plus the DFlash fields, read as attributes.

    ``dflash_config`` (a dict, as in the z-lab ``config.json``) is a view of the fields: given on construction
    or assigned, its keys set the fields of the same name, and the keys that are not fields
    (``output_multiplier``, ``input_embedding_scale``, ``final_logit_softcapping``) are kept beside them; read,
    it is the fields plus those keys. :meth:`to_dict` writes it in place of the fields.

    Attributes:
        target_layer_ids: tapped target layers, id i = HF ``output_hidden_states[i + 1]``.
        mask_token_id: the id whose (target) embedding fills block slots 1..B-1.
        block_size: B, tokens per draft block (anchor included).
        num_target_layers: decoder layers of the target.
        is_causal: ``None`` = per layer (sliding causal, full bidirectional); a bool forces all layers.
    """

    ARCHITECTURE: ClassVar[str] = ARCHITECTURE
    #: the fields serialised inside ``dflash_config``
    DRAFT_FIELDS: ClassVar[tuple[str, ...]] = ("target_layer_ids", "mask_token_id", "block_size")

    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    block_size: int = 16
    num_target_layers: int | None = None
    is_causal: bool | None = None

    @property
    def dflash_config(self) -> dict[str, Any]:
        """The z-lab ``dflash_config`` dict: the drafter fields plus the other keys it was given."""
        return {**self.__dict__.get("_dflash_extra", {}), **{name: getattr(self, name) for name in self.DRAFT_FIELDS}}

    @dflash_config.setter
    def dflash_config(self, value: dict | None) -> None:
        extra = {}
        for name, v in (value or {}).items():
            if name in self.DRAFT_FIELDS:
                if v is not None:
                    setattr(self, name, v)
            else:
                extra[name] = v
        self.__dict__["_dflash_extra"] = extra

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.architectures = [self.ARCHITECTURE]

    def to_dict(self) -> dict[str, Any]:
        """HF's dict with the drafter fields moved into ``dflash_config`` (z-lab layout)."""
        d = super().to_dict()
        for name in (*self.DRAFT_FIELDS, "_dflash_extra"):
            d.pop(name, None)
        d["dflash_config"] = self.dflash_config
        d["architectures"] = [self.ARCHITECTURE]
        return d


@strict
class DFlash2Config(DFlashConfig):
    """A DFlash2 drafter's config (z-lab ``DFlash2DraftModel``): :class:`DFlashConfig` plus the two new modules.

    Attributes:
        conv_kernel_size: taps of each grouped dynamic causal convolution (2: ``x_t`` and ``x_{t-1}``).
        conv_group_size: channels sharing one content-dependent kernel correction; divides ``hidden_size``.
        selector_rank: rank of the candidate selector's bilinear term.
        selector_top_k: candidates per block position the selector rescores.

    Raises:
        ValueError: ``conv_group_size`` does not divide ``hidden_size``, or ``selector_top_k`` exceeds the
            vocabulary.
    """

    ARCHITECTURE: ClassVar[str] = ARCHITECTURE_2
    DRAFT_FIELDS: ClassVar[tuple[str, ...]] = DFlashConfig.DRAFT_FIELDS + (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

    conv_kernel_size: int = 2
    conv_group_size: int = 64
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.conv_kernel_size < 1 or self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"drafter.conv_group_size {self.conv_group_size} does not divide hidden_size "
                             f"{self.hidden_size} (or drafter.conv_kernel_size {self.conv_kernel_size} < 1)")
        if not 1 <= self.selector_top_k <= self.vocab_size or self.selector_rank < 1:
            raise ValueError(f"drafter.selector_top_k {self.selector_top_k} must be in 1..{self.vocab_size} "
                             f"(vocab_size) and drafter.selector_rank {self.selector_rank} >= 1")


def config_class_for(architectures: list[str] | None) -> type[DFlashConfig]:
    """:class:`DFlash2Config` when ``architectures`` names ``DFlash2DraftModel``, else :class:`DFlashConfig`."""
    return DFlash2Config if ARCHITECTURE_2 in (architectures or []) else DFlashConfig


def default_loss_gamma(block_size: int) -> float:
    """Decay gamma of the slot weights ``exp(-(k - 1) / gamma)``.

    gamma = 7 for B = 16 (SpecForge's DFlash paper reproduction); for other block sizes we scale it with the
    block, ``7 * B / 16``, so that the last slot keeps the same relative weight (a draftsmith choice, not a
    published number).
    """
    return 7.0 * block_size / 16.0


def resolve_mask_token_id(explicit: int | None, tokenizer: Any | None, vocab_size: int) -> tuple[int, str]:
    """The mask token id and how it was chosen.

    Order: ``explicit`` (config) > the tokenizer's ``mask_token_id`` > the first unused embedding row
    (``len(tokenizer) < vocab_size``: rows no token maps to) > pad > eos > unk. The embedding row is the
    target's and stays frozen, so any row works; an unused one keeps the mask distinct from real text.

    Returns:
        ``(mask_token_id, reason)``.

    Raises:
        ValueError: the explicit id is outside ``0 .. vocab_size - 1``, or nothing could be resolved.
    """
    if explicit is not None:
        if not 0 <= int(explicit) < vocab_size:
            raise ValueError(f"drafter.mask_token_id {explicit} is outside the target vocabulary 0..{vocab_size - 1}")
        return int(explicit), "config"
    if tokenizer is not None:
        mask = getattr(tokenizer, "mask_token_id", None)
        if mask is not None and 0 <= mask < vocab_size:
            return int(mask), "tokenizer mask token"
        n_tok = len(tokenizer)
        if n_tok < vocab_size:
            return int(n_tok), f"first unused embedding row (tokenizer has {n_tok} tokens, embedding {vocab_size})"
        for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
            value = getattr(tokenizer, name, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None and 0 <= value < vocab_size:
                return int(value), name.replace("_id", "")
    raise ValueError("cannot resolve a mask token id: set drafter.mask_token_id")


def build_drafter_config(target_config: Any, *, num_layers: int, block_size: int, target_layer_ids: list[int],
                         mask_token_id: int, vocab_size: int | None = None,
                         layer_types: list[str] | None = None, sliding_window: int | None = None,
                         is_causal: bool | None = None, intermediate_size: int | None = None,
                         num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                         head_dim: int | None = None, rope_theta: float | None = None,
                         architecture: str = "dflash", conv_kernel_size: int = 2, conv_group_size: int = 64,
                         selector_rank: int = 256, selector_top_k: int = 16) -> DFlashConfig:
    """A z-lab drafter config (:class:`DFlashConfig`, or :class:`DFlash2Config` for ``architecture="dflash2"``)
    sized from the target's config.

    Width, norm eps, activation and max positions follow the target (its ``text_config`` for multimodal
    Qwen3.5 checkpoints); heads, head dim and MLP width too unless given. RoPE is the target's full-attention
    RoPE (:func:`drafter_rope_parameters`: theta, type and scaling; ``rope_theta`` replaces the theta), used by
    every drafter layer. ``target_layer_ids`` and ``mask_token_id`` are always written explicitly. The
    ``conv_*`` / ``selector_*`` arguments are read for ``dflash2`` only.

    Args:
        target_config: the target's HF config.
        vocab_size: rows of the target's embedding (default: the config's ``vocab_size``).
        layer_types: per drafter layer ``full_attention`` / ``sliding_attention`` (default all full).
        is_causal: ``None`` = per layer (sliding causal, full bidirectional); a bool forces all layers.
        architecture: ``dflash`` or ``dflash2`` (``drafter.architecture``).

    Raises:
        ValueError: an unknown architecture, inconsistent layer types / sliding window, ids out of range, DFlash2
            sizes that do not fit (:class:`DFlash2Config`), or a target RoPE the drafter cannot represent (the
            message names the target config key).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"drafter.architecture {architecture!r} is not one of {sorted(ARCHITECTURES)}")
    cfg = text_config(target_config)
    num_target_layers = int(cfg.num_hidden_layers)
    for i in target_layer_ids:
        if not 0 <= int(i) < num_target_layers:
            raise ValueError(f"target layer id {i} is outside 0..{num_target_layers - 1}")
    layer_types = list(layer_types) if layer_types else [FULL] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"drafter.layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = sorted(set(layer_types) - {FULL, SLIDING})
    if bad:
        raise ValueError(f"drafter.layer_types: unknown type(s) {bad}")
    any_sliding = SLIDING in layer_types
    if any_sliding and not sliding_window:
        raise ValueError("drafter.layer_types has sliding_attention layers but drafter.sliding_window is not set")
    heads = int(num_attention_heads or cfg.num_attention_heads)
    kv_heads = int(num_key_value_heads or getattr(cfg, "num_key_value_heads", None) or heads)
    hd = int(head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rope_parameters = drafter_rope_parameters(target_config, rope_theta)
    inter = int(intermediate_size or cfg.intermediate_size)
    extra = {}
    if architecture == "dflash2":
        extra = {"conv_kernel_size": int(conv_kernel_size), "conv_group_size": int(conv_group_size),
                 "selector_rank": int(selector_rank), "selector_top_k": int(selector_top_k)}
    cls = DFlash2Config if architecture == "dflash2" else DFlashConfig
    config = cls(
        vocab_size=int(vocab_size or cfg.vocab_size), hidden_size=int(cfg.hidden_size), intermediate_size=inter,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), tie_word_embeddings=False,
        rope_parameters=rope_parameters, attention_bias=False,
        use_sliding_window=any_sliding, sliding_window=int(sliding_window) if any_sliding else None,
        max_window_layers=num_layers, layer_types=layer_types,
        target_layer_ids=[int(i) for i in target_layer_ids], mask_token_id=int(mask_token_id),
        block_size=int(block_size), num_target_layers=num_target_layers, is_causal=is_causal, **extra,
    )
    _check_rope(config, target_config)
    return config


def drafter_config_from_dict(raw: dict[str, Any]) -> DFlashConfig:
    """The config of a ``config.json`` dict: :class:`DFlash2Config` when its ``architectures`` names
    ``DFlash2DraftModel``, else :class:`DFlashConfig` (the ``dflash_config`` keys become fields).

    Raises:
        ValueError: invalid DFlash2 sizes (:class:`DFlash2Config`).
    """
    return config_class_for(raw.get("architectures")).from_dict(raw)


def drafter_config_dict(config: DFlashConfig) -> dict[str, Any]:
    """The full ``config.json`` dict of a drafter, in the z-lab format, every field explicit.

    Besides HF's own serialisation (``rope_parameters``, transformers 5) this writes the RoPE in the legacy form,
    ``rope_theta`` and ``rope_scaling`` (the scaling keys with ``rope_type``, ``null`` for plain RoPE), which
    transformers 4, vLLM and SGLang read and transformers 5 converts back to the same ``rope_parameters``; an explicit
    ``is_causal`` (``false`` for all-full drafters, ``true`` for all-sliding, ``null`` = per-layer semantics
    for mixed drafters unless the config forces one) and ``num_target_layers``.

    Raises:
        ValueError: the config lacks ``target_layer_ids``, ``mask_token_id`` or ``block_size``.
    """
    d = config.to_dict()
    dflash = d["dflash_config"]
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if dflash.get(key) is None:
            raise ValueError(f"drafter config has no dflash_config.{key}; refusing to write an implicit value")
    d["model_type"] = "qwen3"
    rope = dict(d.get("rope_parameters") or {})
    d["rope_theta"] = float(rope.pop("rope_theta"))
    d["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    layer_types = list(config.layer_types)
    is_causal = config.is_causal
    if is_causal is None and len(set(layer_types)) == 1:
        is_causal = layer_types[0] == SLIDING
    d["is_causal"] = is_causal
    d["num_target_layers"] = int(config.num_target_layers)
    for key in ("id2label", "label2id", "_name_or_path", "transformers_version", "output_attentions",
                "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type"):
        d.pop(key, None)
    return d


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A drafter setting: the field of a :class:`DFlashConfig`; for other configs (the official package's)
    ``config.dflash_config[name]``, else ``config.<name>``; else ``default`` (z-lab lookup order)."""
    if isinstance(config, DFlashConfig) and name in config.DRAFT_FIELDS:
        value = getattr(config, name)
        return default if value is None else value
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash and dflash[name] is not None:
        return dflash[name]
    value = getattr(config, name, None)
    return default if value is None else value


def layer_is_causal(config: Any, layer_idx: int) -> bool:
    """Whether drafter layer ``layer_idx`` is causal inside the block (official semantics).

    Top-level ``is_causal`` wins when set; otherwise a layer is causal iff its type is ``sliding_attention``.
    """
    layer_types = getattr(config, "layer_types", None)
    layer_type = layer_types[layer_idx] if layer_types else FULL
    is_causal = getattr(config, "is_causal", None)
    return layer_type == SLIDING if is_causal is None else bool(is_causal)


def layer_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window (tokens) of drafter layer ``layer_idx``, ``None`` for full-attention layers."""
    layer_types = getattr(config, "layer_types", None)
    layer_type = layer_types[layer_idx] if layer_types else FULL
    return int(config.sliding_window) if layer_type == SLIDING and config.sliding_window else None
