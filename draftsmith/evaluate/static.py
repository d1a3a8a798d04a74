"""Batch-1 target forwards on a static KV cache, replayed as CUDA graphs: the evaluate stage's fast path.

Speculative decoding at batch size 1 is latency-bound: a small target's forward is a few hundred short kernels,
and launching them one by one from Python (plus a growing ``DynamicCache``) cost ~25 ms per forward on an H200
for a 135M-parameter target. Here the target's K/V live in a transformers ``StaticCache`` sized for the longest
prompt + answer of the run; every forward of one fixed width (1 token for target-only decoding, the verify width
B for speculative decoding: shorter blocks are padded at the end) is captured once as a CUDA graph and replayed.
The cache "length" is the ``cumulative_length`` counter of each ``StaticLayer``: a forward writes its K/V at that
index, so rolling back rejected drafts is setting the counter to the committed length (attention keys past a
query's position are masked by ``position_ids``, so stale entries beyond it are never seen). Padded positions
after the real block tokens cannot change the real positions' logits (causal attention).

Only attention-only targets whose cache layers are all ``StaticLayer`` qualify (:func:`static_supported`):
recurrent (Gated DeltaNet) layers need the snapshot / replay rollback of :class:`draftsmith.evaluate.cache
.TargetCache`, and sliding-window layers keep ring buffers that a counter cannot roll back. Those targets, and
the CPU, use the dynamic path. Greedy outputs equal the dynamic path's (tested on CPU without graphs; the CUDA
graph replay computes the same kernels as the eager forward it captured).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from draftsmith.target import LayerCapture, cache_kwargs, static_supported  # noqa: F401 - re-exported

log = logging.getLogger("draftsmith.evaluate")


class StaticTarget:
    """A target plus a static KV cache for batch-1 decoding, with CUDA-graph replay of fixed-width forwards.

    Args:
        target: Hugging Face causal LM (eval mode) passing :func:`static_supported`.
        max_length: cache capacity in tokens (longest prompt + new tokens + verify width).
        layer_ids: tapped target layers whose features forwards return (DFlash); ``[]`` for none.
        cuda_graphs: capture and replay each forward width as a CUDA graph (CUDA only).
        verify_width: the width every speculative verify forward is padded to (all proposers share it, so their
            forwards run the same kernels; ``forward_block`` with ``width=None``).

    Raises:
        ValueError: a target that :func:`static_supported` refuses.
    """

    def __init__(self, target: nn.Module, max_length: int, *, layer_ids: list[int] | None = None,
                 cuda_graphs: bool = True, verify_width: int | None = None):
        from transformers import StaticCache

        ok, why = static_supported(target)
        if not ok:
            raise ValueError(f"static-cache decoding does not support {type(target).__name__}: {why}")
        self.target = target
        self.device = next(target.parameters()).device
        self.max_length = int(max_length)
        self.cache = StaticCache(config=target.config, max_cache_len=self.max_length)
        self.capture = LayerCapture(target, list(layer_ids)) if layer_ids else None
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.verify_width = verify_width
        self._graphs: dict[int, tuple] = {}
        self.graph_failures: dict[int, str] = {}

    # -- cache length ----------------------------------------------------------------------------
    def _layers(self):
        return self.cache.layers

    def set_length(self, length: int) -> None:
        """Make the cache hold the first ``length`` positions (later entries become stale and invisible)."""
        for layer in self._layers():
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)

    # -- forwards --------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0):
        # An explicit additive [1, 1, q, max_length] mask (key index <= query position): transformers then uses it
        # as is, instead of deriving one from the cache length with host-side checks that a graph cannot capture.
        dtype = self.target.get_input_embeddings().weight.dtype
        hidden = torch.arange(self.max_length, device=self.device)[None, None, None, :] > positions[:, None, :, None]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=self.device).masked_fill_(hidden, torch.finfo(dtype).min)
        out = self.target(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                          logits_to_keep=logits_to_keep, **cache_kwargs(self.target, self.cache))
        feats = self.capture.features() if self.capture is not None else None
        return out.logits, feats

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start a prompt: ``ids [1, P]`` at positions ``0..P-1`` (eager). Returns the last position's logits
        ``[V]`` and the prompt's features ``[1, P, n*H]`` (None without layer ids)."""
        if ids.shape[1] >= self.max_length:
            raise ValueError(f"prompt of {ids.shape[1]} tokens does not fit the static cache ({self.max_length})")
        self.set_length(0)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with self._hooks():
            logits, feats = self._forward(ids, positions, logits_to_keep=1)
        return logits[0, -1], feats

    @torch.inference_mode()
    def forward_block(self, tokens: torch.Tensor, start: int, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``tokens [1, k]`` at positions ``start..start+k-1`` on a cache holding ``start`` positions.

        The block is padded to ``width`` (one captured graph per width). Returns logits ``[k, V]`` and features
        ``[1, k, n*H]`` (None without layer ids) of the real tokens; their K/V are in the cache afterwards (and
        ``width - k`` stale padded entries past them, overwritten by later forwards).
        """
        k = tokens.shape[1]
        width = width or self.verify_width or k
        if k > width:
            raise ValueError(f"block of {k} tokens is wider than the forward width {width}")
        if start + width > self.max_length:
            raise ValueError(f"positions up to {start + width} exceed the static cache ({self.max_length})")
        self.set_length(start)
        if self.cuda_graphs and width not in self.graph_failures:
            graph = self._graphs.get(width) or self._capture(width, start)
            if graph is not None:
                g, ids_buf, pos_buf, logits, feats = graph
                ids_buf.zero_()
                ids_buf[:, :k] = tokens
                torch.arange(start, start + width, out=pos_buf[0])
                g.replay()
                return logits[0, :k], (feats[:, :k] if feats is not None else None)
        ids = torch.zeros((1, width), dtype=torch.long, device=self.device)
        ids[:, :k] = tokens
        positions = torch.arange(start, start + width, device=self.device)[None]
        with self._hooks():
            logits, feats = self._forward(ids, positions)
        return logits[0, :k], (feats[:, :k] if feats is not None else None)

    # -- CUDA graphs -----------------------------------------------------------------------------
    def _hooks(self):
        import contextlib

        return self.capture if self.capture is not None else contextlib.nullcontext()

    def _capture(self, width: int, start: int):
        """Capture the width-``width`` forward as a CUDA graph (after two warm-up runs on a side stream, as
        ``torch.cuda.graphs`` requires). The warm-ups write K/V at positions ``start..``, which the real forward
        overwrites. On failure the width runs eagerly from then on (logged once)."""
        ids_buf = torch.zeros((1, width), dtype=torch.long, device=self.device)
        pos_buf = torch.arange(start, start + width, device=self.device)[None].clone()
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), self._hooks():
                for _ in range(2):
                    self.set_length(start)
                    self._forward(ids_buf, pos_buf)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.set_length(start)
            with self._hooks(), torch.cuda.graph(graph):
                logits, feats = self._forward(ids_buf, pos_buf)
        except Exception as exc:  # noqa: BLE001 - a target whose forward cannot be captured runs eagerly
            self.graph_failures[width] = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture of the %d-token target forward failed (%s): it runs eagerly",
                        width, self.graph_failures[width])
            torch.cuda.synchronize(self.device)
            return None
        self._graphs[width] = (graph, ids_buf, pos_buf, logits, feats)
        log.info("captured the %d-token target forward as a CUDA graph", width)
        return self._graphs[width]
