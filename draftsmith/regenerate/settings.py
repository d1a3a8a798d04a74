"""The regenerate stage's settings: the config keys its two rules read, as frozen objects.

:class:`RegenerateShardSettings` is rule ``regenerate_shard``'s (sections ``regenerate``, ``target``, ``tokenize``),
:class:`RegenerateSettings` the assembler rule ``regenerate``'s; their fields are exactly the keys
:data:`draftsmith.stages.STAGE_KEYS` names for those rules. Defaults come from the schema
(:mod:`draftsmith.settings`). The one key another stage owns and regenerate reinterprets, ``tokenize.max_length``,
becomes regenerate's prompt limit in :attr:`RegenerateShardSettings.max_prompt_tokens`.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from draftsmith.gpu import GpuOptions
from draftsmith.settings import SectionSettings, StageSettings

#: ``regenerate.engine`` values (:func:`draftsmith.regenerate.static.resolve_engine` says what ``auto`` means)
ENGINES = ("auto", "static", "generate", "continuous", "vllm")


@dataclass(frozen=True)
class RegenerateOptions(SectionSettings):
    """The ``regenerate`` keys of rule ``regenerate_shard``.

    Args:
        max_new_tokens: generated tokens per assistant turn at most.
        temperature: 0 = greedy; > 0 samples (top-p ``top_p``), for more varied on-policy contexts; the labels
            stay the target's own greedy next tokens when extraction stores target tokens.
        top_p: nucleus of the sampled answers (``temperature > 0`` only).
        num_answers: answers per conversation (each becomes its own row, id ``<id>@<k>`` for k >= 1);
            more than 1 needs ``temperature > 0``.
        seed: sampling seed (each part of the run seeds from it and the part number).
        max_turns: regenerate at most this many assistant turns per conversation (``None`` = all).
        shards: regenerate_shard jobs of the run (each regenerates a contiguous range of the parts).
        engine: ``generate`` (HF ``generate``, left-padded batches), ``static`` (static KV cache, CUDA-graph decode
            steps), ``continuous`` (transformers' continuous batching: paged attention, finished sequences replaced
            at once, CUDA graphs on GPU), ``vllm`` (if installed) or ``auto``
            (:func:`draftsmith.regenerate.static.resolve_engine`).
        batch_size: prompts generated together (left-padded).
        memory_gib: GPU memory the regenerate job may use, in GiB (weights + cache + prefill workspace); ``None`` =
            90% of the GPU's memory; ignored on the CPU. The static engine lowers its batch rows to fit it.
        fuse: fuse the target's elementwise work while engines ``static`` and ``generate`` run
            (:func:`draftsmith.fused.fused_target`: compiled norms / MLPs, flash-linear-attention's conv1d for the
            Gated DeltaNet prefill); ``"auto"`` = on a GPU (:func:`draftsmith.fused.resolve_fuse`).
        chunk_size: conversations per part (the unit of resume and of the shards' ranges).
        gpus: GPUs a regenerate_shard job leases (one process runs on the first).

    Raises:
        ValueError: an unknown engine, a ``fuse`` other than true / false / ``"auto"``, ``memory_gib <= 0``, or
            ``num_answers > 1`` with greedy decoding.
    """

    SECTION: ClassVar[str] = "regenerate"
    max_new_tokens: int
    temperature: float
    top_p: float
    num_answers: int
    seed: int
    max_turns: int | None
    shards: int
    engine: str
    batch_size: int
    memory_gib: float | None
    fuse: bool | str
    chunk_size: int
    gpus: int

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


@dataclass(frozen=True)
class TargetOptions(SectionSettings):
    """The ``target`` keys of rule ``regenerate_shard``: how the target is loaded
    (:func:`draftsmith.target.load_target`; engine ``vllm`` passes ``dtype`` and ``trust_remote_code`` to vLLM)."""

    SECTION: ClassVar[str] = "target"
    dtype: str
    attn_implementation: str
    trust_remote_code: bool


@dataclass(frozen=True)
class TokenizeOptions(SectionSettings):
    """The ``tokenize`` keys of rule ``regenerate_shard``: the serving render of the prompts (the template kwargs
    tokenize renders the training rows with) and the tokenize stage's row length (the prompt limit,
    :attr:`RegenerateShardSettings.max_prompt_tokens`)."""

    SECTION: ClassVar[str] = "tokenize"
    chat_template_kwargs: Mapping
    max_length: int


@dataclass(frozen=True)
class RegenerateShardSettings(StageSettings):
    """Everything rule ``regenerate_shard`` reads (:mod:`draftsmith.regenerate.run`)."""

    STAGE: ClassVar[str] = "regenerate_shard"
    regenerate: RegenerateOptions
    target: TargetOptions
    tokenize: TokenizeOptions
    gpu: GpuOptions

    @property
    def max_prompt_tokens(self) -> int | None:
        """A turn whose serving prompt has this many tokens or more ends its conversation (``None`` = no limit):
        ``tokenize.max_length``, since the training row of a longer prompt would hold no answer token."""
        return self.tokenize.max_length


@dataclass(frozen=True)
class AssembleOptions(SectionSettings):
    """The ``regenerate`` key of the assembler rule ``regenerate``: ``shards``, the shard files it must be given."""

    SECTION: ClassVar[str] = "regenerate"
    shards: int


@dataclass(frozen=True)
class RegenerateSettings(StageSettings):
    """Everything the assembler rule ``regenerate`` reads (``scripts/regenerate.py``)."""

    STAGE: ClassVar[str] = "regenerate"
    regenerate: AssembleOptions
