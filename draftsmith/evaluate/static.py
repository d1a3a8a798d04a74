"""Batch-1 target forwards on a static KV cache, replayed as CUDA graphs: the evaluate stage's fast path.

Speculative decoding at batch size 1 is latency-bound: a small target's forward is a few hundred short kernels,
and launching them one by one from Python (plus a growing ``DynamicCache``) makes each forward launch-bound
(docs/measurements.md). Here the target's K/V live in a transformers ``StaticCache`` sized for the longest
prompt + answer of the run; every forward of one fixed width (1 token for target-only decoding, the verify width
B for speculative decoding: shorter blocks are padded at the end) is captured once as a CUDA graph and replayed.
The cache "length" is the ``cumulative_length`` counter of each ``StaticLayer``: a forward writes its K/V at that
index, so rolling back rejected drafts is setting the counter to the committed length (attention keys past a
query's position are masked by ``position_ids``, so stale entries beyond it are never seen). Padded positions
after the real block tokens cannot change the real positions' logits (causal attention).

Hybrid targets (Gated DeltaNet + full attention: Qwen3.5, Qwen3-Next) qualify too (:func:`static_decoding_supported`):
their conv and recurrent states live in the same ``StaticCache`` at fixed addresses, and a counter cannot roll
them back, so the snapshot / replay rollback of :class:`draftsmith.evaluate.cache.TargetCache` is done in fixed
buffers: a forward wider than one token first copies every recurrent layer's conv and recurrent state to a
snapshot buffer and records each Gated DeltaNet mixer's input (``[1, width, H]``, a forward pre-hook); when fewer
than all of its ``width`` tokens are committed (rejected drafts, or the padding of a short block), :meth:`StaticTarget
.commit` copies the snapshot back and re-runs the kept tokens' recorded inputs through the mixers only (one
captured graph per kept count). The cost over the attention-only path is the state copy per forward (~150 MB at a
27B target's 48 Gated DeltaNet layers) and the mixers' re-run of the kept tokens. Sliding-window layers keep ring
buffers that a counter cannot roll back: those targets, and the CPU by default, use the dynamic path. Greedy
outputs equal the dynamic path's (tested on the CPU without graphs in float32, and on a GPU with graphs and
flash-linear-attention's kernels: ``tests/test_evaluate.py -k gpu_kernels``; a 27B-shape hybrid in float32
decoded lossless at every forced τ, faster target-only than on the dynamic cache: docs/measurements.md).

A forward that cannot be captured runs eagerly (logged once per width; ``graph_failures``), still on the static
cache. Mixture-of-experts targets (Qwen3-Next) capture with transformers' ``grouped_mm`` experts in bf16 and with
``batched_mm``; the ``eager`` experts loop syncs on ``nonzero()`` and ``grouped_mm`` in float32 copies to the host,
so those run their forwards eagerly (``model.set_experts_implementation("batched_mm")`` avoids it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.gpu import capture_graph
from draftsmith.hybrid_cache import (
    cache_kwargs,
    hidden_states_arg,
    is_recurrent,
    mixer_cache_arg,
    mixer_of,
    recurrent_layers,
    recurrent_states,
    restore,
    static_supported,
)
from draftsmith.target import LayerCapture, decoder_layers, is_hybrid, text_config

log = logging.getLogger("draftsmith.evaluate")


def static_decoding_supported(target: nn.Module) -> tuple[bool, str]:
    """``(ok, why not)``: whether :class:`StaticTarget` can decode ``target``: attention-only targets without
    sliding windows (:func:`draftsmith.hybrid_cache.static_supported`), and hybrid targets whose layers are all full
    attention or Gated DeltaNet (``linear_attention``) with a locatable recurrent mixer (the child module whose
    forward takes the cache), whose state is rolled back by snapshot and replay."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    ok, why = static_supported(target)
    if ok or not is_hybrid(target.config):
        return ok, why
    types = set(getattr(text_config(target.config), "layer_types", None) or [])
    if not types <= {"full_attention", "linear_attention"}:
        return False, f"hybrid layer types {sorted(types)}: only full_attention and linear_attention are supported"
    cache = StaticCache(config=target.config, max_cache_len=8)  # layer objects only: tensors are allocated lazily
    layers = decoder_layers(target)
    for i, layer in enumerate(cache.layers):
        if is_recurrent(layer):
            if isinstance(layer, StaticLayer):
                return False, f"cache layer {i} holds both K/V and recurrent state"
            if i >= len(layers) or mixer_of(layers[i]) is None:
                return False, f"the recurrent mixer of decoder layer {i} cannot be located"
    return True, ""


