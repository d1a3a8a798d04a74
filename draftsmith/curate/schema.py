"""The curated row schema, the drop reasons and the errors of the curate stage.

:data:`OUTPUT_SCHEMA` is the contract with tokenize, regenerate and evaluate.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

REPORT_FORMAT = "draftsmith.curate_report/1"
EXAMPLES_PER_REASON = 5

# ----------------------------------------------------------------------------------------------
# Output schema
# ----------------------------------------------------------------------------------------------

TOOL_CALL_TYPE = pa.struct([
    ("id", pa.string()),
    ("type", pa.string()),
    ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
])
MESSAGE_TYPE = pa.struct([
    ("role", pa.string()),
    ("content", pa.string()),
    ("reasoning_content", pa.string()),
    ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    ("tool_call_id", pa.string()),
    ("name", pa.string()),
])
OUTPUT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("messages", pa.list_(MESSAGE_TYPE)),
    ("tools", pa.string()),
])
"""Arrow schema of ``results/curated/{train,eval}.parquet`` (the curate contract)."""

DROP_REASONS = {
    "malformed_json": "the record is not valid JSON (file and line in the example)",
    "invalid_utf8": "text that is not valid UTF-8 (bad bytes or lone surrogate escapes)",
    "bad_record": "a required field is missing or has the wrong type",
    "unknown_role": "a message role that is not system / user / assistant / tool (or a known alias)",
    "unsupported_content": "a content part that is not text (e.g. an image)",
    "invalid_tool_call": "a tool call without a name, or whose arguments are not a JSON object",
    "invalid_tools": "a tools list that is not a list of function schemas",
    "no_assistant_turn": "no assistant turn with text or tool calls",
    "no_user_turn": "no user turn at all, or a prompt-only row (mtbench, tau2) not ending with one",
    "orphan_tool_reply": "a tool reply that answers no tool call: no assistant tool call before it, or a "
                         "tool_call_id that none of those calls has",
    "too_long": "more characters than data.max_chars",
    "duplicate": "same normalised messages + tools as an earlier row of the same source",
    "duplicate_across_sources": "same normalised messages + tools as a row kept from an earlier source",
    "max_samples": "not sampled: the source's max_samples was reached",
    "weight": "not sampled: the source's weight is below 1",
}
"""Every reason a row can be dropped for, with its meaning (copied into report.json)."""


class CurateError(RuntimeError):
    """A fatal problem: bad source configuration, or a source with no readable record at all.

    The message names the source and its path.
    """


class DropRow(Exception):
    """A row is invalid; ``reason`` is a key of :data:`DROP_REASONS`, ``detail`` says where/why."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A record a reader could not decode (yielded in place of the record)."""

    reason: str
    detail: str
