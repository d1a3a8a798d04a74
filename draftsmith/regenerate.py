"""regenerate: the target answers the training prompts itself (greedy), so the drafter learns the
target's own distribution. A standard step for drafters (EAGLE-3 / SpecForge / DFlash recipes train on
target-regenerated responses; ~800K regenerated samples in the published DFlash recipe).

Input and output are curated parquet files (``results/curated/train.parquet`` ->
``results/regenerated/train.parquet``, the same Arrow schema and the same ``id`` / ``source`` per row, so
rows stay traceable to their source record).

Choices (documented, tested):

* **Turn by turn.** Assistant turns are regenerated in order; the prompt of turn j is the conversation
  *with the target's own earlier answers* (``render_prompt`` of the tokenize stage, the serving render, with
  the configured ``chat_template_kwargs``), so every supervised token of a later turn is conditioned on what
  the target itself said. ``max_turns`` (config) stops after that many regenerated turns (1 = first turn only;
  the rest of the conversation is cut, since later user turns answer the original reply).
* **Tool-call turns are kept.** An assistant message with ``tool_calls`` is kept verbatim (with its tool
  results), because the tool results that follow it belong to those exact calls; assistant text turns after
  the tool results are regenerated.
* **Stops.** Generation is greedy (``do_sample=False``) and stops at the first stop token of the one stop
  policy tokenize and evaluate share (:func:`draftsmith.chat.stop_token_ids`: eos ids plus the chat
  template's end-of-turn token, e.g. Llama 3's ``<|eot_id|>``, whose eos is ``<|end_of_text|>``); the
  answer is the generated tokens before the stop token, decoded without skipping special tokens, stored as
  ``content`` (``reasoning_content`` null: a thinking target's ``<think>...</think>`` stays inline in
  ``content``, which its template re-renders as generated).
* **Cuts, all counted.** An answer that hits ``max_new_tokens`` is kept truncated and the conversation ends
  after it; an empty answer, a prompt of ``max_prompt_tokens`` tokens or more (the training rows would
  hold no answer token) or a turn the template cannot render ends the conversation before that turn. A
  conversation left without any assistant turn is dropped (reason counted). Conversations in =
  regenerated + kept original (nothing to regenerate, e.g. tool calls only) + dropped; assistant turns in =
  regenerated + kept (tool calls, or no prompt before them) + removed by cuts.

Generation is batched and left-padded (HF ``generate``), prompts sorted by length. Left padding is exact
to ~1e-6 in float32; in bf16 a hybrid GDN target can differ from unpadded generation in rare tokens
(docs/design.md), which still is the target's own greedy distribution; ``batch_size: 1`` is unpadded.

Shards and resume: the input's conversations are cut into global parts of ``chunk_size`` (``P = ceil(rows /
chunk_size)``); shard i of n (``regenerate.shards`` jobs, one GPU lease each) regenerates the contiguous parts
``floor(i P / n) .. floor((i + 1) P / n) - 1`` (:func:`shard_parts`) into its own parquet, part k exactly as a
one-shard run does (sampling seeds follow the global k), and :func:`assemble_shards` concatenates the shards in
order, so the output equals a one-shard run's row for row. Each finished part is written atomically to
``<shard output>.parts/part-NNNNNN.parquet`` with a key of everything that determines it (input sha256, target
fingerprint, settings, the shard's part range). A killed job restarts from the first missing part; the shard's
output is assembled from its parts atomically, then the parts are removed.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from draftsmith import hybrid_cache
from draftsmith.target import (
    is_hybrid,
    text_config,
    use_grouped_sdpa,
    without_cudnn_attention,
)
from draftsmith.io import target_fingerprint
from draftsmith import fused
from draftsmith.gpu import capture_graph
from draftsmith.io import atomic_path, progress, sha256_file
from draftsmith.config import schema_defaults
from draftsmith.chat import (check_generation_prompt, check_template_kwargs, render_prompt, stop_token_ids,
                             tokenizer_fingerprint)

log = logging.getLogger("draftsmith.regenerate")

FORMAT = "draftsmith.regenerate/1"
META_KEY = b"draftsmith.regenerate"
PART_KEY = b"draftsmith.regenerate.part"

# counted outcomes
DROP_NO_TURN_LEFT = "no_assistant_turn_left"
DROP_UNSAMPLED_COPY = "answer_copy_without_sampled_turn"
CUT_MAX_NEW_TOKENS = "hit_max_new_tokens"
CUT_EMPTY = "empty_generation"
CUT_PROMPT_TOO_LONG = "prompt_over_max_prompt_tokens"
CUT_MAX_TURNS = "max_turns_reached"
CUT_TEMPLATE_ERROR = "template_error"


@dataclass
class _Conv:
    """One conversation being regenerated: ``out`` are the curated messages emitted so far."""

    record: dict
    messages: list[dict]
    out: list[dict] = field(default_factory=list)
    pos: int = 0                        # next original message to consume
    regenerated: int = 0
    prompt: list[int] | None = None     # pending serving prompt (token ids) of the turn to generate
    cut: str | None = None
    copy: int = 0                       # answer number k (num_answers > 1); rows of k >= 1 get id "<id>@<k>"


#: The ``regenerate`` section's defaults, from the schema (the one place they live).
_DEFAULTS = schema_defaults("regenerate")


@dataclass(frozen=True)
class GenerationSettings:
    """Settings of one regenerate run.

    Args:
        max_new_tokens: generated tokens per assistant turn at most.
        batch_size: prompts generated together (left-padded).
        max_prompt_tokens: a turn whose serving prompt has this many tokens or more ends its conversation
            (``None`` = no limit); the workflow passes ``tokenize.max_length``.
        max_turns: regenerate at most this many assistant turns per conversation (``None`` = all).
        chat_template_kwargs: the template kwargs of the tokenize stage (``enable_thinking`` ...).
        engine: ``generate`` (HF ``generate``, left-padded batches), ``continuous`` (transformers' continuous
            batching: paged attention, finished sequences replaced at once, CUDA graphs on GPU), ``vllm`` (if
            installed) or ``auto`` (:func:`resolve_engine`).
        temperature: 0 = greedy; > 0 samples (top-p ``top_p``), for more varied on-policy contexts; the labels
            stay the target's own greedy next tokens when extraction stores target tokens.
        num_answers: answers per conversation (each becomes its own row, id ``<id>@<k>`` for k >= 1);
            more than 1 needs ``temperature > 0``.
        seed: sampling seed (each part of the run seeds from it and the part number).
        memory_gib: GPU memory the regenerate job may use, in GiB (weights + cache + prefill workspace); ``None`` =
            90% of the GPU's memory; ignored on the CPU. The static engine lowers its batch rows to fit it.
        fuse: fuse the target's elementwise work while engines ``static`` and ``generate`` run
            (:func:`draftsmith.fused.fused_target`: compiled norms / MLPs, flash-linear-attention's conv1d for the
            Gated DeltaNet prefill); ``"auto"`` = on a GPU (:func:`draftsmith.fused.resolve_fuse`).
    """

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"regenerate engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.fuse not in (True, False, "auto"):
            raise ValueError(f"regenerate fuse must be true, false or 'auto', got {self.fuse!r}")
        if self.memory_gib is not None and self.memory_gib <= 0:
            raise ValueError(f"regenerate memory_gib must be > 0 (or None), got {self.memory_gib}")
        if self.num_answers > 1 and self.temperature <= 0:
            raise ValueError(f"num_answers={self.num_answers} with greedy decoding (temperature 0) would repeat "
                             "the same answer: set a temperature > 0")

    max_new_tokens: int = _DEFAULTS["max_new_tokens"]
    batch_size: int = _DEFAULTS["batch_size"]
    max_prompt_tokens: int | None = None
    max_turns: int | None = _DEFAULTS["max_turns"]
    chat_template_kwargs: dict = field(default_factory=dict)
    engine: str = _DEFAULTS["engine"]
    temperature: float = _DEFAULTS["temperature"]
    top_p: float = _DEFAULTS["top_p"]
    num_answers: int = _DEFAULTS["num_answers"]
    seed: int = _DEFAULTS["seed"]
    memory_gib: float | None = _DEFAULTS["memory_gib"]
    fuse: bool | str = _DEFAULTS["fuse"]


ENGINES = ("auto", "static", "generate", "continuous", "vllm")
#: engines that run the target's own modules eagerly or in their own CUDA graphs, so ``fuse`` applies to them
#: (``continuous`` runs transformers' own graphs, ``vllm`` its own model)
FUSED_ENGINES = ("static", "generate")


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
    ``continuous`` (transformers' continuous batching) is never chosen automatically: on an H200 with
    transformers 5.17 it wrote 1.18x the tokens/s of ``generate`` on the same prompts (bench_regenerate); it
    does not run linear-attention layers."""
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

    Plus the ``[rows, vocab_size]`` float32 logits of one step. An estimate, not a bound, fitted to one measurement:
    the Qwen3.5-27B shape in bf16 (hidden 5,120, intermediate 17,408, 24 / 4 heads, 48 value heads of 128) at 64 rows
    x 3,072-token prompts + 256 (length 3,328, 32,768-token slices; torch 2.11, transformers 5.17,
    flash-linear-attention 0.6) peaked 9.57 GiB above weights and cache on an H200 (docs/rehearsal-x2/README.md);
    this gives 10.79 GiB (351,488 bytes per token + 0.06 GiB of logits).

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


