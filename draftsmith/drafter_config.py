"""The DFlash drafter's configuration, as transformers splits configuration from modeling.

A drafter is a ``Qwen3Config`` (``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``) with a
``dflash_config`` (``target_layer_ids``, ``block_size``, ``mask_token_id``, optional ``layer_types`` /
``sliding_window`` / ``is_causal``): the checkpoint contract of the official z-lab ``dflash`` package, vLLM and
SGLang. Here: building it from the target's config (:func:`build_drafter_config`), the mask token choice, the loss
decay, and which layers are causal or sliding. Used by train, export and evaluate; :mod:`draftsmith.modeling` holds
the model itself and :mod:`draftsmith.target_layers` the rule for the tapped target layers.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from draftsmith.target import text_config

ARCHITECTURE = "DFlashDraftModel"
FULL = "full_attention"
SLIDING = "sliding_attention"
# Weight names of a z-lab DFlash checkpoint besides the per-layer ones.
TOP_LEVEL_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")


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
                         head_dim: int | None = None, rope_theta: float | None = None) -> Qwen3Config:
    """A z-lab DFlash drafter config (``Qwen3Config`` + ``dflash_config``) sized from the target's config.

    Width, norm eps, activation and max positions follow the target (its ``text_config`` for multimodal
    Qwen3.5 checkpoints); heads, head dim, MLP width and RoPE theta too unless given. ``target_layer_ids`` and
    ``mask_token_id`` are always written explicitly.

    Args:
        target_config: the target's HF config.
        vocab_size: rows of the target's embedding (default: the config's ``vocab_size``).
        layer_types: per drafter layer ``full_attention`` / ``sliding_attention`` (default all full).
        is_causal: ``None`` = per layer (sliding causal, full bidirectional); a bool forces all layers.

    Raises:
        ValueError: inconsistent layer types / sliding window, or ids out of range.
    """
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
    if rope_theta is None:
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        rope_theta = rope_theta or getattr(cfg, "rope_theta", None) or 1e6
    inter = int(intermediate_size or cfg.intermediate_size)
    config = Qwen3Config(
        vocab_size=int(vocab_size or cfg.vocab_size), hidden_size=int(cfg.hidden_size), intermediate_size=inter,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)}, attention_bias=False,
        use_sliding_window=any_sliding, sliding_window=int(sliding_window) if any_sliding else None,
        max_window_layers=num_layers, layer_types=layer_types,
    )
    config.architectures = [ARCHITECTURE]
    config.is_causal = is_causal
    config.num_target_layers = num_target_layers
    config.dflash_config = {"target_layer_ids": [int(i) for i in target_layer_ids],
                            "mask_token_id": int(mask_token_id), "block_size": int(block_size)}
    return config


def drafter_config_dict(config: Qwen3Config) -> dict[str, Any]:
    """The full ``config.json`` dict of a drafter, in the z-lab format, every field explicit.

    Besides HF's own serialisation this writes the legacy ``rope_theta`` (read by older loaders), an explicit
    ``is_causal`` (``false`` for all-full drafters, ``true`` for all-sliding, ``null`` = per-layer semantics
    for mixed drafters unless the config forces one) and ``num_target_layers``.

    Raises:
        ValueError: ``dflash_config`` lacks ``target_layer_ids``, ``mask_token_id`` or ``block_size``.
    """
    d = config.to_dict()
    dflash = dict(getattr(config, "dflash_config", None) or {})
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if dflash.get(key) is None:
            raise ValueError(f"drafter config has no dflash_config.{key}; refusing to write an implicit value")
    d["architectures"] = [ARCHITECTURE]
    d["model_type"] = "qwen3"
    rope = d.get("rope_parameters") or {}
    d["rope_theta"] = float(rope.get("rope_theta", 1e6))
    layer_types = list(config.layer_types)
    is_causal = getattr(config, "is_causal", None)
    if is_causal is None and len(set(layer_types)) == 1:
        is_causal = layer_types[0] == SLIDING
    d["is_causal"] = is_causal
    d["num_target_layers"] = int(config.num_target_layers)
    d["dflash_config"] = dflash
    for key in ("id2label", "label2id", "_name_or_path", "transformers_version", "output_attentions",
                "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type"):
        d.pop(key, None)
    return d


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.dflash_config[name]``, else ``config.<name>``, else ``default`` (z-lab lookup order)."""
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
