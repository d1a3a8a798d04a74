"""Benchmark sets: which curated eval conversations are decoded, and how each becomes prompts.

A set is ``{source, max_prompts, max_new_tokens}`` from config ``evaluate.sets``:

* ``source: heldout`` = the held-out rows (curated ``eval.parquet``) of the sources whose
  ``split`` is ``both`` (the training mix's own distribution);
* any other value = the rows of that curated source (an eval-only benchmark: mtbench, humaneval,
  bfcl, mmath, tau2, ... or any source name).

Rows are taken in file order (curate writes them in a stable order), the first ``max_prompts``
conversations whose first prompt fits ``evaluate.max_prompt_tokens`` (longer ones are skipped and counted,
so the held-out set can be held to the prompt lengths training saw). Each conversation gives one or more
*turns*:

* a row with an assistant turn: prompt = the messages before the last assistant turn (the reference
  answer is not shown), one turn;
* a prompt-only row (user turns, no assistant turn; MT-Bench, tau2): each user turn in order, each
  asked after the target's own answer to the previous one (MT-Bench's curated rows hold both questions).

Rendering uses ``draftsmith.chat.render_prompt`` with the chat template kwargs recorded in the
tokenized parquet's metadata, so evaluation prompts are the exact serving render of training (a
thinking on/off mismatch is a known silent failure, z-lab/dflash#133).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Callable, Mapping

import pyarrow.parquet as pq

from draftsmith.config import HELDOUT, schema_entry_defaults  # HELDOUT: the held-out set's source, one definition
from draftsmith.io import CURATED_PARQUET, reading

log = logging.getLogger("draftsmith.evaluate")


SKIP_TEMPLATE_ERROR = "template_error"  # tokenize's drop reason for the same failure


@lru_cache(maxsize=None)
def _set_defaults() -> Mapping[str, Any]:
    """A set's defaults (``max_prompts``, ``max_new_tokens``), from the schema's ``evaluate.sets`` entries."""
    return MappingProxyType(schema_entry_defaults("evaluate", "sets"))


@dataclass
class Conversation:
    """One benchmark conversation.

    Attributes:
        id: curated row id.
        source: curated source name.
        context: messages before the first asked turn (system prompt, earlier reference turns).
        user_turns: user messages asked one after the other, each after the target's answer to the
            previous (length 1 for rows with a reference answer: the last user-side message block).
        tools: JSON string of the tool schemas, or None.
    """

    id: str
    source: str
    context: list[dict]
    user_turns: list[list[dict]]
    tools: str | None = None


@dataclass
class BenchmarkSet:
    """A benchmark set: its conversations and the rows skipped while reading it (by reason)."""

    name: str
    source: str
    max_prompts: int
    max_new_tokens: int
    conversations: list[Conversation] = field(default_factory=list)
    rows_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    #: the ids of the skipped rows, by reason (the report lists them)
    skipped_ids: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, row_id: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.skipped_ids.setdefault(reason, []).append(row_id)
        log.warning("set %s: row %s skipped (%s) %s", self.name, row_id, reason, detail)


def set_config(name: str, cfg: Mapping) -> dict:
    """A set's config with the schema's defaults filled in (``evaluate.sets`` entries: ``max_prompts``,
    ``max_new_tokens``).

    Raises:
        ValueError: no ``source``, or a non-positive size.
    """
    if not isinstance(cfg, Mapping) or not cfg.get("source"):
        raise ValueError(f"evaluate.sets.{name}: needs a 'source' (heldout or a curated source name)")
    out = {**_set_defaults(), **cfg}
    for key in ("max_prompts", "max_new_tokens"):
        if int(out[key]) < 1:
            raise ValueError(f"evaluate.sets.{name}.{key} must be >= 1, got {out[key]}")
    return out


def _clean(message: dict) -> dict:
    return {k: v for k, v in message.items() if v is not None}


def split_conversation(row_id: str, source: str, messages: list[dict], tools: str | None) -> Conversation | None:
    """Turn a curated row into a :class:`Conversation`; ``None`` when it has no user turn to ask.

    Args:
        messages: curated messages (Arrow structs as dicts; null fields allowed). In a prompt-only row
            (no assistant message) each user message starts a turn, asked after the target's answer to
            the one before (MT-Bench's two turns).
    """
    messages = [_clean(m) for m in messages]
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last_assistant is not None:
        prompt = messages[:last_assistant]
        if not any(m.get("role") == "user" for m in prompt):
            return None
        turns = [prompt]
        context: list[dict] = []
    else:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            return None
        context = messages[:users[0]]
        bounds = users[1:] + [len(messages)]
        turns = [messages[u:b] for u, b in zip(users, bounds)]
    if last_assistant is not None:
        return Conversation(row_id, source, [], turns, tools)
    return Conversation(row_id, source, context, turns, tools)


def load_sets(curated_eval: str, sets: Mapping[str, Mapping], *, heldout_sources: list[str],
              first_prompt_fits: Callable[[Conversation, int], bool] | None = None) -> list[BenchmarkSet]:
    """Read the benchmark sets from the curated eval parquet.

    Args:
        curated_eval: path of ``results/curated/eval.parquet``.
        sets: config ``evaluate.sets`` (name -> {source, max_prompts, max_new_tokens}).
        heldout_sources: names of the ``split: both`` sources (the ``heldout`` set).
        first_prompt_fits: ``(conversation, max_new_tokens) -> bool``; a conversation whose first prompt does
            not fit is skipped (reason ``prompt_too_long``) and does not count towards ``max_prompts``, so a
            set is filled with prompts of the length the drafter was trained on; one whose first prompt the chat
            template refuses (:class:`PromptTemplateError`) is skipped as ``template_error``, as tokenize drops
            it.

    Returns:
        One :class:`BenchmarkSet` per configured set, in config order. ``rows_read`` counts the rows
        of the set's source(s) considered; rows_read = len(conversations) + sum(skipped) (rows past
        ``max_prompts`` are not read).

    Raises:
        ValueError: a set names a source with no row in the eval split (names the file and source).
        InputError: the curated eval parquet is not readable (truncated, damaged), naming it.
    """
    with reading(curated_eval, CURATED_PARQUET):
        rows = pq.read_table(curated_eval, columns=["id", "source", "messages", "tools"]).to_pylist()
    by_source: dict[str, list[dict]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row)
    out = []
    for name, raw in sets.items():
        cfg = set_config(name, raw)
        bset = BenchmarkSet(name, cfg["source"], int(cfg["max_prompts"]), int(cfg["max_new_tokens"]))
        if cfg["source"] == HELDOUT:
            wanted = [s for s in heldout_sources if s in by_source]
            if not heldout_sources:
                raise ValueError(f"evaluate.sets.{name}: source heldout but no data source has split: both")
            candidates = [r for r in rows if r["source"] in set(wanted)]
        else:
            candidates = by_source.get(cfg["source"], [])
        if not candidates:
            raise ValueError(f"{curated_eval}: evaluate.sets.{name} wants source {cfg['source']!r} but the eval "
                             f"split has no row of it (sources present: {sorted(by_source)})")
        for row in candidates:
            if len(bset.conversations) >= bset.max_prompts:
                break
            bset.rows_read += 1
            conv = split_conversation(row["id"], row["source"], row["messages"] or [], row["tools"])
            if conv is None:
                bset.skip("no_user_turn", row["id"])
                continue
            try:
                fits = first_prompt_fits is None or first_prompt_fits(conv, bset.max_new_tokens)
            except PromptTemplateError as exc:
                bset.skip(SKIP_TEMPLATE_ERROR, row["id"], f"({exc})")
                continue
            if not fits:
                bset.skip("prompt_too_long", row["id"], "(first prompt longer than evaluate.max_prompt_tokens)")
                continue
            bset.conversations.append(conv)
        out.append(bset)
    return out


class PromptTemplateError(Exception):
    """The target's chat template raised on one prompt (jinja ``raise_exception`` such as "Conversation roles must
    alternate", an undefined field, ...): that prompt is skipped, counted as ``template_error``."""


def render(tokenizer, messages: list[dict], tools: Any, chat_template_kwargs: dict) -> list[int]:
    """Serving render of a prompt (generation prompt appended) -> token ids.

    Uses ``draftsmith.chat.render_prompt`` (the tokenize stage's own render, tool-call arguments
    parsed to dicts, null fields dropped).

    Raises:
        PromptTemplateError: the chat template raised on these messages (tokenize drops such a conversation as
            ``template_error`` too).
        draftsmith.chat.TemplateError: the tokenizer has no chat template; ValueError: bad
            ``tokenize.chat_template_kwargs`` (both fail every prompt: they stop evaluate).
    """
    from draftsmith.chat import TemplateError, check_template_kwargs, render_prompt

    check_template_kwargs(chat_template_kwargs)
    try:
        return list(render_prompt(tokenizer, messages, tools, chat_template_kwargs))
    except TemplateError:
        raise
    except Exception as exc:  # whatever the template raises on this prompt, as tokenize's template_error
        raise PromptTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

