"""Regenerate's static-cache engine: batched decoding on a transformers ``StaticCache``, each decode step a
replayed CUDA graph, batches fitted to a memory budget.

Holds :class:`StaticBatchEngine`, the targets it runs (:func:`static_engine_supported`), what engine ``auto``
means (:func:`resolve_engine`) and its memory plan: the bytes a batch row takes in the cache
(:func:`cache_bytes_per_row`) and the prefill's workspace (:func:`prefill_workspace_bytes`). What the cache holds
is :mod:`draftsmith.hybrid_cache`'s to know.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import torch

from draftsmith import hybrid_cache
from draftsmith.gpu import capture_graph
from draftsmith.regenerate.engines import Engine
from draftsmith.target import is_hybrid, text_config, use_grouped_sdpa, without_cudnn_attention

log = logging.getLogger("draftsmith.regenerate")


def static_engine_supported(model) -> tuple[bool, str]:
    """``(ok, why not)``: whether :class:`StaticBatchEngine` can decode ``model``: attention-only targets
    (:func:`draftsmith.hybrid_cache.static_supported`), and hybrid targets whose layers are full attention and Gated
    DeltaNet (``linear_attention``): greedy generation never rolls back, so the recurrent layers' fixed-size
    states (transformers' ``StaticCache`` keeps them at static addresses) serve a CUDA-graph decode step as well.
    Sliding-window layers are not supported."""
    ok, why = hybrid_cache.static_supported(model)
    if ok:
        return ok, why
    cfg = text_config(model.config)
    types = set(getattr(cfg, "layer_types", None) or [])
    if is_hybrid(model.config) and types <= {"full_attention", "linear_attention"}:
        return True, ""
    return False, why


def resolve_engine(name: str, model) -> str:
    """The engine ``auto`` means for ``model``: ``static`` (static KV cache, CUDA-graph decode steps) on a CUDA
    device for the targets it supports (:func:`static_engine_supported`: attention-only and Gated DeltaNet
    hybrids); HF ``generate`` otherwise (the CPU, where graphs do not exist, and sliding-window targets).
    ``continuous`` (transformers' continuous batching) is never chosen automatically: it gained little over
    ``generate`` on the same prompts (bench/bench_regenerate.py) and does not run linear-attention layers."""
    if name != "auto":
        return name
    device = next(model.parameters()).device
    return "static" if device.type == "cuda" and static_engine_supported(model)[0] else "generate"


def cache_bytes_per_row(config, length: int, dtype: torch.dtype) -> int:
    """Bytes that one batch row takes in transformers' ``StaticCache(config, max_cache_len=length)`` once a
    prefill has filled it, for a target computing in ``dtype`` (the dtype of its weights and activations).

    Per decoder layer (transformers 5.17 - 5.24, ``cache_utils`` and the ``qwen3_5`` / ``qwen3_next`` modeling):

    * ``full_attention``: keys and values ``[rows, num_key_value_heads, length, head_dim]`` in ``dtype``:
      ``2 x num_key_value_heads x head_dim x length x dtype.itemsize`` bytes per row.
    * ``sliding_attention`` / ``chunked_attention``: the same with ``min(length, sliding_window)`` (or
      ``attention_chunk_size``) positions (``StaticSlidingWindowLayer``).
    * ``linear_attention`` (Gated DeltaNet): the conv state ``[rows, conv_dim, linear_conv_kernel_dim]`` in
      ``dtype``, ``conv_dim = 2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x
      linear_value_head_dim`` (the mixed q / k / v projection), and the recurrent state ``[rows,
      linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]`` in float32 (both the torch fallback
      and flash-linear-attention's kernels return the final state in float32, and the cache allocates it like the
      first state it stores).
    * MLP-only or reused-KV layers (``dummy``): nothing.

    The per-layer length counters (0-d tensors, not per row) are left out. ``head_dim`` defaults to
    ``hidden_size / num_attention_heads`` and ``num_key_value_heads`` to ``num_attention_heads``, as in the models.
    E.g. the Qwen3.5-27B shape in bf16 at 3,328 positions: 48 Gated DeltaNet layers x (80 KiB conv + 3 MiB
    recurrent state) + 16 attention layers x 13 MiB of K/V (4 heads x 256) = 355.75 MiB per row, 22.2 GiB for 64.

    Args:
        config: the target's config (multimodal configs: their text config is used, as ``StaticCache`` does).
        length: cache positions (``max_cache_len``).
        dtype: the target's compute dtype.

    Returns:
        Bytes per batch row (an int; a batch of ``rows`` holds exactly ``rows x`` this).

    Raises:
        ValueError: a layer type the estimate does not know (e.g. ``conv``, ``indexed_attention``, ``hybrid``), or a
            linear-attention layer without Gated DeltaNet's ``linear_*`` sizes in the config.
    """
    cfg = config.get_text_config(decoder=True)
    elt = torch.empty((), dtype=dtype).element_size()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_per_position = 2 * kv_heads * head_dim * elt
    total = 0
    for kind in hybrid_cache.layer_types(cfg):
        if kind == "full_attention":
            total += kv_per_position * length
        elif kind in ("sliding_attention", "chunked_attention"):
            window = cfg.sliding_window if kind == "sliding_attention" else cfg.attention_chunk_size
            total += kv_per_position * min(length, window)
        elif kind == "linear_attention":
            try:
                nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
                dk, dv, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
            except AttributeError as exc:
                raise ValueError(f"{cfg.model_type}: linear_attention layers without Gated DeltaNet sizes "
                                 f"({exc}): their cache size is unknown") from None
            total += (2 * nk * dk + nv * dv) * kernel * elt + nv * dk * dv * 4
        elif kind != "dummy":
            raise ValueError(f"{cfg.model_type}: cache size of {kind!r} layers is unknown (known: full_attention, "
                             "sliding_attention, chunked_attention, linear_attention)")
    return total


#: The prefill workspace estimate (:func:`prefill_workspace_bytes`), per prefill token: elements of the compute
#: dtype per hidden-size and per intermediate-size unit, and float32 copies of Gated DeltaNet's q / k / v.
WORKSPACE_HIDDEN_COPIES = 8
WORKSPACE_INTERMEDIATE_COPIES = 4
WORKSPACE_LINEAR_COPIES = 1


def prefill_workspace_bytes(config, *, rows: int, width: int, length: int, prefill_tokens: int,
                            dtype: torch.dtype) -> int:
    """Estimated peak GPU memory, in bytes, that :class:`StaticBatchEngine`'s prefill of one batch needs on top of
    the weights and the static cache: the activations of its largest slice (freed layer by layer) and the logits.

    The largest slice holds ``tokens = rows x min(width, max(1, prefill_tokens // rows))`` tokens (the engine
    prefills ``max(1, prefill_tokens // rows)`` positions of every row at once). Per token, in bytes:

    * ``itemsize x (WORKSPACE_HIDDEN_COPIES x hidden_size + WORKSPACE_INTERMEDIATE_COPIES x intermediate_size)``:
      the residual stream, norms, attention / Gated DeltaNet projections, MLP gate / up / product;
    * with attention layers, the slice's additive mask: ``length x (itemsize x (1 + g) + 3)``: the ``[rows, 1, q,
      length]`` mask, the booleans it is built from and its copy for the ``g = num_attention_heads /
      num_key_value_heads`` query heads per K/V head of :func:`draftsmith.target.grouped_sdpa_attention`;
    * with Gated DeltaNet layers, ``WORKSPACE_LINEAR_COPIES x 4 x linear_num_value_heads x (2 x linear_key_head_dim
      + linear_value_head_dim)``: float32 q / k / v at the value-head count in the chunked kernels.

    Plus the ``[rows, vocab_size]`` float32 logits of one step. An estimate, not a bound, fitted to the measured
    prefill peak of a Qwen3.5-27B-shape target in bf16 (docs/rehearsal-x2/README.md), a little above it.

    Args:
        config: the target's config (multimodal: its text config).
        rows: batch rows.
        width: the longest prompt of the batch, in tokens.
        length: cache positions.
        prefill_tokens: the engine's tokens per prefill slice, over all rows.
        dtype: the target's compute dtype.

    Returns:
        Bytes (int).
    """
    cfg = config.get_text_config(decoder=True)
    elt = torch.empty((), dtype=dtype).element_size()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    types = set(hybrid_cache.layer_types(cfg))
    tokens = rows * min(width, max(1, prefill_tokens // rows))
    per_token = elt * (WORKSPACE_HIDDEN_COPIES * cfg.hidden_size + WORKSPACE_INTERMEDIATE_COPIES * inter)
    if types & {"full_attention", "sliding_attention", "chunked_attention"}:
        per_token += length * (elt * (1 + max(1, heads // kv_heads)) + 3)
    if "linear_attention" in types:
        per_token += WORKSPACE_LINEAR_COPIES * 4 * cfg.linear_num_value_heads * (
            2 * cfg.linear_key_head_dim + cfg.linear_value_head_dim)
    return tokens * per_token + rows * cfg.vocab_size * 4


class StaticBatchEngine(Engine):
    """Batched greedy (or sampled) decoding on a static KV cache, each decode step a replayed CUDA graph.

    Prompts are sorted by length and generated in batches of ``batch_size``, left-padded so that every row's
    prompt ends at the same cache index; the cache holds ``longest prompt + max_new_tokens`` positions (rounded
    up to 128). Each row's keys before its padding are masked out and its positions count from its first real
    token, as HF ``generate`` does with left padding, so the answers are HF generate's (equal in float32, tested;
    bf16 kernels of other shapes can flip near-tied argmaxes). The prefill runs eagerly, in slices of the
    sequence of about ``prefill_tokens`` tokens over all rows (a whole large batch of long prompts at once would
    not fit a GPU's memory); the one-token decode step of a (rows, cache length) shape is captured once as a CUDA
    graph and replayed: a small target's decode step is hundreds of short kernels, launch-bound from Python (HF
    ``generate`` leaves the GPU mostly idle). Rows
    that have stopped keep decoding until every row of the batch has (checked every ``check_every`` steps).
    Hybrid targets (Gated DeltaNet + full attention, :func:`static_engine_supported`): the recurrent layers' conv
    and recurrent states live in the same ``StaticCache`` (fixed size, static addresses), reset for every batch;
    their padding is masked by a 2-D mask (left-padded positions contribute nothing to the state, as with HF
    ``generate``), and the decode-step capture puts the states back after its warm-up and capture forwards.

    Memory: before each batch the rows are lowered (never below 1) so that the memory allocated now (weights, less
    the last batch's cache and decode graph) plus the batch's cache (:func:`cache_bytes_per_row`), prefill workspace
    (:func:`prefill_workspace_bytes`) and captured decode step (:meth:`decode_graph_bytes`: a hybrid target's new
    recurrent states) stay within ``memory_budget_bytes`` (default on a GPU: 90% of its memory;
    the CPU: no cap); the prompts a cut batch leaves go first into the next batch, whose cache length follows its own
    longest prompt. Each new (rows, cache length) is logged with its projection; ``rows_capped_batches`` counts
    the cut batches. (Uncapped, a 27B target's weights, cache and prefill workspace at 64 rows of 3,072-token
    prompts outgrow an 80 GB GPU: docs/rehearsal-x2/README.md.)
    """

    name = "static"

    def __init__(self, model, *, pad_id: int, stop_ids: Sequence[int], batch_size: int, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, cuda_graphs: bool = True, check_every: int = 16,
                 prefill_tokens: int = 32768, memory_budget_bytes: int | None = None):
        ok, why = static_engine_supported(model)
        if not ok:
            raise ValueError(f"regenerate engine static cannot run {type(model).__name__}: {why}")
        self.hybrid = is_hybrid(model.config)
        self.model, self.pad_id, self.batch_size, self.max_new = model, pad_id, batch_size, max_new_tokens
        self.stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.temperature, self.top_p, self.check_every = temperature, top_p, check_every
        self.prefill_tokens = prefill_tokens
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graph = None  # (key, cache, graph, buffers)
        self.graphs_captured = self.graph_failures = 0  # decode-step CUDA graphs captured / fallen back to eager
        if memory_budget_bytes is None and self.device.type == "cuda":
            memory_budget_bytes = int(0.9 * torch.cuda.get_device_properties(self.device).total_memory)
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
        self.memory_budget = memory_budget_bytes  # bytes; None: no cap (the CPU)
        self.rows_capped_batches = 0  # batches run with fewer rows than batch_size (and prompts left) allowed
        self._planned: set[tuple[int, int]] = set()  # (rows, length) already logged
        # where the time goes (:meth:`phase_report`): batches, rows, prefill tokens (rows x width, padding
        # included) and seconds, decode steps, row-steps and seconds (graph captures included), capture seconds
        self.phases: collections.Counter = collections.Counter()
        use_grouped_sdpa(model)  # masked GQA without copying the cache per layer and step

    def allocated_bytes(self) -> int:
        """GPU memory allocated by torch now, in bytes (``torch.cuda.memory_allocated``): the weights and whatever
        else lives on the device; 0 on the CPU. Tests override it to plan against a fake device."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def projected_bytes(self, rows: int, width: int, length: int) -> int:
        """What a batch of ``rows`` prompts (the longest ``width`` tokens) on a cache of ``length`` positions adds
        to the allocated memory, in bytes: ``rows x`` :func:`cache_bytes_per_row`, :func:`prefill_workspace_bytes`
        and :meth:`decode_graph_bytes` (a batch after the first of a shape prefills while the captured decode step
        still holds its memory, so the three add up)."""
        cfg = self.model.config
        return (rows * cache_bytes_per_row(cfg, length, self.dtype) + self.decode_graph_bytes(rows)
                + prefill_workspace_bytes(cfg, rows=rows, width=width, length=length,
                                          prefill_tokens=self.prefill_tokens, dtype=self.dtype))

    def decode_graph_bytes(self, rows: int) -> int:
        """Bytes the captured decode step of ``rows`` rows keeps in its CUDA graph's memory pool, for as long as the
        graph lives: for a hybrid target, the new conv and recurrent states of every Gated DeltaNet layer
        (``rows x cache_bytes_per_row(config, 0)``: flash-linear-attention's recurrent kernel returns each layer's
        new float32 state in a fresh tensor that the cache then copies in, and within the capture those tensors
        were not reused from layer to layer; at the Qwen3.5-27B shape the estimate matches what a capture allocated,
        bench/bench_regenerate_step.py, docs/rehearsal-x2). 0 without CUDA graphs or recurrent layers (attention
        layers update the static cache in place)."""
        if not (self.cuda_graphs and self.hybrid):
            return 0
        return rows * cache_bytes_per_row(self.model.config, 0, self.dtype)

    def _held_cache_bytes(self) -> int:
        """Bytes of the static cache and captured decode step the engine holds from its last batch (freed or reused
        by the next one): its (rows, length) key times :func:`cache_bytes_per_row` (tested equal to the cache's
        tensors) plus :meth:`decode_graph_bytes`."""
        if self._graph is None:
            return 0
        rows, length = self._graph[0]
        return rows * cache_bytes_per_row(self.model.config, length, self.dtype) + self.decode_graph_bytes(rows)

    def _rows(self, want: int, width: int, length: int) -> int:
        """Rows of the next batch: the most rows up to ``want`` (``batch_size``, or the prompts left) for which the
        allocated memory (less the cache and decode graph of the last batch, which this one replaces) plus
        :meth:`projected_bytes` stays within the budget; at least 1 (a warning then says by how much the budget is
        short). Logs each new (rows, length) with its projection."""
        if self.memory_budget is None:
            return want
        base = self.allocated_bytes() - self._held_cache_bytes()
        room = self.memory_budget - base
        rows = next((r for r in range(want, 0, -1) if self.projected_bytes(r, width, length) <= room), 1)
        if rows < want:
            self.rows_capped_batches += 1
        if (rows, length) not in self._planned:
            self._planned.add((rows, length))
            projected = self.projected_bytes(rows, width, length)
            cache = rows * cache_bytes_per_row(self.model.config, length, self.dtype)
            graph = self.decode_graph_bytes(rows)
            gib = 2 ** 30
            if projected > room:
                log.warning("static engine: the memory budget of %.2f GiB is %.2f GiB too small for one row on a "
                            "%d-position cache (%.2f GiB allocated + %.2f GiB cache + %.2f GiB prefill workspace + "
                            "%.2f GiB decode-step graph): running 1 row", self.memory_budget / gib,
                            (projected - room) / gib, length, base / gib, cache / gib,
                            (projected - cache - graph) / gib, graph / gib)
            else:
                log.info("static engine: %d of %d rows on a %d-position cache: %.2f GiB allocated + %.2f GiB cache + "
                         "%.2f GiB prefill workspace + %.2f GiB decode-step graph projected, budget %.2f GiB", rows,
                         want, length, base / gib, cache / gib, (projected - cache - graph) / gib, graph / gib,
                         self.memory_budget / gib)
        return rows

    def _mask(self, pad: torch.Tensor, q_pos: torch.Tensor, length: int) -> torch.Tensor:
        """Additive ``[rows, 1, q, length]``: key j visible to the query at cache index i iff pad_r <= j <= i."""
        kv = torch.arange(length, device=self.device)
        hidden = (kv[None, None, :] < pad[:, None, None]) | (kv[None, None, :] > q_pos[:, :, None])
        return torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(
            hidden, torch.finfo(self.dtype).min)[:, None]

    def _forward(self, cache, ids, pad, q_pos, length, logits_to_keep=0):
        positions = (q_pos - pad[:, None]).clamp_min(0)
        mask = self._mask(pad, q_pos, length)
        if self.hybrid:  # per layer type: the attention layers' 4-D mask; the recurrent layers' 2-D padding mask
            padding = (q_pos >= pad[:, None]).to(self.dtype) if ids.shape[1] > 1 else None  # decode: no padding
            mask = {"full_attention": mask, "linear_attention": padding}
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, logits_to_keep=logits_to_keep, **hybrid_cache.cache_kwargs(self.model, cache))
        return out.logits[:, -1]

    def _next(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy: argmax; sampling: transformers' temperature and top-p warpers, then a multinomial draw."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        scores = TemperatureLogitsWarper(self.temperature)(None, logits.float())
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]

    def _decoder(self, rows: int, length: int):
        """``(cache, step)`` for this shape: ``step(ids [rows], pad [rows]) -> logits [rows, V]`` on the cache."""
        from transformers import StaticCache

        key = (rows, length)
        if self._graph is not None and self._graph[0] == key:
            return self._graph[1], self._graph[2]
        self._graph = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        ids_buf = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        pad_buf = torch.zeros(rows, dtype=torch.long, device=self.device)
        state = {"graph": None, "logits": None, "failed": not self.cuda_graphs}

        counter = next(i for i, layer in enumerate(cache.layers) if hasattr(layer, "cumulative_length"))

        def current(c):  # the shared cache index of this step (every row's prompt ends at the same index)
            return c.layers[counter].cumulative_length.reshape(1, 1).expand(rows, 1)

        def eager(ids, pad):
            return self._forward(cache, ids[:, None], pad, current(cache), length)

        def step(ids, pad):
            if state["failed"]:
                return eager(ids, pad)
            ids_buf[:, 0].copy_(ids)
            pad_buf.copy_(pad)
            if state["graph"] is None:
                t0 = time.perf_counter()
                saved = hybrid_cache.snapshot(cache)  # the warm-ups run the step: the cache goes back before each
                captured = capture_graph(self.device,  # and the capture
                                         lambda: self._forward(cache, ids_buf, pad_buf, current(cache), length),
                                         {}, "decode", "the decode step", reset=lambda: hybrid_cache.restore(saved),
                                         logger=log)
                if captured is None:
                    state["failed"] = True
                    self.graph_failures += 1
                    return eager(ids, pad)
                state["graph"], state["logits"] = captured
                self.graphs_captured += 1
                self._sync()
                self.phases["capture_s"] += time.perf_counter() - t0
            state["graph"].replay()
            return state["logits"]

        self._graph = (key, cache, step)
        return cache, step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def phase_report(self) -> dict:
        """Where the engine's time went, summed over the batches so far: ``batches``, ``mean_rows``,
        ``prefill_tokens`` (rows x the batch's longest prompt, padding included), ``prefill_s`` and
        ``prefill_tokens_per_s``, ``decode_steps`` (one-token forwards of the whole batch), ``decode_row_steps``
        (those x rows: the tokens they produced, stopped rows included), ``decode_s`` (CUDA graph captures
        included), ``capture_s``, ``decode_ms_per_step`` (captures excluded) and ``decode_row_steps_per_s``.
        Seconds are wall clock between device synchronisations at each batch's phase boundaries."""
        p = self.phases
        steps, decode = p["decode_steps"], p["decode_s"] - p["capture_s"]
        return {
            "batches": p["batches"], "mean_rows": round(p["rows"] / p["batches"], 2) if p["batches"] else None,
            "prefill_tokens": p["prefill_tokens"], "prefill_s": round(p["prefill_s"], 3),
            "prefill_tokens_per_s": round(p["prefill_tokens"] / p["prefill_s"], 1) if p["prefill_s"] else None,
            "decode_steps": steps, "decode_row_steps": p["decode_row_steps"], "decode_s": round(p["decode_s"], 3),
            "capture_s": round(p["capture_s"], 3),
            "decode_ms_per_step": round(1e3 * decode / steps, 3) if steps else None,
            "decode_row_steps_per_s": round(p["decode_row_steps"] / decode, 1) if steps and decode > 0 else None,
        }

    def report(self) -> dict:
        """:meth:`Engine.report`: the decode-step graphs captured and failed, the memory budget in GiB (``None``
        without one), the batches cut to fit it, and :meth:`phase_report`."""
        return {"engine": self.name, "cuda_graphs": {"captured": self.graphs_captured, "failed": self.graph_failures},
                "memory_budget_gib": (round(self.memory_budget / 2 ** 30, 3) if self.memory_budget is not None
                                      else None),
                "rows_capped_batches": self.rows_capped_batches, "static_engine": self.phase_report()}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        with without_cudnn_attention():  # a new prompt width per batch: no per-shape cuDNN plans
            return self._generate(prompts, on_done, on_step)

    def _generate(self, prompts: list[list[int]], on_done=None, on_step=None) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # longest first: largest cache first
        stops = self.stops.to(self.device)
        b = 0
        while b < len(order):
            width = len(prompts[order[b]])  # the longest prompt left
            length = -(-(width + self.max_new) // 128) * 128
            rows = self._rows(min(self.batch_size, len(order) - b), width, length)  # the rest go to the next batch
            idx = order[b:b + rows]
            b += rows
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
            t_start = time.perf_counter()
            ids = ids.to(self.device)
            pad = torch.tensor([width - len(prompts[i]) for i in idx], dtype=torch.long, device=self.device)
            cache, step = self._decoder(len(idx), length)
            hybrid_cache.reset(cache)
            step_len = max(1, self.prefill_tokens // len(idx))  # the prefill in slices of the sequence
            for c in range(0, width, step_len):
                c1 = min(width, c + step_len)
                q_pos = torch.arange(c, c1, device=self.device)[None].expand(len(idx), c1 - c)
                logits = self._forward(cache, ids[:, c:c1], pad, q_pos, length, logits_to_keep=1)
            token = self._next(logits)
            self._sync()
            t_prefilled = time.perf_counter()
            generated = torch.empty((len(idx), self.max_new), dtype=torch.long, device=self.device)
            done = torch.zeros(len(idx), dtype=torch.bool, device=self.device)
            live = torch.zeros((), dtype=torch.long, device=self.device)  # tokens of rows not stopped yet
            reported = (0, 0)  # steps and tokens given to on_step so far (read at the checks: no extra sync)
            for t in range(self.max_new):
                generated[:, t] = token
                live += (~done).sum()
                done |= torch.isin(token, stops)
                last = t + 1 == self.max_new
                if last or (t + 1) % self.check_every == 0:
                    if on_step is not None:
                        n = int(live)
                        on_step(len(idx), t + 1 - reported[0], n - reported[1])
                        reported = (t + 1, n)
                    if last or bool(done.all()):
                        break
                token = self._next(step(token, pad))
            rows = generated[:, :t + 1].tolist()  # waits for the device
            self.phases.update(batches=1, rows=len(idx), prefill_tokens=len(idx) * width, decode_steps=t,
                               decode_row_steps=len(idx) * t)
            self.phases["prefill_s"] += t_prefilled - t_start
            self.phases["decode_s"] += time.perf_counter() - t_prefilled
            for r, i in enumerate(idx):
                out[i] = rows[r]
            if on_done is not None:
                on_done(len(idx))
        return out  # type: ignore[return-value]