def _split_stop(ids: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """``(answer before the first stop token, whether a stop token ended it)``."""
    answer = []
    for t in ids:
        if t in stop_ids:
            return answer, True
        answer.append(int(t))
    return answer, False


class GenerateEngine:
    """HF ``generate``: prompts sorted by length, left-padded batches of ``batch_size``; a batch runs until its
    longest answer ends (the baseline the other engines are measured against, bench/bench_regenerate.py)."""

    name = "generate"

    def __init__(self, model, generation_config, pad_id: int, batch_size: int):
        self.model, self.gen, self.pad_id, self.batch_size = model, generation_config, pad_id, batch_size
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
                mask[r, width - len(prompts[i]):] = 1
            seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       generation_config=self.gen)
            for r, i in enumerate(idx):
                out[i] = seqs[r, width:].tolist()
            if on_done is not None:
                on_done(len(idx))
        return out  # type: ignore[return-value]


class StaticBatchEngine:
    """Batched greedy (or sampled) decoding on a static KV cache, each decode step a replayed CUDA graph.

    Prompts are sorted by length and generated in batches of ``batch_size``, left-padded so that every row's
    prompt ends at the same cache index; the cache holds ``longest prompt + max_new_tokens`` positions (rounded
    up to 128). Each row's keys before its padding are masked out and its positions count from its first real
    token, as HF ``generate`` does with left padding, so the answers are HF generate's (equal in float32, tested;
    bf16 kernels of other shapes can flip near-tied argmaxes). The prefill runs eagerly, in slices of the
    sequence of about ``prefill_tokens`` tokens over all rows (256 rows x 1,536 prompt tokens at once ran an
    H200 out of memory in float32); the one-token decode
    step of a (rows, cache length) shape is captured once as a CUDA graph and replayed: a small target's decode
    step is hundreds of short kernels, launch-bound from Python (HF ``generate`` kept an H200 16% busy). Rows
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
    the cut batches. (A Qwen3.5-27B-shape target, 64 rows of 3,072-token prompts + 256 new tokens, peaked at 81.9
    GiB on an H200 uncapped: 50.1 weights + 22.2 cache + ~9.6 workspace, docs/rehearsal-x2/README.md.)
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
        were not reused from layer to layer). Measured on an H200 at the Qwen3.5-27B shape (48 Gated DeltaNet
        layers, 147.8 MiB of states per row): a 256-row capture allocated 37.1 GiB beyond weights and cache and ran
        out of memory (bench/bench_regenerate_step.py, docs/rehearsal-x2); this estimate says 36.9 GiB. 0 without
        CUDA graphs or recurrent layers (attention layers update the static cache in place)."""
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

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None) -> list[list[int]]:
        with without_cudnn_attention():  # a new prompt width per batch: no per-shape cuDNN plans
            return self._generate(prompts, on_done)

    def _generate(self, prompts: list[list[int]], on_done=None) -> list[list[int]]:
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
            for t in range(self.max_new):
                generated[:, t] = token
                done |= torch.isin(token, stops)
                if t + 1 == self.max_new or ((t + 1) % self.check_every == 0 and bool(done.all())):
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


