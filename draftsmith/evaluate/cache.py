"""The target's cache during speculative decoding, with exact rollback for recurrent (GDN) layers.

A verify forward feeds the target ``consumed`` tokens (the last committed token plus k drafts); only
the first ``keep`` of them are committed. Attention layers roll back by dropping the last
``consumed - keep`` K/V entries (``DynamicLayer.crop``). Recurrent layers (Gated DeltaNet in
Qwen3.5 / Qwen3-Next, Mamba-style mixers) cannot: their state after the verify forward has absorbed
every fed token, and Hugging Face's ``crop()`` only trims the short causal-conv window
(transformers 5.23 ``LinearAttentionCacheLayerMixin.crop``), leaving the recurrent state wrong.

:class:`TargetCache` therefore snapshots every recurrent state before a verify forward and, when
fewer than ``consumed`` tokens are kept:

1. rewinds the conv window by ``consumed`` tokens (exact: the cache records the past, the mechanism
   transformers provides for assisted decoding, ``Cache.activate_past_recording``),
2. restores the recurrent-state snapshot (the state at the start of the block), and
3. re-runs the kept tokens through the recurrent layers only, from their inputs recorded during the
   verify forward (``rollback="mixer"``; inputs of a causal layer at the kept positions do not depend
   on the rejected tokens after them), or, when a mixer cannot be located, through the whole target
   after cropping every layer back to the block start (``rollback="forward"``).

When the whole block is kept nothing is re-run. The result is the cache the target would hold after
consuming exactly the committed tokens (tested: greedy speculative output == greedy target-only
output token for token on tiny Llama, Qwen3.5 and Qwen3-Next targets). The official z-lab HF backend
rolls back with ``crop()`` only, which is exact for attention-only targets (its MLX backend snapshots
GDN state the same way).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from draftsmith.hybrid_cache import cache_kwargs, hidden_states_arg, mixer_of, record_past, recurrent_layers
from draftsmith.target import decoder_layers

log = logging.getLogger("draftsmith.evaluate")

ROLLBACK_MODES = ("auto", "mixer", "forward")


def _attention_crop(layer, tokens_to_remove: int) -> None:
    """Crop only the K/V part of a cache layer that also holds linear-attention state."""
    for cls in type(layer).__mro__:
        if issubclass(cls, DynamicLayer) and not issubclass(cls, LinearAttentionCacheLayerMixin):
            cls.crop(layer, tokens_to_remove)
            return
    raise TypeError(f"no attention part in cache layer {type(layer).__name__}")


def _rewind_linear(layer, consumed: int, start: dict[int, torch.Tensor]) -> None:
    """Rewind the conv windows of a linear-attention cache layer by ``consumed`` tokens
    (``LinearAttentionCacheLayerMixin.crop``, exact while the cache records the past).

    From transformers 5.25 that crop also sets each recurrent state to the one recorded ``consumed`` tokens back
    (``recurrent_states_history``), which holds only the state before each forward when no intermediate state is
    kept (:func:`draftsmith.hybrid_cache.record_past`): it is handed ``start`` (state index -> the block-start state,
    :meth:`TargetCache.checkpoint`'s snapshot), the state restored anyway."""
    history = getattr(layer, "recurrent_states_history", None)
    if history is not None:
        for s in list(history):
            if s in start:
                history[s] = [start[s].clone()] + [None] * (consumed - 1)
    LinearAttentionCacheLayerMixin.crop(layer, -consumed)


class TargetCache:
    """A ``DynamicCache`` for the target plus snapshot / rollback of recurrent state.

    Args:
        target: the Hugging Face causal LM (any; hybrid GDN / Mamba layers included).
        rollback: ``auto`` (re-run only the recurrent mixers when they can be located, else the whole
            target), ``mixer`` (require the mixer path) or ``forward`` (always re-run the target).

    Use: ``checkpoint()`` before a verify forward of ``consumed`` tokens, then
    ``rollback(consumed, keep, block_ids, block_positions)`` with the number of tokens committed.
    ``cache`` is the object to pass as ``past_key_values``.

    Raises:
        ValueError: unknown ``rollback`` mode, or ``mixer`` requested for a target whose recurrent
            mixers cannot be located.
    """

    def __init__(self, target: nn.Module, rollback: str = "auto"):
        if rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {rollback!r}")
        self.target = target
        self.cache = DynamicCache(config=target.config)
        record_past(self.cache)  # conv windows / sliding windows keep the past until crop
        self.recurrent = recurrent_layers(self.cache)
        self.length = 0  # tokens the target has consumed (committed positions)
        self._snapshot: dict[int, dict[int, torch.Tensor]] = {}
        self._inputs: dict[int, tuple[tuple, dict]] = {}
        self._handles: list = []
        self._replaying = False
        self.mode = "forward"
        if self.recurrent:
            layers = decoder_layers(target)
            mixers = {}
            for i in self.recurrent:
                layer = self.cache.layers[i]
                mixer = mixer_of(layers[i]) if i < len(layers) else None
                # a layer holding both K/V and recurrent state needs its attention part re-run too
                if mixer is None or isinstance(layer, DynamicLayer):
                    mixers = None
                    break
                mixers[i] = mixer
            if rollback == "mixer" and mixers is None:
                raise ValueError(f"rollback='mixer': cannot locate the recurrent mixer of every "
                                 f"recurrent layer of {type(target).__name__}; use 'forward' or 'auto'")
            if rollback in ("auto", "mixer") and mixers:
                self.mode = "mixer"
                for i, mixer in mixers.items():
                    self._handles.append(mixer.register_forward_pre_hook(self._recorder(i), with_kwargs=True))
                self._mixers = mixers

    # -- recording the recurrent mixers' inputs of the last forward ---------------------------------
    def _recorder(self, idx: int):
        def hook(module, args, kwargs):
            if not self._replaying:
                self._inputs[idx] = (args, kwargs)
        return hook

    def close(self) -> None:
        """Remove the hooks (the cache stays usable for plain forwards)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._inputs.clear()

    def __enter__(self) -> "TargetCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- snapshot / rollback ---------------------------------------------------------------------
    def trim(self) -> None:
        """Shrink recorded conv / sliding windows to their working size (``crop(0)``) after a forward
        whose tokens are all committed (prefill, or a fully accepted block)."""
        self.cache.crop(0)

    def checkpoint(self) -> None:
        """Snapshot the recurrent states (clones; ``[batch, heads, d_k, d_v]`` each for GDN)."""
        self._snapshot = {}
        for i in self.recurrent:
            layer = self.cache.layers[i]
            self._snapshot[i] = {s: layer.recurrent_states[s].clone()
                                 for s, ok in layer.is_recurrent_states_initialized.items() if ok}

    def advance(self, consumed: int) -> None:
        """Account for a forward of ``consumed`` tokens that are all committed."""
        self.length += consumed
        self.trim()

    @torch.inference_mode()
    def rollback(self, consumed: int, keep: int, block_ids: torch.Tensor,
                 block_positions: torch.Tensor) -> None:
        """Make the cache hold exactly the first ``keep`` of the ``consumed`` tokens just verified.

        Args:
            consumed: tokens fed by the last forward (after :meth:`checkpoint`).
            keep: committed tokens among them, 0 <= keep <= consumed.
            block_ids: ``[1, consumed]`` int64, the tokens of that forward (for ``forward`` mode).
            block_positions: ``[1, consumed]`` int64, their positions.

        Raises:
            ValueError: ``keep`` outside 0..consumed.
        """
        if not 0 <= keep <= consumed:
            raise ValueError(f"cannot keep {keep} of {consumed} verified tokens")
        remove = consumed - keep
        if remove == 0:
            self.advance(consumed)
            return
        # recurrent / conv layers are rewound to the block start, so the kept tokens are re-run through them
        needs_rerun = keep > 0 and bool(self.recurrent)
        # attention layers: drop the rejected K/V (all fed tokens when the whole target is re-run)
        attn_remove = consumed if (needs_rerun and self.mode == "forward") else remove
        for idx, layer in enumerate(self.cache.layers):
            if idx in self.recurrent:
                _rewind_linear(layer, consumed, self._snapshot.get(idx, {}))  # conv window back to the block start
                for s, state in self._snapshot.get(idx, {}).items():
                    layer.recurrent_states[s].copy_(state)
                if isinstance(layer, DynamicLayer):  # linear + attention in one cache layer
                    _attention_crop(layer, -attn_remove)
            else:
                layer.crop(-attn_remove)
        if needs_rerun:
            if self.mode == "mixer":
                self._replaying = True
                try:
                    for idx, mixer in self._mixers.items():
                        args, kwargs = self._inputs[idx]
                        hidden = hidden_states_arg(args, kwargs)
                        if hidden.shape[1] != consumed:
                            raise RuntimeError(f"recorded input of recurrent layer {idx} has "
                                               f"{hidden.shape[1]} tokens, expected {consumed}")
                        kwargs = dict(kwargs)
                        mask = kwargs.get("attention_mask")
                        if isinstance(mask, torch.Tensor) and mask.shape[-1] == consumed:
                            kwargs["attention_mask"] = mask[..., :keep]
                        if "hidden_states" in kwargs:
                            kwargs["hidden_states"] = hidden[:, :keep]
                        else:
                            args = (hidden[:, :keep],) + tuple(args[1:])
                        mixer(*args, **kwargs)
                finally:
                    self._replaying = False
            else:
                self._replaying = True
                try:
                    self.target(input_ids=block_ids[:, :keep], position_ids=block_positions[:, :keep],
                                use_cache=True, logits_to_keep=1, **cache_kwargs(self.target, self.cache))
                finally:
                    self._replaying = False
        self.length += keep
        self.trim()
