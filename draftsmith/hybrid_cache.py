"""What the target's transformers cache holds, layer by layer, for the stages that drive it themselves.

Regenerate's static engine and evaluate's static and dynamic decoders all run the target on a transformers cache
(``StaticCache`` / ``DynamicCache``) and need to know what is in it: this module is the one place that knows.

A cache has one layer object per decoder layer (``cache.layers[i]``), of a type that follows the decoder layer's
type (:func:`layer_types`):

* **attention layers** (``full_attention``; ``sliding_attention`` / ``chunked_attention`` keep only a window) hold
  keys and values ``[rows, num_key_value_heads, positions, head_dim]`` in the target's compute dtype. A static
  layer writes a forward's K/V at its length counter ``cumulative_length`` (a 0-d int64 tensor, one per layer, not
  per row) and advances it: the counter is the whole state a decode step changes (K/V past it are masked).
* **recurrent layers** (Gated DeltaNet ``linear_attention`` in Qwen3.5 / Qwen3-Next; transformers'
  ``LinearAttentionCacheLayerMixin``) hold, per state index (one for Gated DeltaNet), a **conv state** ``[rows,
  conv_dim, kernel]`` in the compute dtype (the last ``kernel`` inputs of the short causal convolution over the
  mixed q / k / v projection, ``conv_dim = 2 x key_heads x key_head_dim + value_heads x value_head_dim``) and a
  **recurrent state** ``[rows, value_heads, key_head_dim, value_head_dim]`` in float32 (the delta rule's fast
  weights). Both are allocated by the first forward, updated in place at fixed addresses, and absorb every token
  fed: no counter rolls them back (:func:`snapshot` / :func:`restore`, or the replay of the kept tokens through
  the layer's token mixer, :func:`mixer_of`).
* MLP-only and reused-KV layers (``dummy``) hold nothing.

transformers names the cache argument ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the forward of the
model, :func:`cache_kwargs`) and ``cache_params`` / ``cache`` (a token mixer's forward, :data:`MIXER_CACHE_ARGS`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from draftsmith.target import is_hybrid, text_config

#: Name of a token mixer's cache argument: ``cache_params`` up to transformers 5.23, ``cache`` from 5.24.
MIXER_CACHE_ARGS = ("cache_params", "cache")


def cache_kwargs(model: nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(...)``: transformers 5.24 renamed the forward's ``past_key_values`` to
    ``cache`` (the old name warns and is to go in 5.40); earlier versions only take ``past_key_values``."""
    return {_cache_arg_name(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_arg_name(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def record_past(cache) -> None:
    """Make ``cache`` keep its sliding-window K/V and conv windows until ``crop`` (``Cache.activate_past_recording``,
    the mechanism transformers gives assisted decoding), without intermediate recurrent states: evaluate rolls the
    recurrent state back itself (:class:`draftsmith.evaluate.cache.TargetCache`).

    transformers 5.25 added ``recurrent_states_to_keep`` to it, defaulting to None, which its Qwen3.5 / Qwen3-Next
    Gated DeltaNet forwards then compare with the token count and fail on (``TypeError: '<' not supported between
    'int' and 'NoneType'``); 0 is passed where the argument exists."""
    method = LinearAttentionCacheLayerMixin.activate_past_recording
    if "recurrent_states_to_keep" in inspect.signature(method).parameters:
        cache.activate_past_recording(recurrent_states_to_keep=0)
    else:
        cache.activate_past_recording()


def layer_types(cfg) -> list[str]:
    """The cache layer type of each decoder layer of text config ``cfg``, as transformers' ``StaticCache`` picks
    them (``cache_utils.get_layer_types_and_kwargs``): ``layer_types`` when the config has them, else sliding /
    chunked / full by ``sliding_window`` / ``attention_chunk_size``; reused-KV and MLP-only layers hold nothing
    (``dummy``).

    Returns:
        One name per decoder layer: ``full_attention``, ``sliding_attention``, ``chunked_attention``,
        ``linear_attention``, ``dummy``, or whatever other type the config names.
    """
    types = getattr(cfg, "layer_types", None)
    if types is None:
        kind = ("sliding_attention" if getattr(cfg, "sliding_window", None) is not None
                else "chunked_attention" if getattr(cfg, "attention_chunk_size", None) is not None
                else "full_attention")
        types = [kind] * cfg.num_hidden_layers
    sharing = getattr(cfg, "kv_sharing_modes", None)
    if sharing is not None:
        types = ["dummy" if mode == "reuse" else t for t, mode in zip(types, sharing)]
    return ["dummy" if t in ("moe", "mlp") else t for t in types]


def static_supported(target: nn.Module) -> tuple[bool, str]:
    """``(ok, why not)``: whether the target's K/V can live in a transformers ``StaticCache`` whose length counter
    is the whole cache state (attention-only, no sliding window), as the static-cache decoders of regenerate and
    evaluate need: recurrent (Gated DeltaNet) layers need snapshot / replay rollback, and sliding-window layers
    keep ring buffers that a length counter cannot roll back."""
    cfg = text_config(target.config)
    if is_hybrid(target.config):
        return False, "hybrid recurrent (Gated DeltaNet) layers need the snapshot / replay rollback"
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or getattr(cfg, "sliding_window", None) and getattr(
            cfg, "use_sliding_window", True):
        return False, "sliding-window layers keep ring buffers that a length counter cannot roll back"
    return True, ""


def is_recurrent(layer) -> bool:
    """Whether cache layer ``layer`` holds conv / recurrent state (a ``LinearAttentionCacheLayerMixin``; it may
    hold K/V as well)."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def recurrent_layers(cache) -> list[int]:
    """Indices of the cache's recurrent layers (:func:`is_recurrent`), in order; ``[]`` for attention-only
    targets. The cache's layer objects exist before any forward, their tensors only after the first."""
    return [i for i, layer in enumerate(cache.layers) if is_recurrent(layer)]


def recurrent_states(cache) -> list[torch.Tensor]:
    """The live state tensors of every recurrent layer, layer by layer: its conv states ``[rows, conv_dim, kernel]``
    (compute dtype), then its recurrent states ``[rows, value_heads, key_head_dim, value_head_dim]`` (float32), the
    ones allocated so far (none before the first forward). In a ``StaticCache`` they keep their addresses (a
    captured CUDA graph may read and write them); writing into them changes the cache."""
    out = []
    for layer in cache.layers:
        if is_recurrent(layer):
            for states in (layer.conv_states, layer.recurrent_states):
                out += [t for t in states.values() if t is not None]
    return out


def length_counters(cache) -> list[torch.Tensor]:
    """The static layers' length counters: each layer's ``cumulative_length``, a 0-d int64 tensor (the positions
    it holds; the next forward writes its K/V there), for the layers that have one as a tensor."""
    return [layer.cumulative_length for layer in cache.layers
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(live tensor, copy)`` of every piece of a ``StaticCache`` that a decode step advances in place: the
    recurrent layers' conv and recurrent states (:func:`recurrent_states`) and the attention layers' length
    counters (:func:`length_counters`; K/V slots past a counter are masked, so they need no copy). Copies take as
    much memory as the states; :func:`restore` puts them back."""
    return [(t, t.clone()) for t in recurrent_states(cache) + length_counters(cache)]


def restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each snapshot copy back into its live tensor (:func:`snapshot`), in place (the addresses stay)."""
    for live, copy in saved:
        live.copy_(copy)


def reset(cache) -> None:
    """Empty a ``StaticCache`` for the next prefill, in place: recurrent layers' states zeroed (``reset()``),
    attention layers' length counters set to 0 (their K/V become stale and invisible)."""
    for layer in cache.layers:
        if is_recurrent(layer):
            layer.reset()  # zero conv / recurrent states, next forward is a prefill
        elif getattr(layer, "is_initialized", False):
            layer.cumulative_length.zero_()


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """The token-mixer child of decoder layer ``layer`` that owns a recurrent cache (its forward takes the cache,
    :data:`MIXER_CACHE_ARGS`: ``linear_attn`` in Qwen3.5 / Qwen3-Next, ``mamba`` / ``mixer`` elsewhere); None when
    there is none. Call it only on layers whose cache layer is recurrent, which have no attention child."""
    for child in layer.children():
        try:
            params = inspect.signature(child.forward).parameters
        except (TypeError, ValueError):
            continue
        if any(name in params for name in MIXER_CACHE_ARGS):
            return child
    return None


def mixer_cache_arg(mixer: nn.Module) -> str:
    """The name under which ``mixer`` (:func:`mixer_of`) takes the cache: one of :data:`MIXER_CACHE_ARGS`.

    Raises:
        StopIteration: a module whose forward takes none of them (not a mixer).
    """
    return next(a for a in MIXER_CACHE_ARGS if a in inspect.signature(mixer.forward).parameters)


def hidden_states_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input ``hidden_states [rows, tokens, hidden]`` of a mixer call (a forward pre-hook's ``args`` /
    ``kwargs``): by keyword when given so, else the first positional argument."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