class ContinuousBatchingEngine:
    """transformers' continuous batching (``model.generate_batch``): a paged KV cache, each finished sequence's
    slot refilled by the next prompt at once, CUDA graphs for the decode steps on GPU. Greedy answers equal
    ``generate``'s (tested on CPU; bench/bench_regenerate.py compares them on a GPU)."""

    name = "continuous"

    def __init__(self, model, generation_config):
        self.model, self.gen = model, generation_config

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], on_done=None) -> list[list[int]]:
        if not prompts:
            return []
        results = self.model.generate_batch(inputs=prompts, generation_config=self.gen, progress_bar=False)
        # request ids are "req_<i>" in submission order (transformers 5.17 - 5.24); check, do not trust
        by_index = {}
        for rid, res in results.items():
            num = rid.rsplit("_", 1)[-1]
            if not num.isdigit():
                raise RuntimeError(f"continuous batching returned an unexpected request id {rid!r}")
            by_index[int(num)] = res
        if sorted(by_index) != list(range(len(prompts))):
            raise RuntimeError(f"continuous batching returned {len(by_index)} results for {len(prompts)} prompts")
        out = []
        for i, prompt in enumerate(prompts):
            res = by_index[i]
            if getattr(res, "error", None):
                raise RuntimeError(f"continuous batching failed on prompt {i}: {res.error}")
            if list(res.prompt_ids) != list(prompt):
                raise RuntimeError(f"continuous batching result {i} belongs to another prompt")
            out.append(list(res.generated_tokens))
        if on_done is not None:
            on_done(len(prompts))
        return out


class VLLMEngine:
    """vLLM (``vllm.LLM.generate`` on token ids), when the ``vllm`` package is installed; the target is loaded
    by vLLM itself from ``target_dir``. Not part of draftsmith's dependencies or CI."""

    name = "vllm"

    def __init__(self, target_dir: str, *, dtype: str, max_new_tokens: int, stop_ids: list[int], temperature: float,
                 top_p: float, seed: int, max_model_len: int | None, trust_remote_code: bool):
        try:
            import vllm
        except ImportError:
            raise ValueError("regenerate.engine = vllm but the vllm package is not installed; install it or use "
                             "engine: continuous") from None
        self.vllm = vllm
        self.llm = vllm.LLM(model=str(target_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            trust_remote_code=trust_remote_code)
        self.params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                          stop_token_ids=list(stop_ids), skip_special_tokens=False,
                                          include_stop_str_in_output=True)

    def generate(self, prompts: list[list[int]], on_done=None) -> list[list[int]]:
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, self.params, use_tqdm=False)
        out = []
        for o in outputs:
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and not set(ids) & set(self.params.stop_token_ids or []):
                ids.append(self.params.stop_token_ids[0])  # stopped at eos without returning it
            out.append(ids)
        if on_done is not None:
            on_done(len(prompts))
        return out


