"""Curate: mix chat, code, tool-calling and agentic sources into one clean chat dataset.

Stage ``curate`` of ``docs/design.md``. Every configured source is read by an *adapter* that turns its
records into OpenAI-style chat ``messages`` (roles ``system`` / ``user`` / ``assistant`` / ``tool``,
assistant ``tool_calls`` with JSON-string ``arguments``, optional ``reasoning_content``) plus an
optional ``tools`` list of function schemas. Every row is then normalised and validated; invalid rows
are dropped *with a reason*, exact duplicates (same normalised messages + tools, hence same id) are
dropped, ``max_samples`` and ``weight`` sample the source with a seed, and the train / eval split is
decided by a stable hash of the row id alone (so adding a source never moves an existing row).

Outputs (the contract read by tokenize / regenerate / evaluate):

- ``train.parquet`` / ``eval.parquet``, one row per conversation, Arrow schema :data:`OUTPUT_SCHEMA`:
  ``id`` (sha256 hex[:16] of the canonical JSON of messages + tools, :func:`conversation_id`),
  ``source`` (the source's config ``name``), ``messages`` (list<struct<role, content,
  reasoning_content, tool_calls, tool_call_id, name>>), ``tools`` (JSON string or null).
- ``report.json``: per source rows read, kept, dropped per reason (with up to
  :data:`EXAMPLES_PER_REASON` examples: origin ``file:line`` / ``file#record``, id when known,
  detail), rows written per split; ``read == kept + dropped`` and ``kept == train + eval`` are
  checked before the report is written.

Memory does not grow with the size of the conversations: sources are streamed record by record (a
JSON array is decoded element by element with ``json.JSONDecoder.raw_decode``); pass 1 spools each
valid row as one compact JSON line to a temporary file beside the outputs and keeps only its 8-byte id
(a ``uint64`` array; exact de-duplication needs the ids, so memory is ~8-16 bytes per valid row plus
one batch); pass 2 de-duplicates and samples on the id arrays with numpy and parses only the kept
lines with Arrow's C++ JSON reader. Outputs are written with ``pyarrow.parquet.ParquetWriter`` in row
groups to temporary names and renamed into place (:func:`draftsmith.io.atomic_path`).

Package layout: :mod:`.schema` (output schema, drop reasons, errors), :mod:`.readers` (streaming
readers), :mod:`.normalize` (validation, normalisation, row id), :mod:`.adapters` (``adapter:`` name ->
reader + converter, :data:`ADAPTERS`; each ``convert_*`` documents its mapping), :mod:`.pipeline`
(:func:`curate`: sources, de-duplication, sampling, split, outputs, report; its settings
:class:`CurateSettings`).

Row order in the outputs: grouped by source (config order), then the source's own order; the trainer
shuffles.
"""

from .adapters import (
    ADAPTERS,
    BFCL_TYPES,
    CHAMP_SYSTEM,
    CHAMP_USER,
    COLUMN_FIELDS,
    HUMANEVAL_USER,
    MMATH_PROMPTS,
    TOOLTALK_SYSTEM,
    Adapter,
    bfcl_arguments,
    bfcl_ground_truth_value,
    bfcl_schema,
    convert_alpaca,
    convert_auto,
    convert_bfcl,
    convert_champ,
    convert_humaneval,
    convert_mmath,
    convert_mtbench,
    convert_openai,
    convert_prompt_response,
    convert_sharegpt,
    convert_tau2,
    convert_tooltalk,
    iter_bfcl,
)
from .normalize import (
    ROLE_ALIASES,
    Conversation,
    canonical_json,
    conversation_id,
    normalize_conversation,
    normalize_tool_calls,
    normalize_tools,
)
from .pipeline import (
    ROW_GROUP_ROWS,
    SPLITS,
    CurateDataOptions,
    CurateSettings,
    Source,
    check_sources,
    curate,
    eval_mask,
    id_to_u64,
    plan_copies,
    sampling_keys,
    splitmix64,
)
from .readers import (
    is_hf_dataset_dir,
    iter_hf_disk,
    iter_json_array,
    iter_json_array_items,
    iter_json_document,
    iter_jsonl,
    iter_parquet,
    iter_records,
)
from .schema import (
    DROP_REASONS,
    EXAMPLES_PER_REASON,
    MESSAGE_TYPE,
    OUTPUT_SCHEMA,
    REPORT_FORMAT,
    TOOL_CALL_TYPE,
    CurateError,
    DropRow,
    Malformed,
)

__all__ = [
    "ADAPTERS", "BFCL_TYPES", "CHAMP_SYSTEM", "CHAMP_USER", "COLUMN_FIELDS", "DROP_REASONS",
    "EXAMPLES_PER_REASON", "HUMANEVAL_USER", "MESSAGE_TYPE", "MMATH_PROMPTS", "OUTPUT_SCHEMA",
    "REPORT_FORMAT", "ROLE_ALIASES", "ROW_GROUP_ROWS", "SPLITS", "TOOLTALK_SYSTEM", "TOOL_CALL_TYPE",
    "Adapter", "Conversation", "CurateDataOptions", "CurateError", "CurateSettings", "DropRow", "Malformed",
    "Source",
    "bfcl_arguments", "bfcl_ground_truth_value", "bfcl_schema", "canonical_json", "check_sources",
    "conversation_id",
    "convert_alpaca", "convert_auto", "convert_bfcl", "convert_champ", "convert_humaneval",
    "convert_mmath", "convert_mtbench", "convert_openai", "convert_prompt_response",
    "convert_sharegpt", "convert_tau2", "convert_tooltalk", "curate", "eval_mask", "id_to_u64",
    "is_hf_dataset_dir", "iter_bfcl", "iter_hf_disk", "iter_json_array", "iter_json_array_items",
    "iter_json_document", "iter_jsonl", "iter_parquet", "iter_records",
    "normalize_conversation", "normalize_tool_calls", "normalize_tools", "plan_copies",
    "sampling_keys", "splitmix64",
]
