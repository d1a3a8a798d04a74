"""The configuration the evaluate stage reads: :class:`EvaluateSettings`, its ``evaluate`` and ``target`` sections and
``drafter.init_from``.

Fields are exactly the keys :data:`draftsmith.stages.STAGE_KEYS` lists for rule ``evaluate`` (output and runtime);
defaults come from the schema (``schemas/config.schema.yaml``). ``scripts/evaluate.py`` builds it once
(:meth:`~draftsmith.settings.StageSettings.from_rule`), library callers and tests with
:meth:`~draftsmith.settings.StageSettings.from_config`; decoding workers get it as JSON (``to_dict()``) and
rebuild it. ``evaluate.sets`` stays a mapping in config order (the report lists the sets in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from draftsmith.config import REMOVED_STOP_TOKENS
from draftsmith.gpu import GpuOptions
from draftsmith.settings import SectionSettings, StageSettings, freeze


@dataclass(frozen=True)
class EvaluateOptions(SectionSettings):
    """Config ``evaluate``: sampling, the prompt-lookup reference drafter, the verify width, the benchmark sets, the
    target's MTP head (output keys); decoding workers, rollback, static cache, progress and save cadence (runtime
    keys). ``mtp`` is normalised to ``{"num_speculative_tokens": [...]}`` (the schema's default when left out).

    Raises:
        ValueError: ``stop_tokens`` set (:data:`draftsmith.config.REMOVED_STOP_TOKENS`: the key is no longer read);
            an ``evaluate.mtp`` key other than ``num_speculative_tokens``, or a value that is not distinct integers in
            1..15.
    """

    SECTION: ClassVar[str] = "evaluate"
    temperature: float
    top_p: float
    top_k: int
    prompt_lookup_ngram: int
    prompt_lookup_num_tokens: int | None  # None: the verify width - 1
    block_size: int | None  # the verify width B; None: the drafter's dflash_config.block_size
    seed: int
    max_prompt_tokens: int | None  # None: the target's max_position_embeddings
    stop_tokens: tuple[str, ...]  # removed: must stay empty
    only: tuple[str, ...] | None  # the sets chosen (draftsmith.config.check_config left only these in sets)
    sets: Mapping[str, Mapping[str, Any]]  # name -> {source, max_prompts, max_new_tokens}, in config order
    mtp: Mapping[str, Any]  # {num_speculative_tokens: [k, ...]}: the target's MTP head, one decoding per k
    gpus: int
    workers_per_gpu: int  # decoding processes sharing each GPU (runtime: τ unchanged, timings shared)
    rollback: str
    static_cache: str
    progress_interval: float  # seconds
    checkpoint_interval: float  # seconds

    def __post_init__(self) -> None:
        if self.stop_tokens:
            raise ValueError(REMOVED_STOP_TOKENS)
        mtp = dict(self.mtp or {})
        unknown = sorted(set(mtp) - {"num_speculative_tokens"})
        if unknown:
            raise ValueError(f"evaluate.mtp.{unknown[0]}: no such key (evaluate.mtp has num_speculative_tokens)")
        tokens = mtp.get("num_speculative_tokens", (1, 2, 3))
        if (not isinstance(tokens, (list, tuple)) or len(set(tokens)) != len(tokens)
                or not all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 15 for k in tokens)):
            shown = list(tokens) if isinstance(tokens, tuple) else tokens
            raise ValueError(f"evaluate.mtp.num_speculative_tokens: {shown!r} is not a list of distinct integers in "
                             "1..15")
        object.__setattr__(self, "mtp", freeze({"num_speculative_tokens": list(tokens)}))

    @property
    def mtp_tokens(self) -> list[int]:
        """``evaluate.mtp.num_speculative_tokens``: the MTP head's drafts per step, one decoding per entry."""
        return list(self.mtp["num_speculative_tokens"])


@dataclass(frozen=True)
class TargetOptions(SectionSettings):
    """Config ``target``: how the target is loaded for decoding."""

    SECTION: ClassVar[str] = "target"
    dtype: str
    attn_implementation: str
    trust_remote_code: bool


@dataclass(frozen=True)
class StartOptions(SectionSettings):
    """Config ``drafter.init_from``: the drafter training started from, decoded beside the trained one (the report's
    before -> after); None: no start, no extra decoding."""

    SECTION: ClassVar[str] = "drafter"
    init_from: str | None


@dataclass(frozen=True)
class EvaluateSettings(StageSettings):
    """Everything rule ``evaluate`` reads from the config."""

    STAGE: ClassVar[str] = "evaluate"
    evaluate: EvaluateOptions
    target: TargetOptions
    drafter: StartOptions
    gpu: GpuOptions