class Regenerator:
    """Batched regeneration of assistant turns by the target (greedy unless a temperature is set).

    Args:
        model: the target (``AutoModelForCausalLM``, eval mode, on its device); None with a ready ``engine``.
        tokenizer: the target's tokenizer with its chat template.
        settings: :class:`GenerationSettings`.
        stop_ids: ids generation stops at (default :func:`stop_token_ids` of the tokenizer and template).
        engine: a ready generation engine (``generate(prompts, on_done) -> token lists``); default: the one
            ``settings.engine`` names, built on ``model``.

    Raises:
        TemplateError: the template has no generation prompt (:func:`check_generation_prompt`).
        ValueError: no stop token, or no pad / eos id to left-pad with, or an engine that needs what is missing.
    """

    def __init__(self, model, tokenizer, settings: GenerationSettings, stop_ids: Sequence[int] | None = None, *,
                 engine=None):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.kwargs = check_template_kwargs(settings.chat_template_kwargs)
        check_generation_prompt(tokenizer, self.kwargs)
        self.stop_ids = sorted(set(stop_ids if stop_ids is not None
                                   else stop_token_ids(tokenizer, chat_template_kwargs=self.kwargs)))
        if not self.stop_ids:
            raise ValueError("the target has no eos / end-of-turn token id: generation could never stop")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.engine = engine if engine is not None else self._build_engine()
        self.progress = None  # a progress bar counting conversations, set by regenerate_file
        self.fused = None  # what draftsmith.fused.fused_target changed while this regenerates (set by run)
        self._last_line = time.monotonic()

    def _build_engine(self):
        from transformers import GenerationConfig

        if self.model is None:
            raise ValueError("Regenerator needs a model or a ready engine")
        s = self.settings
        sample = s.temperature > 0
        gen = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=sample, eos_token_id=self.stop_ids,
                               pad_token_id=self.pad_id, temperature=s.temperature if sample else None,
                               top_p=s.top_p if sample else None, top_k=0 if sample else None)
        name = resolve_engine(s.engine, self.model)
        if name == "static":
            on_gpu = next(self.model.parameters()).device.type == "cuda"
            budget = int(s.memory_gib * 2 ** 30) if s.memory_gib is not None and on_gpu else None
            return StaticBatchEngine(self.model, pad_id=self.pad_id, stop_ids=self.stop_ids, batch_size=s.batch_size,
                                     max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                     memory_budget_bytes=budget)
        if name == "generate":
            return GenerateEngine(self.model, gen, self.pad_id, s.batch_size)
        if name == "continuous":
            return ContinuousBatchingEngine(self.model, gen)
        raise ValueError(f"engine {name!r} loads the target itself: build it with make_engine and pass engine=")

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """Continuation of each prompt (token ids) by the engine.

        Returns:
            Per prompt ``(answer_ids, stopped)``: the generated ids before the first stop token, and
            whether a stop token ended it (False: ``max_new_tokens`` was reached).
        """
        stops = set(self.stop_ids)
        done = [0]

        def on_done(n: int) -> None:  # a line on the console within long parts too (at the bar's interval)
            done[0] += n
            bar = self.progress
            if bar is not None:
                bar.set_postfix_str(f"{done[0]}/{len(prompts)} answers of this round", refresh=False)
                if time.monotonic() - self._last_line >= bar.mininterval:  # update(0) would not print
                    bar.refresh()
                    self._last_line = time.monotonic()

        out = self.engine.generate(prompts, on_done)
        return [_split_stop(ids[:self.settings.max_new_tokens], stops) for ids in out]

    def decode(self, ids: list[int]) -> str:
        """Answer text of generated ids (special tokens kept, no clean-up: re-rendering gives them back)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- conversations ----------------------------------------------------------------------------

    def _advance(self, conv: _Conv, stats: collections.Counter) -> None:
        """Copy original messages into ``conv.out`` until the next assistant text turn needs generating."""
        msgs = conv.messages
        while conv.pos < len(msgs):
            m = msgs[conv.pos]
            if m.get("role") != "assistant" or m.get("tool_calls") or conv.pos == 0:
                if m.get("role") == "assistant":
                    stats["turns_kept_tool_call" if m.get("tool_calls") else "turns_kept_without_prompt"] += 1
                conv.out.append(m)
                conv.pos += 1
                continue
            if self.settings.max_turns is not None and conv.regenerated >= self.settings.max_turns:
                conv.cut = CUT_MAX_TURNS
                return
            try:
                prompt = render_prompt(self.tokenizer, conv.out, conv.record.get("tools"), self.kwargs)
            except Exception as exc:  # bad messages / tools, or the template refuses the conversation
                conv.cut = CUT_TEMPLATE_ERROR
                if stats[f"cut.{CUT_TEMPLATE_ERROR}"] < 5:
                    log.warning("conversation %s: turn %d cannot be rendered (%s: %s): the conversation ends "
                                "before it", conv.record.get("id"), conv.pos, type(exc).__name__, exc)
                return
            if self.settings.max_prompt_tokens is not None and len(prompt) >= self.settings.max_prompt_tokens:
                conv.cut = CUT_PROMPT_TOO_LONG
                return
            conv.prompt = prompt
            return

    def regenerate(self, records: list[dict]) -> tuple[list[dict], collections.Counter]:
        """Regenerate a list of curated records (dicts of the curated schema); returns (records, counts).

        Output records keep ``id``, ``source`` and ``tools``; dropped conversations are left out and
        counted (``dropped.<reason>``). With ``num_answers`` = n each record is answered n times (copies k >= 1
        get id ``<id>@<k>``), so ``conversations_in`` = n x ``records_in``. Counts: ``conversations_in`` =
        ``regenerated`` + ``kept_original`` +
        dropped; ``turns_in`` = ``turns_regenerated`` + ``turns_kept_tool_call`` + ``turns_kept_without_prompt``
        + ``turns_removed_by_cut``; ``cut.<reason>`` per conversation.
        """
        stats: collections.Counter = collections.Counter()
        n = self.settings.num_answers
        convs = [_Conv(rec if k == 0 else {**rec, "id": f"{rec.get('id')}@{k}"}, list(rec.get("messages") or []),
                       copy=k)
                 for rec in records for k in range(n)]
        stats["records_in"] += len(records)
        stats["conversations_in"] += len(convs)
        stats["turns_in"] += sum(1 for c in convs for m in c.messages if m.get("role") == "assistant")
        for c in convs:
            self._advance(c, stats)
        while True:
            pending = [c for c in convs if c.prompt is not None]
            if not pending:
                break
            results = self.generate([c.prompt for c in pending])
            for c, (answer, stopped) in zip(pending, results):
                c.prompt = None
                if not answer:
                    c.cut = CUT_EMPTY
                    continue
                original = c.messages[c.pos]
                c.out.append({**original, "content": self.decode(answer), "reasoning_content": None,
                              "tool_calls": None})
                c.pos += 1
                c.regenerated += 1
                stats["turns_regenerated"] += 1
                stats["tokens_generated"] += len(answer)
                canonical = self.tokenizer(self.decode(answer), add_special_tokens=False)["input_ids"] == answer
                stats["turns_retokenize_exact"] += int(canonical)
                if not stopped:
                    c.cut = CUT_MAX_NEW_TOKENS
                    continue
                self._advance(c, stats)
        out = []
        for c in convs:
            if c.cut is not None:
                stats[f"cut.{c.cut}"] += 1
                stats["turns_removed_by_cut"] += sum(1 for m in c.messages[c.pos:] if m.get("role") == "assistant")
            # the conversation ends after its last assistant turn
            last = max((i for i, m in enumerate(c.out) if m.get("role") == "assistant"), default=-1)
            if not any(m.get("role") == "assistant" and (m.get("content") or m.get("tool_calls"))
                       for m in c.out[:last + 1]):
                stats[f"dropped.{c.cut if c.cut else DROP_NO_TURN_LEFT}"] += 1
                continue
            if c.copy and not c.regenerated:  # another answer copy with nothing sampled: equal to copy 0
                stats[f"dropped.{DROP_UNSAMPLED_COPY}"] += 1
                continue
            stats["regenerated" if c.regenerated else "kept_original"] += 1
            out.append({**c.record, "messages": c.out[:last + 1]})
        return out, stats


# --------------------------------------------------------------------------------------------------
# Files




def _check_counts(stats: collections.Counter) -> None:
    dropped = sum(v for k, v in stats.items() if k.startswith("dropped."))
    turns = (stats["turns_regenerated"] + stats["turns_kept_tool_call"] + stats["turns_kept_without_prompt"]
             + stats["turns_removed_by_cut"])
    if (stats["regenerated"] + stats["kept_original"] + dropped != stats["conversations_in"]
            or turns != stats["turns_in"]):
        raise AssertionError(f"regenerate counts do not reconcile: {dict(stats)}")


def _seed_of(*parts) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def num_parts(rows: int, chunk_size: int) -> int:
    """Global parts of ``chunk_size`` rows in an input of ``rows`` rows: ``ceil(rows / chunk_size)``."""
    return -(-rows // chunk_size)


def shard_parts(parts: int, shard: int, shards: int) -> tuple[int, int]:
    """The global parts ``[first, last)`` shard ``shard`` of ``shards`` regenerates: ``first = floor(shard x parts /
    shards)``, ``last = floor((shard + 1) x parts / shards)``; contiguous ranges that cover ``0 .. parts`` once, empty
    when there are more shards than parts.

    Raises:
        ValueError: ``shards < 1`` or ``shard`` outside ``0 .. shards - 1``.
    """
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"regenerate shard {shard} of {shards}: the shards are 0..{shards - 1} (shards >= 1)")
    return shard * parts // shards, (shard + 1) * parts // shards


def _iter_parts(pf: pq.ParquetFile, chunk_size: int, first: int, last: int):
    """Yield ``(k, table)`` for the global parts ``k`` in ``[first, last)`` of ``pf``: rows ``[k x chunk_size,
    min((k + 1) x chunk_size, rows))``, whatever the file's row groups; only the row groups holding them are read."""
    meta = pf.metadata
    start, stop = first * chunk_size, min(last * chunk_size, meta.num_rows)
    if start >= stop:
        return
    groups, pos, offset = [], None, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if offset < stop and offset + n > start:
            groups.append(g)
            pos = offset if pos is None else pos
        offset += n
    k, pending = first, []
    end = min((k + 1) * chunk_size, stop)  # the global row where part k ends
    for batch in pf.iter_batches(batch_size=chunk_size, row_groups=groups):
        b0, pos = pos, pos + batch.num_rows  # global rows [b0, pos) of this batch
        row = max(start, b0)
        while row < min(pos, stop):
            take = min(end, pos) - row
            pending.append(batch.slice(row - b0, take))
            row += take
            if row == end:
                yield k, pa.Table.from_batches(pending)
                pending, k = [], k + 1
                if k == last:
                    return
                end = min((k + 1) * chunk_size, stop)