class StaticTarget:
    """A target plus a static KV cache for batch-1 decoding, with CUDA-graph replay of fixed-width forwards.

    Use per prompt: :meth:`prefill`, then :meth:`forward_block` and :meth:`commit` with the count of its tokens
    that are kept (a no-op for attention-only targets: the next forward sets the length counter).

    Args:
        target: Hugging Face causal LM (eval mode) passing :func:`static_decoding_supported`.
        max_length: cache capacity in tokens (longest prompt + new tokens + verify width).
        layer_ids: tapped target layers whose features forwards return (DFlash's taps, plus the last layer for an
            MTP head: each proposer takes its own columns); ``[]`` for none.
        cuda_graphs: capture and replay each forward width as a CUDA graph (CUDA only).
        verify_width: the width every speculative verify forward is padded to (all proposers share it, so their
            forwards run the same kernels; ``forward_block`` with ``width=None``). Hybrid targets: the widest
            forward (the recorded mixer inputs are that wide); default 1.

    Raises:
        ValueError: a target that :func:`static_decoding_supported` refuses.
    """

    def __init__(self, target: nn.Module, max_length: int, *, layer_ids: list[int] | None = None,
                 cuda_graphs: bool = True, verify_width: int | None = None):
        from transformers import StaticCache

        ok, why = static_decoding_supported(target)
        if not ok:
            raise ValueError(f"static-cache decoding does not support {type(target).__name__}: {why}")
        self.target = target
        self.device = next(target.parameters()).device
        self.max_length = int(max_length)
        self.cache = StaticCache(config=target.config, max_cache_len=self.max_length)
        self.capture = LayerCapture(target, list(layer_ids)) if layer_ids else None
        #: the tapped layers, in the order of the features' columns
        self.layer_ids = list(layer_ids or [])
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.verify_width = verify_width
        self._graphs: dict[int, tuple] = {}
        self.graph_failures: dict[int, str] = {}
        # hybrid targets: Gated DeltaNet layers, their mixers, the mixers' recorded inputs and the state snapshot
        self.recurrent = recurrent_layers(self.cache)
        self.mixers: dict[int, nn.Module] = {}
        self._width = None  # width of the last forward_block, until commit
        self._recording = False
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (live state, snapshot buffer)
        self._replays: dict[int, torch.cuda.CUDAGraph] = {}  # kept tokens -> captured rollback
        if self.recurrent:
            layers = decoder_layers(target)
            self.mixers = {i: mixer_of(layers[i]) for i in self.recurrent}
            self.max_width = max(1, int(verify_width or 1))
            dtype = target.get_input_embeddings().weight.dtype
            hidden = int(text_config(target.config).hidden_size)
            self._inputs = {i: torch.zeros((1, self.max_width, hidden), dtype=dtype, device=self.device)
                            for i in self.recurrent}
            self._cache_arg = {i: mixer_cache_arg(m) for i, m in self.mixers.items()}
            for i, mixer in self.mixers.items():
                mixer.register_forward_pre_hook(self._recorder(i), with_kwargs=True)

    # -- hybrid targets: recording, snapshot, rollback -------------------------------------------------------
    def _recorder(self, idx: int):
        def hook(module, args, kwargs):
            if self._recording:
                hidden = hidden_states_arg(args, kwargs)
                self._inputs[idx][:, :hidden.shape[1]].copy_(hidden)
        return hook

    def _snapshot(self) -> None:
        for live, snap in self._saved:
            snap.copy_(live)

    def _replay(self, keep: int) -> None:
        """Put the snapshot back and re-run the ``keep`` first recorded tokens through the recurrent mixers."""
        restore(self._saved)
        for i, mixer in self.mixers.items():
            mixer(hidden_states=self._inputs[i][:, :keep], attention_mask=None, **{self._cache_arg[i]: self.cache})

    @torch.inference_mode()
    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the last :meth:`forward_block` (its real tokens and padding counted
        by its width). Attention-only targets: nothing to do. Hybrid targets: when ``keep`` is less than the
        forward's width, the recurrent state goes back to the snapshot taken before it and the kept tokens are
        re-run through the Gated DeltaNet mixers (a captured graph per ``keep`` on CUDA).

        Raises:
            ValueError: ``keep`` outside ``1..width`` of the last forward.
        """
        width, self._width = self._width, None
        if not self.recurrent or width is None or keep == width:
            return
        if not 1 <= keep <= width:
            raise ValueError(f"cannot keep {keep} of a {width}-token forward")
        if self.cuda_graphs and -keep not in self.graph_failures:
            graph = self._replays.get(keep) or self._capture_replay(keep)
            if graph is not None:
                graph.replay()
                return
        self._replay(keep)

    def _capture_replay(self, keep: int):
        """Capture the rollback to ``keep`` tokens (idempotent: it starts from the snapshot, so the warm-ups leave
        the very state the replay makes). Failures are logged once and that count rolls back eagerly."""
        captured = capture_graph(self.device, lambda: self._replay(keep), self.graph_failures, -keep,
                                 f"the rollback to {keep} tokens", logger=log)
        if captured is not None:
            self._replays[keep] = captured[0]
        return self._replays.get(keep)

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
        if self.recurrent:  # per layer type: the attention layers' mask; no padding for the Gated DeltaNet layers
            mask = {"full_attention": mask, "linear_attention": None}
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
        self._width = None
        for i in self.recurrent:
            self.cache.layers[i].reset()  # zero conv / recurrent states: the next forward is a prefill
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        with self._hooks():
            logits, feats = self._forward(ids, positions, logits_to_keep=1)
        if self.recurrent and self._saved is None:  # the states exist now (allocated by the first forward)
            self._saved = [(t, torch.empty_like(t)) for t in recurrent_states(self.cache)]
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
        if self.recurrent:
            if width > self.max_width:
                raise ValueError(f"a {width}-token forward is wider than this hybrid target's widest "
                                 f"({self.max_width}: verify_width)")
            if self._width is not None:
                raise RuntimeError("forward_block before commit() of the last one: the recurrent state would hold "
                                   "its uncommitted tokens")
            if self._saved is None:
                raise RuntimeError("forward_block before prefill()")
            self._width = width
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
            logits, feats = self._block(ids, positions)
        return logits[0, :k], (feats[:, :k] if feats is not None else None)

    def _block(self, ids: torch.Tensor, positions: torch.Tensor):
        """A forward of ``ids [1, w]``; hybrid targets with ``w > 1``: after the state snapshot, recording the
        mixers' inputs (both captured with the forward when it is a graph)."""
        if not self.recurrent or ids.shape[1] == 1:  # a one-token forward is always kept whole
            return self._forward(ids, positions)
        self._snapshot()
        self._recording = True
        try:
            return self._forward(ids, positions)
        finally:
            self._recording = False

    # -- CUDA graphs -----------------------------------------------------------------------------
    def _hooks(self):
        import contextlib

        return self.capture if self.capture is not None else contextlib.nullcontext()

    def _capture(self, width: int, start: int):
        """Capture the width-``width`` forward as a CUDA graph (:func:`capture_graph`). Before each warm-up and the
        capture the cache length goes back to ``start`` and a hybrid target's recurrent state to what it was (the
        warm-ups advance it; attention K/V past the counter are invisible and overwritten by the real forward).
        On failure the width runs eagerly from then on (logged once)."""
        ids_buf = torch.zeros((1, width), dtype=torch.long, device=self.device)
        pos_buf = torch.arange(start, start + width, device=self.device)[None].clone()
        saved = [(t, t.clone()) for t in recurrent_states(self.cache)]

        def reset() -> None:
            self.set_length(start)
            restore(saved)

        def run():
            with self._hooks():
                return self._block(ids_buf, pos_buf)

        captured = capture_graph(self.device, run, self.graph_failures, width,
                                 f"the {width}-token target forward", reset, logger=log)
        if captured is None:
            return None
        graph, (logits, feats) = captured
        self._graphs[width] = (graph, ids_buf, pos_buf, logits, feats)
        log.info("captured the %d-token target forward as a CUDA graph", width)
        return self._graphs[width]


