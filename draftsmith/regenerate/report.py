"""Regenerate's report: the counted outcomes of a run, their reconciliation, and the report stored in the output.

Every regenerated parquet (a shard's, :func:`draftsmith.regenerate.shards.regenerate_file`, or the assembled one,
:func:`draftsmith.regenerate.shards.assemble_shards`) holds its report as JSON in its Arrow metadata under
:data:`META_KEY` (:func:`read_report`); :func:`summary` is its log line. The counts (``counts`` of the report)
reconcile (:func:`check_counts`): conversations in = regenerated + kept original + dropped (``dropped.<reason>``);
assistant turns in = regenerated + kept (``turns_kept_tool_call``, ``turns_kept_without_prompt``) + removed by cuts
(``turns_removed_by_cut``; ``cut.<reason>`` per conversation). tokenize's report of the regenerated file counts the
same answers in its ``generated`` section: ``turns`` = ``turns_regenerated``, ``cut_at_max_new_tokens`` =
``cut.hit_max_new_tokens``, ``ids`` = ``tokens_generated`` + one stop token per answer that was not cut (the ids are
stored and trained on as generated, so no share of them "re-tokenizes" differently).
"""

from __future__ import annotations

import collections
import json
import os

import pyarrow.parquet as pq

from draftsmith.io import reading

META_KEY = b"draftsmith.regenerate"

# counted outcomes: why a conversation was dropped (``dropped.<reason>``) or ended early (``cut.<reason>``)
DROP_NO_TURN_LEFT = "no_assistant_turn_left"
DROP_UNSAMPLED_COPY = "answer_copy_without_sampled_turn"
CUT_MAX_NEW_TOKENS = "hit_max_new_tokens"
CUT_EMPTY = "empty_generation"
CUT_PROMPT_TOO_LONG = "prompt_over_max_prompt_tokens"
CUT_MAX_TURNS = "max_turns_reached"
CUT_TEMPLATE_ERROR = "template_error"

#: counts every regenerate of a list of records sets, even an empty one (an empty shard's counts)
BASE_COUNTS = ("records_in", "conversations_in", "turns_in")


def check_counts(stats: collections.Counter) -> None:
    """Check that ``stats`` reconcile (conversations and assistant turns, see the module docstring).

    Raises:
        AssertionError: they do not (the message holds the counts).
    """
    dropped = sum(v for k, v in stats.items() if k.startswith("dropped."))
    turns = (stats["turns_regenerated"] + stats["turns_kept_tool_call"] + stats["turns_kept_without_prompt"]
             + stats["turns_removed_by_cut"])
    if (stats["regenerated"] + stats["kept_original"] + dropped != stats["conversations_in"]
            or turns != stats["turns_in"]):
        raise AssertionError(f"regenerate counts do not reconcile: {dict(stats)}")


def read_report(path: str | os.PathLike) -> dict:
    """The regenerate report stored in a regenerated parquet's metadata (under :data:`META_KEY`).

    Raises:
        ValueError: the file holds no regenerate report (names the file).
        InputError: the file is not a readable parquet (truncated, damaged), naming it.
    """
    with reading(path, "a regenerated parquet written by rule regenerate"):
        meta = pq.read_schema(path).metadata or {}
    if META_KEY not in meta:
        raise ValueError(f"{path}: no {META_KEY.decode()} metadata (not written by the regenerate stage)")
    return json.loads(meta[META_KEY])


def summary(report: dict) -> str:
    """One log line of a regenerate report (a shard's or the assembled one): new tokens/s, conversations in /
    regenerated / kept / dropped by reason, turns and tokens, cuts by reason, seconds, and the static engine's
    prefill and decode rates when it ran."""
    c = report["counts"]
    shards = report.get("shards")
    where = (f"{len(shards)} shard{'s' if len(shards) != 1 else ''}: " if shards is not None
             else f"shard {report['shard']} of {report['num_shards']}: " if report.get("num_shards", 1) > 1 else "")
    dropped = {k: v for k, v in c.items() if k.startswith("dropped.")}
    cuts = {k: v for k, v in c.items() if k.startswith("cut.")}
    phases = report.get("static_engine") or {}
    engine = (f"; static engine: prefill {phases['prefill_tokens_per_s']:,.0f} tok/s ({phases['prefill_s']:.1f} s), "
              f"decode {phases['decode_ms_per_step']:.1f} ms a step at {phases['mean_rows']} rows on average "
              f"({phases['decode_s']:.1f} s, {phases['capture_s']:.1f} s of it graph captures)"
              if phases.get("decode_steps") and phases.get("prefill_s") else "")
    return (f"{where}{report['new_tokens_per_s']} new tokens/s; {c.get('conversations_in', 0)} conversations in -> "
            f"{c.get('regenerated', 0)} regenerated, {c.get('kept_original', 0)} kept original, dropped {dropped}; "
            f"{c.get('turns_regenerated', 0)} turns regenerated ({c.get('tokens_generated', 0)} tokens), "
            f"{c.get('turns_kept_tool_call', 0)} tool-call turns kept, cuts {cuts}; "
            f"{report['seconds']:.1f} s{engine}")