#: counts every regenerate of a list of records sets, even an empty one (an empty shard's counts)
_BASE_COUNTS = ("records_in", "conversations_in", "turns_in")


def regenerate_file(input_path: str | os.PathLike, output_path: str | os.PathLike, regenerator: Regenerator, *,
                    target_key: str, chunk_size: int = 512, shard: int = 0, shards: int = 1,
                    progress_interval: float = 30.0) -> dict:
    """Regenerate (a shard of) a curated parquet into ``output_path`` (same schema), resumable by parts; returns
    the report, also stored in the output's metadata (:func:`read_report`).

    The input's rows are cut into ``P = ceil(rows / chunk_size)`` global parts of ``chunk_size`` rows; shard ``shard``
    of ``shards`` regenerates the contiguous parts :func:`shard_parts` gives it, each part ``k`` exactly as an
    unsharded run does (the same rows, a sampling seed of ``seed`` and ``k``), so the shards' outputs in shard order
    (:func:`assemble_shards`) equal a one-shard run's row for row. A shard with no part (more shards than parts)
    writes an empty parquet of the input's schema, its counts zero. Finished parts are kept in
    ``<output>.parts/part-<k>.parquet`` (``k`` global) with a key of everything that determines them (a part does not
    depend on the shard that made it); a rerun reuses those, and those another shard layout left in the ``*.parts``
    folders beside the output (moved into this shard's folder: a killed run resumes with another
    ``regenerate.shards``), and redoes stale ones. Once the output is written this shard's parts are deleted, with
    the stale files of its folder, and the folder if nothing else is left in it (:func:`assemble_shards` removes the
    rest).

    The report holds the settings, ``input`` / ``input_sha256`` / ``input_rows``, ``chunk_size``, ``num_parts``
    (P), ``shard`` / ``num_shards`` / ``parts`` (``[first, last)``), ``counts`` (reconciled, see
    :meth:`Regenerator.regenerate`), ``seconds`` (wall clock) and ``new_tokens_per_s`` (generated tokens per second
    of generation in this run; ``None`` when every part was reused).

    Raises:
        ValueError: the input lacks the curated columns (names the file); a shard outside ``0 .. shards - 1``.
    """
    t0 = time.perf_counter()
    output_path = Path(output_path)
    pf = pq.ParquetFile(input_path)
    schema = pf.schema_arrow
    missing = [c for c in ("id", "messages") if c not in schema.names]
    if missing:
        raise ValueError(f"{input_path}: curated parquet lacks column(s) {', '.join(missing)}")
    n_rows = pf.metadata.num_rows
    total_parts = num_parts(n_rows, chunk_size)
    first, last = shard_parts(total_parts, shard, shards)
    s = regenerator.settings
    input_sha = sha256_file(input_path)
    key = hashlib.sha256(json.dumps({
        "format": FORMAT, "input": input_sha, "target": target_key,
        "tokenizer": tokenizer_fingerprint(regenerator.tokenizer), "kwargs": regenerator.kwargs,
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens, "max_turns": s.max_turns,
        "stop_ids": regenerator.stop_ids, "chunk_size": chunk_size, "engine": regenerator.engine.name,
        "dtype": str(next(regenerator.model.parameters()).dtype) if regenerator.model is not None else None,
        "sampling": [s.temperature, s.top_p, s.num_answers, s.seed] if s.temperature > 0 else None,
    }, sort_keys=True).encode()).hexdigest()
    parts_dir = output_path.with_name(output_path.name + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    clean_schema = schema.remove_metadata()
    total: collections.Counter = collections.Counter({k: 0 for k in _BASE_COUNTS})
    part_paths = []
    shard_rows = min(last * chunk_size, n_rows) - min(first * chunk_size, n_rows)
    log.info("regenerating %d of %d conversations (shard %d of %d: parts %d..%d of the %d parts of %d rows) x %d "
             "answer(s) with engine %s", shard_rows, n_rows, shard, shards, first, last - 1, total_parts, chunk_size,
             s.num_answers, regenerator.engine.name)
    if first == last:
        log.warning("shard %d of %d has no part (%d parts of %d rows for %d shards): its output is empty and its GPU "
                    "idle; regenerate.chunk_size <= %d gives every shard work", shard, shards, total_parts,
                    chunk_size, shards, max(1, n_rows // shards))
    bar = progress(shard_rows, "regenerate" if shards == 1 else f"regenerate shard {shard}", unit="conv",
                   logger=log, interval=progress_interval)
    regenerator.progress = bar
    new_tokens, t_new = 0, 0.0
    try:
        for k, batch in _iter_parts(pf, chunk_size, first, last):
            part = parts_dir / f"part-{k:06d}.parquet"
            part_paths.append(part)
            info = _claim_part(part, key)
            if info is not None:
                total.update(info["stats"])
                bar.update(batch.num_rows)
                continue
            records = batch.to_pylist()
            if s.temperature > 0:
                torch.manual_seed(_seed_of(s.seed, k))
            t1 = time.perf_counter()
            out, stats = regenerator.regenerate(records)
            _check_counts(stats)
            table = pa.Table.from_pylist(out, schema=clean_schema)
            table = table.replace_schema_metadata({PART_KEY: json.dumps({"key": key, "stats": dict(stats)}).encode()})
            with atomic_path(part, suffix=".parquet") as tmp:
                pq.write_table(table, tmp)
            total.update(stats)
            new_tokens += stats["tokens_generated"]
            t_new += time.perf_counter() - t1
            bar.set_postfix_str(f"{new_tokens / max(t_new, 1e-9):,.0f} new tok/s", refresh=False)
            bar.update(len(records))
            log.debug("part %d: %d conversations -> %d rows, %d turns regenerated, %d tokens in %.1f s",
                      k, len(records), len(out), stats["turns_regenerated"], stats["tokens_generated"],
                      time.perf_counter() - t1)
    finally:
        bar.close()
        regenerator.progress = None
    if len(part_paths) != last - first:  # the input changed under the run
        raise AssertionError(f"{input_path}: read {len(part_paths)} parts of shard {shard}, expected {last - first}")
    _check_counts(total)
    report = {
        "format": FORMAT,
        "input": str(input_path), "input_sha256": input_sha, "input_rows": n_rows,
        "chunk_size": chunk_size, "num_parts": total_parts,
        "shard": shard, "num_shards": shards, "parts": [first, last],
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens, "max_turns": s.max_turns,
        "chat_template_kwargs": regenerator.kwargs, "stop_token_ids": regenerator.stop_ids,
        "target_fingerprint": target_key, "engine": regenerator.engine.name,
        "cuda_graphs": ({"captured": regenerator.engine.graphs_captured, "failed": regenerator.engine.graph_failures}
                        if hasattr(regenerator.engine, "graphs_captured") else None),
        "memory_budget_gib": (round(regenerator.engine.memory_budget / 2 ** 30, 3)
                              if getattr(regenerator.engine, "memory_budget", None) is not None else None),
        "rows_capped_batches": getattr(regenerator.engine, "rows_capped_batches", None),
        "static_engine": (regenerator.engine.phase_report() if hasattr(regenerator.engine, "phase_report")
                          else None),
        "fused": regenerator.fused,
        "temperature": s.temperature, "top_p": s.top_p, "num_answers": s.num_answers, "seed": s.seed,
        "counts": dict(sorted(total.items())),
        "seconds": round(time.perf_counter() - t0, 3),
        "new_tokens_per_s": round(new_tokens / t_new, 1) if t_new else None,
    }
    with atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, clean_schema.with_metadata({META_KEY: json.dumps(report).encode()})) as w:
            for part in part_paths:
                w.write_table(pq.read_table(part).replace_schema_metadata(None).cast(clean_schema))
    _clean_parts(parts_dir, part_paths, key)
    return report


def _part_key(path: Path) -> dict:
    """A finished part's ``{"key", "stats"}`` (``{}`` for a file that is not one)."""
    try:
        return json.loads((pq.read_schema(path).metadata or {}).get(PART_KEY, b"{}"))
    except (OSError, ValueError, pa.ArrowException):
        return {}


def _claim_part(part: Path, key: str) -> dict | None:
    """Part ``part`` finished with ``key``: in this shard's folder, or in a sibling ``*.parts`` folder (another shard
    layout's), then moved here (``os.replace``: atomic; shards of one layout own disjoint parts). Its ``{"key",
    "stats"}``, or None when it must be regenerated (missing, or stale: logged)."""
    k = part.name
    here = part.parent
    for candidate in [part] + sorted(d / k for d in here.parent.glob("*.parts") if d != here):
        if not candidate.is_file():
            continue
        info = _part_key(candidate)
        if info.get("key") != key:
            if candidate == part:
                log.info("%s: stale (other input or settings): redone", part)
            continue
        if candidate != part:
            os.replace(candidate, part)
            log.info("%s: reused, finished by a run of another shard layout (%s)", part, candidate.parent.name)
        else:
            log.info("%s: reused (finished earlier)", part)
        return info
    return None


def _clean_parts(parts_dir: Path, part_paths: list[Path], key: str) -> None:
    """After the shard's output is written: delete its parts, the stale files and temporaries of its folder, and
    the folder when empty. Parts of other shards finished with ``key`` (another layout's) stay for them."""
    for path in part_paths:
        path.unlink(missing_ok=True)
    for path in parts_dir.iterdir():
        if path.name.startswith(".") or _part_key(path).get("key") != key:
            path.unlink(missing_ok=True)
    try:
        parts_dir.rmdir()
    except OSError:
        log.info("%s: kept, it holds parts of other shards", parts_dir)


#: Report keys every shard of one regenerate run agrees on (:func:`assemble_shards` refuses a shard that does not).
SHARD_AGREE = ("format", "input", "input_sha256", "input_rows", "chunk_size", "num_parts", "num_shards",
               "target_fingerprint", "max_new_tokens", "max_prompt_tokens", "max_turns", "chat_template_kwargs",
               "stop_token_ids", "temperature", "top_p", "num_answers", "seed")
#: Report keys of one shard's run only: kept under the assembled report's ``shards``.
_PER_SHARD = ("shard", "parts", "engine", "cuda_graphs", "memory_budget_gib", "rows_capped_batches", "counts",
              "seconds", "new_tokens_per_s")


def assemble_shards(shard_paths: Sequence[str | os.PathLike], output_path: str | os.PathLike) -> dict:
    """Concatenate the regenerated shard parquets of one run (:func:`regenerate_file` with ``shard`` = 0 .. n - 1),
    in shard order, into ``output_path`` atomically; returns its report, also stored in its metadata.

    The output equals a one-shard run's row for row (same schema, rows in global part order). Its report holds the
    shards' common settings (:data:`SHARD_AGREE`), ``counts`` summed over the shards (reconciled as one run's),
    ``seconds`` of the longest shard and ``new_tokens_per_s`` summed over the shards (they run at the same time;
    ``None`` if no shard generated anything), ``engine`` (the shards' engines, comma-separated when they differ),
    ``cuda_graphs`` / ``rows_capped_batches`` summed and ``memory_budget_gib`` the largest (``None`` where no shard
    has one), and each shard's own report under ``shards``. The ``shard-*.parquet.parts`` folders beside the shards
    (parts of an earlier shard layout that none of this run's shards needed) are removed.

    Args:
        shard_paths: the shard files, shard 0 first.
        output_path: the assembled parquet (``results/regenerated/train.parquet``).

    Raises:
        FileNotFoundError: a shard file does not exist.
        ValueError: (naming the file) no shard given; a file without a regenerate shard report; a shard whose report
            disagrees with shard 0's on the input file, its rows, the settings or the target fingerprint; a shard
            given out of order, or from a run of another shard count; shards whose part ranges do not follow each
            other from part 0 to the input's last part (a shard missing); a shard whose rows are not its counts'.
        AssertionError: the summed counts do not reconcile.
    """
    paths = [Path(p) for p in shard_paths]
    if not paths:
        raise ValueError(f"{output_path}: no regenerate shard to assemble")
    reports = []
    for i, path in enumerate(paths):
        if not path.exists():
            raise FileNotFoundError(f"{path}: regenerate shard {i} does not exist")
        rep = read_report(path)
        if "shard" not in rep or "parts" not in rep:
            raise ValueError(f"{path}: its regenerate report names no shard and part range (written by another "
                             "version of draftsmith): rerun the regenerate_shard jobs")
        reports.append(rep)
    head = reports[0]
    for path, rep in zip(paths, reports):
        differ = [k for k in SHARD_AGREE if rep.get(k) != head.get(k)]
        if differ:
            raise ValueError(f"{path}: a shard of another regenerate run than {paths[0]}: "
                             + "; ".join(f"{k} {rep.get(k)!r} != {head.get(k)!r}" for k in differ))
    nxt = 0
    for i, (path, rep) in enumerate(zip(paths, reports)):
        first, last = rep["parts"]
        if rep["shard"] != i:
            raise ValueError(f"{path}: is shard {rep['shard']} of {rep['num_shards']}, given as shard {i}: a shard is "
                             "missing or out of order")
        if first != nxt or last < first:
            raise ValueError(f"{path}: holds parts [{first}, {last}) but the parts before it end at {nxt}: a shard "
                             "is missing or out of order")
        rows = pq.ParquetFile(path).metadata.num_rows
        c = rep["counts"]
        if rows != c.get("regenerated", 0) + c.get("kept_original", 0):
            raise ValueError(f"{path}: holds {rows} rows, its counts {c.get('regenerated', 0)} regenerated + "
                             f"{c.get('kept_original', 0)} kept original")
        nxt = last
    if nxt != head["num_parts"]:
        raise ValueError(f"{paths[-1]}: the shards end at part {nxt} of the input's {head['num_parts']}: a shard is "
                         "missing")
    if head["num_shards"] != len(paths):
        raise ValueError(f"{paths[-1]}: {len(paths)} shard file(s) given for a run of {head['num_shards']} shards: a "
                         "shard is missing")
    total: collections.Counter = collections.Counter()
    for rep in reports:
        total.update(rep["counts"])
    _check_counts(total)
    if total["records_in"] != head["input_rows"]:
        raise AssertionError(f"regenerate shards read {total['records_in']} records of {head['input_rows']}")

    def summed(values):
        values = [v for v in values if v is not None]
        return sum(values) if values else None

    rates = [r["new_tokens_per_s"] for r in reports]
    graphs = [r["cuda_graphs"] for r in reports if r.get("cuda_graphs") is not None]
    budgets = [r["memory_budget_gib"] for r in reports if r.get("memory_budget_gib") is not None]
    report = {k: v for k, v in head.items() if k not in _PER_SHARD}
    report.update({
        "engine": ",".join(sorted({r["engine"] for r in reports})),
        "cuda_graphs": ({"captured": sum(g["captured"] for g in graphs), "failed": sum(g["failed"] for g in graphs)}
                        if graphs else None),
        "memory_budget_gib": max(budgets) if budgets else None,
        "rows_capped_batches": summed(r.get("rows_capped_batches") for r in reports),
        "counts": dict(sorted(total.items())),
        "seconds": max(r["seconds"] for r in reports),
        "new_tokens_per_s": round(summed(rates), 1) if summed(rates) is not None else None,
        "shards": reports,
    })
    schema = pq.read_schema(paths[0]).remove_metadata()
    with atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, schema.with_metadata({META_KEY: json.dumps(report).encode()})) as w:
            for path in paths:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
                    w.write_table(pa.Table.from_batches([batch]).replace_schema_metadata(None).cast(schema))
    for folder in {p.parent for p in paths}:  # parts an earlier shard layout left and no shard of this one took
        for parts in folder.glob("shard-*.parquet.parts"):
            shutil.rmtree(parts, ignore_errors=True)
    return report


def read_report(path: str | os.PathLike) -> dict:
    """The regenerate report stored in a regenerated parquet's metadata (``draftsmith.regenerate``)."""
    meta = pq.read_schema(path).metadata or {}
    if META_KEY not in meta:
        raise ValueError(f"{path}: no {META_KEY.decode()} metadata (not written by the regenerate stage)")
    return json.loads(meta[META_KEY])


def summary(report: dict) -> str:
    """One log line of a regenerate report (:func:`regenerate_file`'s or :func:`assemble_shards`'s): new tokens/s,
    conversations in / regenerated / kept / dropped by reason, turns and tokens, cuts by reason, seconds."""
    c = report["counts"]
    shards = report.get("shards")
    where = (f"{len(shards)} shard{'s' if len(shards) != 1 else ''}: " if shards is not None
             else f"shard {report['shard']} of {report['num_shards']}: " if report.get("num_shards", 1) > 1 else "")
    dropped = {k: v for k, v in c.items() if k.startswith("dropped.")}
    cuts = {k: v for k, v in c.items() if k.startswith("cut.")}
    exact = 100 * c.get("turns_retokenize_exact", 0) / max(c.get("turns_regenerated", 0), 1)
    phases = report.get("static_engine") or {}
    engine = (f"; static engine: prefill {phases['prefill_tokens_per_s']:,.0f} tok/s ({phases['prefill_s']:.1f} s), "
              f"decode {phases['decode_ms_per_step']:.1f} ms a step at {phases['mean_rows']} rows on average "
              f"({phases['decode_s']:.1f} s, {phases['capture_s']:.1f} s of it graph captures)"
              if phases.get("decode_steps") and phases.get("prefill_s") else "")
    return (f"{where}{report['new_tokens_per_s']} new tokens/s; {c.get('conversations_in', 0)} conversations in -> "
            f"{c.get('regenerated', 0)} regenerated, {c.get('kept_original', 0)} kept original, dropped {dropped}; "
            f"{c.get('turns_regenerated', 0)} turns regenerated ({c.get('tokens_generated', 0)} tokens, {exact:.1f}% "
            f"re-tokenize exactly), {c.get('turns_kept_tool_call', 0)} tool-call turns kept, cuts {cuts}; "
            f"{report['seconds']:.1f} s{engine}")


def run(*, conversations: str, target_dir: str, output: str, settings: GenerationSettings, dtype: str = "auto",
        attn_implementation: str = "sdpa", trust_remote_code: bool = False, chunk_size: int = 512, shard: int = 0,
        shards: int = 1, device: str | torch.device | None = None) -> dict:
    """The regenerate stage's job: load the target, regenerate shard ``shard`` of ``shards`` of ``conversations``
    into ``output`` (:func:`regenerate_file`); returns the report."""
    from draftsmith.target import load_target
    from draftsmith.chat import load_tokenizer

    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    stops = stop_token_ids(tokenizer, target_dir, check_template_kwargs(settings.chat_template_kwargs))
    if settings.engine == "vllm":
        model = None
        engine = VLLMEngine(target_dir, dtype=dtype, max_new_tokens=settings.max_new_tokens, stop_ids=stops,
                            temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
                            max_model_len=(settings.max_prompt_tokens + settings.max_new_tokens
                                           if settings.max_prompt_tokens else None),
                            trust_remote_code=trust_remote_code)
    else:
        model = load_target(target_dir, dtype=dtype, device=device, attn_implementation=attn_implementation,
                            trust_remote_code=trust_remote_code)
        engine = None
    regen = Regenerator(model, tokenizer, settings, stops, engine=engine)
    log.info("target %s (%s), engine %s, stop ids %s, pad id %d, settings %s", target_dir,
             next(model.parameters()).dtype if model is not None else dtype, regen.engine.name, regen.stop_ids,
             regen.pad_id, settings)
    fuse = (regen.engine.name in FUSED_ENGINES
            and fused.resolve_fuse(settings.fuse, next(model.parameters()).device))
    with fused.fused_target(model, enabled=fuse) as regen.fused:
        report = regenerate_file(conversations, output, regen, target_key=target_fingerprint(target_dir),
                                 chunk_size=chunk_size, shard=shard, shards=shards)
    log.info("%s", summary(report))
    return report