class StaticDrafter:
    """The DFlash or DFlash2 drafter's context K/V in fixed buffers, each drafting step of one width replayed as a
    CUDA graph.

    A drafting step (:meth:`draftsmith.evaluate.decode.DFlashProposer.propose`) feeds the target features of the
    positions committed since the last step (``n <= B`` of them; the prompt's in chunks of ``B``) and a block
    ``[anchor, mask x (w - 1)]`` at ``start..start+w-1``. Eagerly that is a few hundred short kernels plus a
    growing ``DynamicCache``, launch-bound: on a GPU it took longer than the target's verify forward
    (docs/measurements.md). Here every layer's K/V live in buffers of ``max_length + 2B`` positions: the new
    context rows are written at ``c0..c0+B-1`` (rows past the real ``n`` are padding), then the block's at
    ``start..start+w-1`` (over the padding), and the block's queries see keys ``< start + w`` only. Stale entries
    past that are never visible: the next step's context rows overwrite them before they could be. Same keys,
    values and positions as the dynamic path, so the same drafts (tested in float32 on the CPU without graphs).

    Draftsmith's :class:`~draftsmith.modeling.DFlashDraftModel` and
    :class:`~draftsmith.modeling_dflash2.DFlash2DraftModel` with full (non-causal, non-sliding) layers qualify
    (:meth:`supported`); other drafters (the official package's models) draft on the dynamic path. A DFlash2
    drafter's step also returns the hidden states its candidate selector rescores with (:meth:`step`); greedy, its
    selector's path is part of the captured step (:meth:`greedy_path`): eagerly the path is ~6 short kernels per
    block slot, 0.40 of a 1.82 ms step on an H200 at the gpu-proof shapes (``bench/bench_draft_step.py``,
    docs/dflash2/README.md).

    Args:
        drafter: the drafter (eval mode, on its device and dtype).
        embed_weight: the target's input embedding ``[V, H]``; head: the target's LM head (module or weight).
        max_length: positions the context can reach (the target's static cache length).
        embed_scale: ``input_embedding_scale`` of the drafter config.
        cuda_graphs: capture each width's step as a CUDA graph (CUDA only).
    """

    def __init__(self, drafter: nn.Module, embed_weight: torch.Tensor, head, max_length: int, *,
                 embed_scale: float = 1.0, cuda_graphs: bool = True):
        ok, why = self.supported(drafter)
        if not ok:
            raise ValueError(f"static drafting does not support this drafter: {why}")
        self.drafter, self.embed_weight, self.head, self.embed_scale = drafter, embed_weight, head, embed_scale
        self.block_size = int(drafter.block_size)
        self.mask_token_id = int(drafter.mask_token_id)
        self.device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        cfg = drafter.config
        attn = drafter.layers[0].self_attn
        self.max_length = int(max_length)
        # room for a step's padded context rows; a multiple of 16 keys (SDPA's memory-efficient kernel pads masks
        # whose last dimension is not aligned)
        self.length = -(-(self.max_length + 2 * self.block_size) // 16) * 16
        shape = (1, attn.num_kv_heads, self.length, attn.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        width = len(drafter.target_layer_ids) * cfg.hidden_size
        self.ctx_buf = torch.zeros((1, self.block_size, width), dtype=self.dtype, device=self.device)
        self.c0_buf = torch.zeros(1, dtype=torch.long, device=self.device)
        self.start_buf = torch.zeros(1, dtype=torch.long, device=self.device)
        self.anchor_buf = torch.zeros(1, dtype=torch.long, device=self.device)
        #: DFlash2: the candidate selector whose greedy path :meth:`greedy_path` drafts in the captured step
        self.selector = getattr(drafter, "candidate_selector", None)
        self._graphs: dict[tuple[int, bool], tuple] = {}
        self.graph_failures: dict[tuple[int, bool], str] = {}

    @staticmethod
    def supported(drafter: nn.Module) -> tuple[bool, str]:
        """``(True, "")`` for draftsmith's ``DFlashDraftModel`` or ``DFlash2DraftModel`` whose layers all attend
        fully, else the reason."""
        from draftsmith.modeling import DFlashDecoderLayer, DFlashDraftModel
        from draftsmith.modeling_dflash2 import DFlash2DecoderLayer, DFlash2DraftModel

        if not isinstance(drafter, DFlashDraftModel):
            return False, f"{type(drafter).__module__}.{type(drafter).__name__} is not draftsmith's DFlashDraftModel"
        for name in ("forward", "compute_logits"):  # the static step runs the layers itself
            if getattr(type(drafter), name) is not getattr(DFlashDraftModel, name):
                return False, f"{type(drafter).__name__} overrides {name}"
        two = isinstance(drafter, DFlash2DraftModel)
        if hasattr(drafter, "candidate_selector") and not two:
            return False, f"{type(drafter).__name__} has a candidate selector but is not draftsmith's DFlash2DraftModel"
        layer_class = DFlash2DecoderLayer if two else DFlashDecoderLayer
        for i, layer in enumerate(drafter.layers):
            if type(layer) is not layer_class:
                return False, f"drafter layer {i} is a {type(layer).__name__}, not a {layer_class.__name__}"
            if layer.self_attn.is_causal or layer.self_attn.sliding_window is not None:
                return False, f"drafter layer {i} is causal or sliding-window"
        if drafter.mask_token_id is None:
            return False, "the drafter config has no mask_token_id"
        return True, ""

    # -- one step, from the buffers ----------------------------------------------------------------------------
    def _step(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states ``[1, width - 1, H]`` (after the final norm) and logits ``[width - 1, V]`` of the block's
        slots 1..width-1 at ``start_buf``, after writing the context rows at ``c0_buf``. A DFlash2 layer's
        convolution pairs (:class:`~draftsmith.modeling_dflash2.GroupedDynamicCausalConv`) run over the block's
        ``width`` tokens, as its forward does on one block."""
        from draftsmith.modeling import apply_rotary

        d, B = self.drafter, self.block_size
        ctx_pos = self.c0_buf + torch.arange(B, device=self.device)
        blk_pos = self.start_buf + torch.arange(width, device=self.device)
        positions = torch.cat([ctx_pos, blk_pos])[None]
        block = torch.cat([self.anchor_buf, torch.full((width - 1,), self.mask_token_id, dtype=torch.long,
                                                       device=self.device)])
        hidden = (F.embedding(block[None], self.embed_weight) * self.embed_scale).to(self.dtype)
        ctx = d.hidden_norm(d.fc(self.ctx_buf))
        cos, sin = d.rotary_emb(hidden, positions)
        visible = torch.arange(self.length, device=self.device) < self.start_buf + width
        mask = torch.zeros(self.length, dtype=self.dtype, device=self.device).masked_fill_(
            ~visible, torch.finfo(self.dtype).min)[None, None, None, :]
        for layer, kbuf, vbuf in zip(d.layers, self.keys, self.values):
            attn = layer.self_attn
            attention_conv, mlp_conv = getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)
            x = layer.input_layernorm(hidden)
            if attention_conv is not None:
                x, kernel = attention_conv.prepare(x)
            q = attn.q_norm(attn.q_proj(x).view(1, width, -1, attn.head_dim)).transpose(1, 2)
            k = torch.cat([attn.k_proj(ctx), attn.k_proj(x)], dim=1)
            v = torch.cat([attn.v_proj(ctx), attn.v_proj(x)], dim=1)
            k = attn.k_norm(k.view(1, B + width, -1, attn.head_dim)).transpose(1, 2)
            v = v.view(1, B + width, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, k, cos, sin)
            kbuf.index_copy_(2, ctx_pos, k[:, :, :B].to(self.dtype))  # context rows (padding past n) ...
            vbuf.index_copy_(2, ctx_pos, v[:, :, :B])
            kbuf.index_copy_(2, blk_pos, k[:, :, B:].to(self.dtype))  # ... then the block over the padding
            vbuf.index_copy_(2, blk_pos, v[:, :, B:])
            keys, values = kbuf, vbuf
            if attn.num_heads != attn.num_kv_heads:
                groups = attn.num_heads // attn.num_kv_heads
                keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q.to(self.dtype), keys, values, attn_mask=mask, scale=attn.scaling)
            out = attn.o_proj(out.transpose(1, 2).reshape(1, width, -1))
            hidden = hidden + (out if attention_conv is None else attention_conv.finish(out, kernel))
            x = layer.post_attention_layernorm(hidden)
            if mlp_conv is None:
                hidden = hidden + layer.mlp(x)
            else:
                x, kernel = mlp_conv.prepare(x)
                hidden = hidden + mlp_conv.finish(layer.mlp(x), kernel)
        hidden = d.norm(hidden)[:, 1:]
        return hidden, d.compute_logits(hidden, self.head)[0]

    def _step_path(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_step` and then the candidate selector's greedy path ``[1, width - 1]`` int64 after
        ``anchor_buf`` (:meth:`~draftsmith.modeling_dflash2.CandidateSelector.select`, temperature 0)."""
        hidden, logits = self._step(width)
        path = self.selector.select(hidden, logits[None], self.anchor_buf, 0.0)[0]
        return hidden, logits, path

    def _run(self, width: int, path: bool = False) -> tuple[torch.Tensor, ...]:
        key = (width, path)
        if self.cuda_graphs and key not in self.graph_failures:
            graph = self._graphs.get(key) or self._capture(width, path)
            if graph is not None:
                graph[0].replay()
                return graph[1]
        return self._step_path(width) if path else self._step(width)

    def _capture(self, width: int, path: bool):
        """Capture the width-``width`` step, with the selector's greedy path when ``path`` (:func:`capture_graph`;
        the warm-ups write the same K/V the real step writes). On failure that step runs eagerly from then on
        (logged once)."""
        run = (lambda: self._step_path(width)) if path else (lambda: self._step(width))
        what = f"the {width}-token drafting step" + (" with the selector's greedy path" if path else "")
        captured = capture_graph(self.device, run, self.graph_failures, (width, path), what, logger=log)
        if captured is None:
            return None
        self._graphs[(width, path)] = captured
        return captured

    # -- the proposer's call ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, context: torch.Tensor, anchor: torch.Tensor, start: int, width: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft hidden states ``[1, width - 1, H]`` and logits ``[width - 1, V]`` for the block
        ``[anchor, mask x (width - 1)]`` at ``start``, after the context features ``context [1, n, n_taps * H]`` of
        positions ``start - n .. start - 1`` (those committed since the last step, or the whole prompt at the
        first). The returned tensors are overwritten by the next step: copy what must outlive it.

        Raises:
            ValueError: a block past the buffers or wider than the block size.
        """
        return self._chunks(context, anchor, start, width, path=False)

    @torch.inference_mode()
    def greedy_path(self, context: torch.Tensor, anchor: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """DFlash2, greedy: the candidate selector's path ``[1, width - 1]`` int64 through the top-k of the step
        :meth:`step` drafts (the same tokens as ``candidate_selector.select(*step(...), anchor, 0.0)``), drafted
        inside the step's CUDA graph. The returned tensor is overwritten by the next step.

        Raises:
            ValueError: the drafter has no candidate selector; or as :meth:`step`.
        """
        if self.selector is None:
            raise ValueError(f"{type(self.drafter).__name__} has no candidate selector: it drafts by argmax")
        return self._chunks(context, anchor, start, width, path=True)[2]

    def _chunks(self, context: torch.Tensor, anchor: torch.Tensor, start: int, width: int, path: bool):
        """:meth:`step`'s work: the context in chunks of ``B``, the selector's path (``path``) on the last."""
        if not 2 <= width <= self.block_size:
            raise ValueError(f"drafting width {width} is outside 2..{self.block_size}")
        if start + width > self.max_length:
            raise ValueError(f"block end {start + width} exceeds the drafter's static buffers "
                             f"({self.max_length} positions)")
        n, B = context.shape[1], self.block_size
        self.anchor_buf.copy_(anchor.reshape(1))
        for c in range(0, n, B):  # the prompt arrives in chunks of B; later steps bring <= B rows
            rows = min(B, n - c)
            self.ctx_buf[:, :rows] = context[:, c:c + rows].to(self.dtype)
            self.c0_buf.fill_(start - n + c)
            self.start_buf.fill_(start - n + c + rows)  # < start: a block that the next chunk overwrites
            out = self._run(width, path and c + rows == n)
        return out

    def logits(self, context: torch.Tensor, anchor: torch.Tensor, start: int, width: int) -> torch.Tensor:
        """The draft logits ``[width - 1, V]`` of :meth:`step`."""
        return self.step(context, anchor, start, width)[1]
