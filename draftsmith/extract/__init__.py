"""extract: the target's hidden states at the tapped layers, one resumable shard per GPU.

Two steps (rules ``extract_plan`` and ``extract_shard``, contracts in docs/design.md):

* :func:`build_plan` splits the tokenized train set into shards balanced by token count
  (deterministic longest-processing-time greedy) and fixes the target layer ids.
* :func:`extract_shard` loads the target once, runs length-sorted, right-padded batches bounded by a
  padded token budget, captures only the tapped decoder layers with forward hooks
  (:class:`draftsmith.target.LayerCapture`; id i = HF ``output_hidden_states[i + 1]``, the last layer
  after the final norm), stops the forward after the deepest tapped layer unless target tokens are
  wanted, unpads, checks the numbers and writes chunk files (safetensors) atomically, with a progress
  record after each chunk so a killed job resumes without redoing finished chunks.

The forward (tapped layers, greedy token, top-k): :mod:`.extractor`. Chunk files, manifests, the plan and the
index: :mod:`draftsmith.features`.

Not done on purpose: packing several samples into one row (``cu_seqlens``). docs/design.md records that it
leaks across documents for Gated DeltaNet targets (the short causal conv does not see the boundaries),
so every sample is its own row of a right-padded batch.

On CUDA the forward is fused by default (``extract.fuse: auto``, :mod:`draftsmith.fused`): the target's
norm and MLP modules run torch.compile'd (the model's own code, rounding where eager rounds) and its
Gated DeltaNet conv1d runs flash-linear-attention's Triton kernel instead of transformers' torch fallback.

Pipeline: forwards in the main thread; device-to-host copies on a side CUDA stream into two pinned
chunk buffers; one writer thread serialises, fsyncs and hashes each chunk (hashing concurrently with
the write, :func:`draftsmith.features.write_chunk`) while the next chunk computes, so only the last chunk's
write is not hidden. Capturing only the tapped layers (and stopping after the deepest one when no target
tokens are wanted) is faster than ``output_hidden_states=True`` on the same batches, and fusing adds to it
(``bench/bench_extract.py``; figures in docs/measurements.md). Eager features equal the naive path's bit for
bit; fused ones differ by bf16 rounding and are as close to a float32 reference (tests/test_fused.py).

Modules: :mod:`.plan` (rule extract_plan: :class:`ExtractPlanSettings`, :func:`build_plan`), :mod:`.shard`
(rule extract_shard, and stream mode's extract_slice / extract_heldout: :class:`ExtractShardSettings`,
:class:`FeatureExtractor`, :func:`extract_shard`) and :mod:`.folders` (the staging folder of a staged shard, the bytes
every shard of a plan still has to write). The plan's format: :func:`draftsmith.shard_plan.shard_plan`; the disk
projections and the reserve: :mod:`draftsmith.disk`.
"""

from draftsmith.extract.extractor import FeatureExtractor, logit_transform
from draftsmith.extract.plan import (
    ExtractPlanSettings,
    PlanDrafterOptions,
    PlanExtractOptions,
    PlanStreamOptions,
    PlanTargetOptions,
    PlanTrainOptions,
    build_plan,
    resolve_layer_ids,
)
from draftsmith.extract.shard import (
    Batch,
    ExtractHeldoutSettings,
    ExtractShardSettings,
    ExtractSliceSettings,
    FeatureSanityError,
    ShardExtractOptions,
    ShardTargetOptions,
    chunk_name,
    extract_shard,
    make_batches,
    make_chunks,
)

__all__ = [
    "Batch", "ExtractHeldoutSettings", "ExtractPlanSettings", "ExtractShardSettings", "ExtractSliceSettings",
    "FeatureExtractor", "FeatureSanityError", "PlanDrafterOptions", "PlanExtractOptions", "PlanStreamOptions",
    "PlanTargetOptions", "PlanTrainOptions", "ShardExtractOptions", "ShardTargetOptions", "build_plan", "chunk_name",
    "extract_shard", "logit_transform", "make_batches", "make_chunks", "resolve_layer_ids",
]
