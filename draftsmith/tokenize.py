"""tokenize: render conversations with the target's own chat template, with token-exact loss masks.

A drafter is only useful if it is trained on exactly the token sequences the target sees when it serves
(a thinking-on / thinking-off mismatch between training and evaluation is a known cause of drafters
that look good in training and fail in serving, z-lab/dflash#133). This module therefore never writes a
template-specific regex: every boundary comes from rendering the conversation with the target
tokenizer's own chat template (``apply_chat_template``), the same call a serving stack makes.

For each assistant message ``j`` of a conversation ``m``:

* **serving prompt** ``p_j`` = render(``m[:j]``, ``add_generation_prompt=True``): what the target is given;
* **turn render** ``t_j`` = render(``m[:j+1]``, ``add_generation_prompt=False``);
* **answer** ``a_j`` = ``t_j[len(p_j):]`` (requires ``t_j.startswith(p_j)``): the text the target generates,
  e.g. ``"Hello!<|im_end|>\\n"`` for ChatML, or ``"<think>\\n...\\n</think>\\n\\nHi<|im_end|>\\n"`` for
  Qwen3 with thinking on.

The **loss mask** is 1 exactly on the answer tokens up to and including the end-of-turn token: the answer's
*first* stop token (:func:`stop_token_ids`, the one stop policy regenerate and evaluate use too: the eos ids
of the tokenizer, ``config.json`` and ``generation_config.json`` plus the template's own end-of-turn token,
e.g. Llama 3's ``<|eot_id|>``), since the target never generates past it; an answer without any stop token
ends at its last special token. Tokens after it are 0 (the template's trailing ``"\\n"`` in ChatML, and the
rest of an answer whose own text holds a stop token, counted as ``rows.answers_with_stop_in_text``), as are
system, user and tool turns and the template's own assistant header (it is part of ``p_j``).

A conversation becomes **one row** (``id`` = conversation id) when the render is *prefix-stable*: the render
through the last assistant turn starts with every ``t_j`` (text), and its tokens start with
``tokens(p_j) + tokens(a_j)`` for every ``j`` that starts inside ``max_length`` (tokens; later turns are
truncated away). Templates that rewrite earlier turns (Qwen3 drops
past reasoning and renders an empty ``<think></think>`` only on the last turn) break that; such a
conversation falls back to **one row per assistant turn** (``id`` = ``<conv id>#<j>``, ``j`` the index of the
assistant message in ``messages``) whose tokens are ``tokens(p_j) + tokens(a_j)``, so in both modes the
training render of turn ``j`` is the serving render of its prompt followed by the reference answer tokens.

**Regenerated input** (:mod:`draftsmith.regenerated`): an assistant turn that carries the ids the target
generated is trained on as those ids, not as its text re-encoded (decode + encode need not give them back). Its
prompt is the serving prompt it was generated from, earlier generated answers as their ids
(:func:`draftsmith.chat.render_ids`, the render regenerate gave the target); after the ids, whose last is the stop
token the target emitted, comes what the template writes after its end-of-turn token (ChatML's ``"\\n"``), never a
second end-of-turn. The loss mask is 1 exactly on the generated ids. An answer cut at ``regenerate.max_new_tokens``
has no stop token: its ids are supervised and the row ends with them (as a row truncated at ``max_length`` ends;
no end-of-turn the target never produced). The report's ``generated`` section counts those turns, the cut ones and
their ids, which reconcile with regenerate's report; a conversation without generated ids (curated input,
``regenerate.enabled: false``, or conversations regenerate kept as they were) is tokenized as described above,
unchanged.

Rows over ``max_length`` are truncated (the first ``max_length`` tokens are kept: the target's hidden states
of a prefix do not depend on what follows) or dropped; rows without two consecutive supervised tokens are
dropped (a DFlash anchor ``a`` needs ``loss_mask[a]`` and ``loss_mask[a + 1]``, arXiv 2602.06036 / SpecForge);
a row whose answers render as the end-of-turn token alone is dropped as ``empty_answer`` (e.g. tool calls
given to a template without tool support, counted in ``answers.empty_with_tool_calls``). Every drop is
counted by reason in the report, and the counts reconcile:
conversations in = dropped + single-row + per-turn + prompt-only (eval split only: benchmark prompts without an
answer, e.g. MT-Bench, which evaluate asks; they give no row and are no drop); row candidates = rows kept +
rows dropped.

Output parquet (the contract of ``results/tokenized/{train,eval}.parquet``): ``id`` string, ``source``
string, ``input_ids`` list<int32>, ``loss_mask`` list<int8>, ``num_tokens`` int32, with schema metadata
``draftsmith.chat_template_kwargs``, ``draftsmith.tokenizer_fingerprint``, ``draftsmith.max_length`` (JSON).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import pickle
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq

from draftsmith.chat import (
    InvalidConversation,
    check_generation_prompt,
    check_template_kwargs,
    encode,
    end_of_turn_probe,
    end_of_turn_token_ids,
    generated_turns,
    load_tokenizer,
    parse_tools,
    render_ids,
    render_text,
    special_token_ids,
    stop_token_ids,
    template_messages,
    tokenizer_fingerprint,
)
from draftsmith.io import CURATED_PARQUET, atomic_path, reading, write_json
from draftsmith.progress import progress
from draftsmith.regenerated import GENERATED_IDS
from draftsmith.settings import SectionSettings, StageSettings, thaw
from draftsmith.tokenized import (
    TOKENIZED_SCHEMA,
    TokenizedRow,
    rows_table,
    tokenized_metadata,
)

log = logging.getLogger("draftsmith.tokenize")

REPORT_FORMAT = "draftsmith.tokenize-report/1"





# Conversation-level drop reasons (the conversation yields no row at all).
DROP_NO_ASSISTANT = "no_assistant_turn"
DROP_INVALID_ROW = "invalid_row"
DROP_DUPLICATE_ID = "duplicate_id"
DROP_TEMPLATE_ERROR = "template_error"
# Row-level drop reasons (a row candidate: a whole conversation, or one assistant turn in fallback mode).
DROP_NOT_AFTER_PROMPT = "answer_not_after_generation_prompt"
DROP_OVER_MAX_LENGTH = "over_max_length"
DROP_NO_PAIR = "no_supervised_pair"
DROP_EMPTY_ANSWER = "empty_answer"  # the template renders nothing but the end-of-turn (e.g. tool calls it ignores)
DROP_NO_PAIR_TRUNCATED = "no_supervised_pair_after_truncation"





# --------------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class TokenizeOptions(SectionSettings):
    """The ``tokenize`` keys the stage reads.

    ``max_length``: longest row in tokens (>= 2); ``overflow``: ``truncate`` (keep a longer row's first
    ``max_length`` tokens) or ``drop`` (drop it); ``chat_template_kwargs``: keyword arguments for the chat
    template (``enable_thinking`` ...), checked by :func:`check_template_kwargs`; ``threads``: worker processes.

    Raises:
        ValueError: ``max_length`` < 2 or an unknown ``overflow``.
    """

    SECTION: ClassVar[str] = "tokenize"
    max_length: int
    overflow: str
    chat_template_kwargs: Mapping[str, Any]
    threads: int

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"tokenize.max_length must be >= 2, got {self.max_length}")
        if self.overflow not in ("truncate", "drop"):
            raise ValueError(f"tokenize.overflow must be 'truncate' or 'drop', got {self.overflow!r}")


@dataclass(frozen=True)
class TokenizeTargetOptions(SectionSettings):
    """The ``target`` key the stage reads: ``trust_remote_code`` (allow tokenizer code from the target folder)."""

    SECTION: ClassVar[str] = "target"
    trust_remote_code: bool


@dataclass(frozen=True)
class TokenizeSettings(StageSettings):
    """What rule ``tokenize`` reads (:func:`run`)."""

    STAGE: ClassVar[str] = "tokenize"
    tokenize: TokenizeOptions
    target: TokenizeTargetOptions


def has_supervised_pair(mask: np.ndarray) -> bool:
    """True if some position t has ``mask[t] == mask[t + 1] == 1`` (an eligible DFlash anchor)."""
    return bool(mask.size > 1 and np.any((mask[:-1] != 0) & (mask[1:] != 0)))


# --------------------------------------------------------------------------------------------------
# Tokenizing conversations


@dataclass
class ConversationResult:
    """What one conversation turned into. ``mode`` is ``single`` / ``per_turn``, or ``None`` when the
    whole conversation was dropped (``drop`` = reason, ``detail`` = message naming the field)."""

    id: str
    source: str
    mode: str | None = None
    drop: str | None = None
    detail: str = ""
    rows: list[TokenizedRow] = field(default_factory=list)
    row_drops: list[tuple[str, int]] = field(default_factory=list)  # (reason, tokens before truncation)
    truncated_tokens: list[int] = field(default_factory=list)  # tokens cut per truncated kept row
    answers_without_end_of_turn: int = 0
    answers_with_stop_in_text: int = 0
    empty_answers: int = 0
    empty_tool_call_answers: int = 0
    unsupervised_leading_assistant: int = 0
    generated_turns: int = 0   # assistant turns carrying the target's generated ids (regenerated input)
    generated_cut: int = 0     # of those, answers without a stop token (cut at regenerate.max_new_tokens)
    generated_ids: int = 0     # ids of those answers, stop tokens included

    @property
    def candidates(self) -> int:
        return len(self.rows) + len(self.row_drops)


@dataclass
class _Turn:
    index: int          # index of the assistant message in messages
    prompt: str         # p_j
    turn: str           # t_j
    answer: str | None  # t_j[len(p_j):], None when t_j does not start with p_j
    tool_calls: bool = False
    prompt_ids: list[int] | None = None
    answer_ids: list[int] | None = None


@dataclass
class _Plan:
    res: ConversationResult
    turns: list[_Turn] = field(default_factory=list)
    full: str | None = None  # render through the last assistant turn, when prefix-stable as text
    full_ids: np.ndarray | None = None
    checked: list[_Turn] = field(default_factory=list)  # turns starting inside max_length (token-checked)

class ConversationTokenizer:
    """Turns curated conversations into rows with token-exact loss masks (see the module docstring).

    Args:
        tokenizer: the target's Hugging Face tokenizer (fast tokenizers batch-encode in Rust).
        options: ``chat_template_kwargs`` (keyword arguments for the template, ``enable_thinking`` ...),
            ``max_length`` (longest row in tokens) and ``overflow`` (``truncate``: keep the first ``max_length``
            tokens, or ``drop``) of :class:`TokenizeOptions`.
        stop_ids: stop token ids (default :func:`stop_token_ids`, the policy regenerate and evaluate share);
            the first one in an answer ends its mask.

    Raises:
        ValueError: bad template kwargs.
    """

    def __init__(self, tokenizer, options: TokenizeOptions, *, stop_ids: Iterable[int] | None = None):
        self.tokenizer = tokenizer
        self.kwargs = check_template_kwargs(thaw(options.chat_template_kwargs))
        self.max_length = int(options.max_length)
        self.overflow = options.overflow
        stop = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, chat_template_kwargs=self.kwargs)
        self.stop_ids = np.array(sorted(set(stop)), dtype=np.int64)
        self.special_ids = np.array(sorted(special_token_ids(tokenizer)), dtype=np.int64)
        # tokens the template writes after its end-of-turn token (ChatML: its "\n"); more than that after an
        # answer's first stop token means the answer's own text held a stop token
        self.template_tail = end_of_turn_probe(tokenizer, self.kwargs)[1]

    # -- masks ------------------------------------------------------------------------------------

    def answer_mask(self, answer_ids: Sequence[int]) -> tuple[np.ndarray, bool]:
        """Loss mask [len(answer_ids)] int8 of one answer: 1 through its end-of-turn token, 0 after.

        The end-of-turn token is the answer's *first* stop token (the target stops there, so nothing after
        it is ever generated: an answer whose text holds a stop token is supervised up to that one only),
        else, for an answer without any stop token, its last special token; an answer with neither is
        supervised whole (second value ``False``, counted in the report).
        """
        ids = np.asarray(answer_ids, dtype=np.int64)
        mask = np.ones(len(ids), dtype=np.int8)
        hits = np.flatnonzero(np.isin(ids, self.stop_ids))
        if hits.size:
            mask[hits[0] + 1:] = 0
            return mask, True
        hits = np.flatnonzero(np.isin(ids, self.special_ids))
        if hits.size:
            mask[hits[-1] + 1:] = 0
            return mask, True
        return mask, False

    # -- rendering --------------------------------------------------------------------------------

    def _plan(self, record: dict) -> _Plan:
        plan = _Plan(ConversationResult(id=record["id"], source=record.get("source") or ""))
        res = plan.res
        try:
            messages = template_messages(record.get("messages"))
            tools = parse_tools(record.get("tools"))
        except InvalidConversation as exc:
            res.drop, res.detail = exc.reason, str(exc)
            return plan
        raw = record["messages"]
        if any(isinstance(m, dict) and m.get(GENERATED_IDS) is not None for m in raw):
            self._plan_generated(res, raw, messages, tools)
            return plan
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if assistant and assistant[0] == 0:  # no prompt before it: context only, never supervised
            res.unsupervised_leading_assistant = 1
            assistant = assistant[1:]
        if not assistant:
            res.drop, res.detail = DROP_NO_ASSISTANT, "no assistant message after a prompt"
            return plan
        try:
            for j in assistant:
                prompt = render_text(self.tokenizer, messages[:j], tools, self.kwargs, add_generation_prompt=True)
                turn = render_text(self.tokenizer, messages[:j + 1], tools, self.kwargs, add_generation_prompt=False)
                plan.turns.append(_Turn(j, prompt, turn, turn[len(prompt):] if turn.startswith(prompt) else None,
                                        bool(messages[j].get("tool_calls"))))
        except Exception as exc:  # jinja raise_exception(), undefined fields ...: the template refuses it
            res.drop, res.detail = DROP_TEMPLATE_ERROR, f"chat template failed: {type(exc).__name__}: {exc}"
            plan.turns = []
            return plan
        full = plan.turns[-1].turn
        if all(t.answer is not None and full.startswith(t.turn) for t in plan.turns):
            plan.full = full
        return plan

    def _plan_generated(self, res: ConversationResult, raw: list[dict], messages: list[dict],
                        tools: list | None) -> None:
        """Rows of a conversation whose assistant turns carry the ids the target generated (regenerated input,
        :mod:`draftsmith.regenerated`), built here (``res.mode`` set, or ``res.drop``).

        Turn ``j``'s row is its serving prompt ``P_j`` (:func:`render_ids`: earlier generated answers as their ids)
        followed by its answer. A generated answer is exactly its ids, then what the template writes after its
        end-of-turn (the target's stop token stands in for the template's); the loss mask is 1 on the ids (the
        stop token included) and 0 after. An answer cut at ``max_new_tokens`` (no stop token) ends the row: its ids
        are supervised and nothing follows, as a row truncated at ``max_length`` ends. A turn without ids (a kept
        tool-call turn) is the template's text answer, masked by :meth:`answer_mask`. One row when every turn's
        ``P_j`` + answer is a prefix of the last one's (always, between generated turns of a prefix-stable
        template), else one row per turn.
        """
        try:
            generated = set(generated_turns(raw, self.stop_ids.tolist()))
        except InvalidConversation as exc:
            res.drop, res.detail = exc.reason, str(exc)
            return
        stops = set(self.stop_ids.tolist())
        for i in generated:
            ids = raw[i][GENERATED_IDS]
            res.generated_turns += 1
            res.generated_ids += len(ids)
            res.generated_cut += int(int(ids[-1]) not in stops)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if assistant and assistant[0] == 0:  # no prompt before it: context only, never supervised
            res.unsupervised_leading_assistant = 1
            assistant = assistant[1:]
        if not assistant:
            res.drop, res.detail = DROP_NO_ASSISTANT, "no assistant message after a prompt"
            return
        memo: dict = {}
        turns = []  # (j, prompt ids, answer ids or None, answer mask)
        try:
            for j in assistant:
                prompt = render_ids(self.tokenizer, raw[:j], tools, self.kwargs, add_generation_prompt=True,
                                    stop_ids=sorted(stops), memo=memo)
                if j in generated:
                    answer = render_ids(self.tokenizer, raw[:j + 1], tools, self.kwargs,
                                        add_generation_prompt=False, stop_ids=sorted(stops), memo=memo)[len(prompt):]
                    mask = np.zeros(len(answer), dtype=np.int8)
                    mask[:len(raw[j][GENERATED_IDS])] = 1
                    turns.append((j, prompt, answer, mask))
                    continue
                p = render_text(self.tokenizer, messages[:j], tools, self.kwargs, add_generation_prompt=True)
                t = render_text(self.tokenizer, messages[:j + 1], tools, self.kwargs, add_generation_prompt=False)
                if not t.startswith(p):
                    turns.append((j, prompt, None, None))
                    continue
                answer = encode(self.tokenizer, [t[len(p):]])[0]
                mask, found = self.answer_mask(answer)
                self._count_answer(res, bool(messages[j].get("tool_calls")), mask, found)
                turns.append((j, prompt, answer, mask))
        except InvalidConversation as exc:
            res.drop, res.detail = exc.reason, str(exc)
            return
        except Exception as exc:  # jinja raise_exception(), undefined fields ...: the template refuses it
            res.drop, res.detail = DROP_TEMPLATE_ERROR, f"chat template failed: {type(exc).__name__}: {exc}"
            return
        _, p_last, a_last, _ = turns[-1]
        full = p_last + a_last if a_last is not None else None
        if full is not None and all(a is not None and full[:len(p) + len(a)] == p + a for _, p, a, _ in turns):
            res.mode = "single"
            mask = np.zeros(len(full), dtype=np.int8)
            for _, p, a, m in turns:
                mask[len(p):len(p) + len(a)] = m
            empty = all(int(m.sum()) <= 1 for _, _, _, m in turns)
            self._add_row(res, res.id, np.asarray(full, dtype=np.int32), mask, empty)
            return
        res.mode = "per_turn"
        for j, p, a, m in turns:
            if a is None:
                res.row_drops.append((DROP_NOT_AFTER_PROMPT, 0))
                continue
            row_ids = np.asarray(p + a, dtype=np.int32)
            self._add_row(res, f"{res.id}#{j}", row_ids, np.concatenate([np.zeros(len(p), dtype=np.int8), m]),
                          int(m.sum()) <= 1)

    def _encode_turns(self, turns: list[_Turn]) -> None:
        texts = [x for t in turns for x in (t.prompt, t.answer)]
        ids = encode(self.tokenizer, texts)
        for k, t in enumerate(turns):
            t.prompt_ids, t.answer_ids = ids[2 * k], ids[2 * k + 1]

    def tokenize_batch(self, records: Sequence[dict]) -> list[ConversationResult]:
        """Tokenize curated records (dicts with ``id``, ``source``, ``messages``, ``tools``), in order.

        The texts of the whole batch are encoded together, in batched calls of the (fast) tokenizer.
        Token checks of a prefix-stable conversation cover the assistant turns that start inside
        ``max_length`` (found from the character offsets of its full encoding); the others are cut by
        truncation anyway (or the row is dropped whole in ``overflow: drop`` mode), so their quadratic
        prefix encodings are skipped.
        """
        plans = [self._plan(r) for r in records]
        live = [p for p in plans if not p.res.drop]
        stable = [p for p in live if p.full is not None]
        # 1. the full render of the text-stable conversations, with character offsets
        if stable:
            fast = getattr(self.tokenizer, "is_fast", False)
            enc = self.tokenizer([p.full for p in stable], add_special_tokens=False, return_attention_mask=False,
                                 return_offsets_mapping=fast)
            for i, p in enumerate(stable):
                p.full_ids = np.asarray(enc["input_ids"][i], dtype=np.int32)
                n = len(p.full_ids)
                if self.overflow == "drop" and n > self.max_length:
                    continue  # dropped whole as over_max_length: nothing to check
                for t in p.turns:
                    c = len(t.prompt)
                    k = enc.char_to_token(i, c) if fast and c < len(p.full) else None
                    if k is None:
                        k = 0 if c < len(p.full) else n
                    if k < self.max_length:
                        p.checked.append(t)
        # 2. prompt and answer tokens: checked turns of stable conversations, every turn of the others
        self._encode_turns([t for p in stable for t in p.checked]
                           + [t for p in live if p.full is None for t in p.turns if t.answer is not None])
        # 3. rows; a token-unstable conversation falls back to rows per turn
        fallback = [p for p in stable if not self._build_single(p)]
        self._encode_turns([t for p in fallback for t in p.turns if t.answer is not None and t.prompt_ids is None])
        for p in live:
            if p.res.mode is None:
                self._build_per_turn(p)
        return [p.res for p in plans]

    def _build_single(self, plan: _Plan) -> bool:
        res, full_ids = plan.res, plan.full_ids
        if self.overflow == "drop" and len(full_ids) > self.max_length:
            res.mode = "single"
            res.row_drops.append((DROP_OVER_MAX_LENGTH, len(full_ids)))
            return True
        mask = np.zeros(len(full_ids), dtype=np.int8)
        masks = []
        for t in plan.checked:
            start, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.answer_ids)
            if (end > len(full_ids) or not np.array_equal(full_ids[:start], t.prompt_ids)
                    or not np.array_equal(full_ids[start:end], t.answer_ids)):
                return False
            answer_mask, found = self.answer_mask(t.answer_ids)
            masks.append((t, answer_mask, found))
            mask[start:end] = answer_mask
        res.mode = "single"
        for t, answer_mask, found in masks:
            self._count_answer(res, t.tool_calls, answer_mask, found)
        empty = bool(masks) and all(int(m.sum()) <= 1 for _, m, _ in masks)
        self._add_row(res, res.id, full_ids, mask, empty)
        return True

    def _count_answer(self, res: ConversationResult, tool_calls: bool, answer_mask: np.ndarray, found: bool) -> None:
        res.answers_without_end_of_turn += int(not found)
        masked = len(answer_mask) - int(answer_mask.sum())
        if found and self.template_tail is not None and masked > self.template_tail:
            res.answers_with_stop_in_text += 1  # supervised through its text's first stop token only
        if int(answer_mask.sum()) <= 1:  # the end-of-turn token alone
            res.empty_answers += 1
            res.empty_tool_call_answers += int(tool_calls)

    def _build_per_turn(self, plan: _Plan) -> None:
        res = plan.res
        res.mode = "per_turn"
        for t in plan.turns:
            if t.answer is None:
                res.row_drops.append((DROP_NOT_AFTER_PROMPT, 0))
                continue
            answer_mask, found = self.answer_mask(t.answer_ids)
            self._count_answer(res, t.tool_calls, answer_mask, found)
            row_ids = np.asarray(list(t.prompt_ids) + list(t.answer_ids), dtype=np.int32)
            mask = np.concatenate([np.zeros(len(t.prompt_ids), dtype=np.int8), answer_mask])
            self._add_row(res, f"{res.id}#{t.index}", row_ids, mask, int(answer_mask.sum()) <= 1)

    def _add_row(self, res: ConversationResult, row_id: str, ids: np.ndarray, mask: np.ndarray,
                 empty: bool = False) -> None:
        n = len(ids)
        truncated = 0
        if n > self.max_length:
            if self.overflow == "drop":
                res.row_drops.append((DROP_OVER_MAX_LENGTH, n))
                return
            truncated = n - self.max_length
            ids, mask = ids[:self.max_length], mask[:self.max_length]
        if not has_supervised_pair(mask):
            reason = DROP_EMPTY_ANSWER if empty else DROP_NO_PAIR_TRUNCATED if truncated else DROP_NO_PAIR
            res.row_drops.append((reason, n))
            return
        if truncated:
            res.truncated_tokens.append(truncated)
        res.rows.append(TokenizedRow(row_id, res.source, ids, mask))


# --------------------------------------------------------------------------------------------------
# Counting


def length_bins(max_length: int) -> list[int]:
    """Histogram edges: 0, 64, 128, ... (powers of two) up to and including ``max_length`` + 1."""
    edges = [0]
    b = 64
    while b < max_length:
        edges.append(b)
        b *= 2
    edges.append(max_length + 1)
    return edges


class SplitStats:
    """Reconciled counts of one split (conversations, row candidates, tokens, drops by reason)."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.conversations_in = 0
        self.conv_drops: collections.Counter = collections.Counter()
        self.modes: collections.Counter = collections.Counter()
        self.with_rows = 0
        self.prompt_only = 0
        self.row_drops: collections.Counter = collections.Counter()
        self.row_drop_tokens: collections.Counter = collections.Counter()
        self.row_candidates = 0
        self.rows_kept = 0
        self.tokens = 0
        self.supervised = 0
        self.truncated_rows = 0
        self.truncated_tokens = 0
        self.answers_without_end_of_turn = 0
        self.answers_with_stop_in_text = 0
        self.empty_answers = 0
        self.empty_tool_call_answers = 0
        self.unsupervised_leading_assistant = 0
        self.generated: collections.Counter = collections.Counter()
        self.lengths: list[int] = []
        self.per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, res: ConversationResult) -> None:
        self.conversations_in += 1
        src = self.per_source[res.source]
        src["conversations_in"] += 1
        self.generated.update(turns=res.generated_turns, cut_at_max_new_tokens=res.generated_cut,
                              ids=res.generated_ids)
        if res.drop:
            self.conv_drops[res.drop] += 1
            src["conversations_dropped"] += 1
            return
        self.modes[res.mode] += 1
        self.with_rows += bool(res.rows)
        self.row_candidates += res.candidates
        for reason, tokens in res.row_drops:
            self.row_drops[reason] += 1
            self.row_drop_tokens[reason] += tokens
        self.truncated_rows += len(res.truncated_tokens)
        self.truncated_tokens += sum(res.truncated_tokens)
        self.answers_without_end_of_turn += res.answers_without_end_of_turn
        self.answers_with_stop_in_text += res.answers_with_stop_in_text
        self.empty_answers += res.empty_answers
        self.empty_tool_call_answers += res.empty_tool_call_answers
        self.unsupervised_leading_assistant += res.unsupervised_leading_assistant
        for row in res.rows:
            n = len(row.input_ids)
            s = int(row.loss_mask.sum())
            self.rows_kept += 1
            self.tokens += n
            self.supervised += s
            self.lengths.append(n)
            src["rows"] += 1
            src["tokens"] += n
            src["supervised_tokens"] += s
        src["rows_dropped"] += len(res.row_drops)

    def add_prompt_only(self, source: str) -> None:
        """Count a prompt-only conversation of the eval split (no row, not a drop)."""
        self.conversations_in += 1
        self.prompt_only += 1
        self.per_source[source]["conversations_in"] += 1
        self.per_source[source]["prompt_only"] += 1

    def drop_duplicate(self, source: str) -> None:
        self.conversations_in += 1
        self.conv_drops[DROP_DUPLICATE_ID] += 1
        self.per_source[source]["conversations_in"] += 1
        self.per_source[source]["conversations_dropped"] += 1

    def report(self) -> dict:
        """The split's section of ``report.json``; raises AssertionError if counts do not reconcile."""
        dropped = sum(self.conv_drops.values())
        if self.conversations_in != dropped + self.modes["single"] + self.modes["per_turn"] + self.prompt_only:
            raise AssertionError(f"conversation counts do not reconcile: {self.conversations_in} in, {dropped} "
                                 f"dropped, {dict(self.modes)} rendered")
        if self.row_candidates != self.rows_kept + sum(self.row_drops.values()):
            raise AssertionError(f"row counts do not reconcile: {self.row_candidates} candidates, "
                                 f"{self.rows_kept} kept, {dict(self.row_drops)} dropped")
        edges = length_bins(self.max_length)
        hist, _ = np.histogram(np.asarray(self.lengths, dtype=np.int64), bins=edges)
        return {
            "conversations": {
                "in": self.conversations_in,
                "dropped": dropped,
                "dropped_by_reason": dict(sorted(self.conv_drops.items())),
                "single_row": self.modes["single"],
                "prompt_only": self.prompt_only,  # eval split: benchmark prompts evaluate asks, no row
                "per_turn_fallback": self.modes["per_turn"],
                "with_rows": self.with_rows,
                "unsupervised_leading_assistant": self.unsupervised_leading_assistant,
            },
            "rows": {
                "candidates": self.row_candidates,
                "kept": self.rows_kept,
                "dropped": sum(self.row_drops.values()),
                "dropped_by_reason": dict(sorted(self.row_drops.items())),
                "dropped_tokens_by_reason": dict(sorted(self.row_drop_tokens.items())),
                "truncated": self.truncated_rows,
                "truncated_tokens": self.truncated_tokens,
                "answers_without_end_of_turn": self.answers_without_end_of_turn,
                # answers whose own text holds a stop token: supervised through that first stop only
                "answers_with_stop_in_text": self.answers_with_stop_in_text,
            },
            "answers": {
                # answers rendered as the end-of-turn token alone; with tool calls, the template ignores them
                "empty": self.empty_answers,
                "empty_with_tool_calls": self.empty_tool_call_answers,
            },
            "tokens": {
                "total": self.tokens,
                "supervised": self.supervised,
                "supervised_fraction": (self.supervised / self.tokens) if self.tokens else 0.0,
                "max_row": max(self.lengths, default=0),
                "mean_row": (self.tokens / self.rows_kept) if self.rows_kept else 0.0,
            },
            # the target's generated answers read (regenerated input, also of dropped conversations): turns =
            # regenerate's turns_regenerated, cut_at_max_new_tokens = its cut.hit_max_new_tokens, ids = its
            # tokens_generated + one stop token per answer that was not cut; they are trained on as generated
            "generated": {k: self.generated[k] for k in ("turns", "cut_at_max_new_tokens", "ids")},
            "length_histogram": [{"min": int(lo), "max": int(hi) - 1, "rows": int(n)}
                                 for lo, hi, n in zip(edges[:-1], edges[1:], hist)],
            "per_source": {k: dict(sorted(v.items())) for k, v in sorted(self.per_source.items())},
        }


# --------------------------------------------------------------------------------------------------
# Files

_WORKER: ConversationTokenizer | None = None


def _worker_init(worker_file: str) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread per worker process
    with open(worker_file, "rb") as f:  # written by worker_pool, this process's parent, for this pool
        _WORKER = pickle.load(f)


def _worker_run(records: list[dict]) -> list[ConversationResult]:
    assert _WORKER is not None
    return _WORKER.tokenize_batch(records)


def read_curated(path: str | os.PathLike, batch_size: int = 64) -> Iterator[list[dict]]:
    """Curated conversations of a parquet file as batches of dicts (``id``, ``source``, ``messages``, ``tools``).

    Raises:
        ValueError: a required column is missing (names the file and the column).
        InputError: the file is not a readable parquet (truncated, damaged), naming it.
    """
    with reading(path, CURATED_PARQUET):
        pf = pq.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        missing = [c for c in ("id", "messages") if c not in names]
        if missing:
            raise ValueError(f"{path}: curated parquet lacks column(s) {', '.join(missing)} (has {sorted(names)})")
        columns = [c for c in ("id", "source", "messages", "tools") if c in names]
        for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
            yield batch.to_pylist()


@contextlib.contextmanager
def worker_pool(worker: ConversationTokenizer, threads: int) -> Iterator[Any]:
    """``threads`` worker processes holding ``worker`` (a ``multiprocessing`` pool), or ``None`` for ``threads`` <= 1.

    ``forkserver``, not fork: a child forked while a thread of the caller (pyarrow's readers, the tokenizer's pool)
    holds a lock can wait on it forever (a CI run hung so). Each worker imports the caller's main module again (a
    script runs its work under ``if __name__ == "__main__":``, as scripts/tokenize.py does). ``worker`` goes to the
    processes as a pickle in a private temporary file, read by each in its initializer: sent as ``initargs`` (1.6
    MB), each process start waited for the process to import the main module and unpickle it, in series
    (docs/measurements.md, "Tokenization"). The fork server preloads this module and the tokenizer's class module.
    """
    if threads <= 1:
        yield None
        return
    ctx = multiprocessing.get_context("forkserver")
    # imported once, in the server, not per worker (a server already running keeps its first list)
    ctx.set_forkserver_preload(["draftsmith.tokenize", type(worker.tokenizer).__module__])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draftsmith-tokenize-") as tmp:
        worker_file = os.path.join(tmp, "worker.pickle")
        with open(worker_file, "wb") as f:
            pickle.dump(worker, f, protocol=pickle.HIGHEST_PROTOCOL)
        with ctx.Pool(threads, initializer=_worker_init, initargs=(worker_file,)) as pool:
            log.info("started %d tokenizer worker processes in %.1f s", threads, time.perf_counter() - t0)
            yield pool


def tokenize_file(input_path: str | os.PathLike, output_path: str | os.PathLike, worker: ConversationTokenizer, *,
                  fingerprint: str, threads: int = 1, batch_size: int = 64, log_examples: int = 5,
                  prompt_only_ok: bool = False, pool: Any = None, progress_interval: float = 30.0) -> dict:
    """Tokenize one curated parquet into one tokenized parquet (written atomically); returns its report.

    With ``threads`` > 1 the batches are spread over that many worker processes (:func:`worker_pool`, or
    ``pool``, one of its pools holding this ``worker``; chat templates render in Python, so threads would
    serialise on the GIL); output order is input order. A progress line (conversations done, rate, ETA) goes to
    the log every ``progress_interval`` seconds and at the end.

    With ``prompt_only_ok`` (the eval split) a conversation of user turns without any assistant answer
    (MT-Bench, tau2: evaluate asks them as prompts) gives no row and is counted as
    ``conversations.prompt_only``, not as a drop; in the train split it stays a ``no_assistant_turn`` drop.

    Raises:
        ValueError: unreadable input (missing column), see :func:`read_curated`.
        AssertionError: counts that do not reconcile (a bug, never silently written).
    """
    t0 = time.perf_counter()
    first = None  # seconds to the first batch back from the worker processes (their start-up included)
    stats = SplitStats(worker.max_length)
    schema = TOKENIZED_SCHEMA.with_metadata(tokenized_metadata(worker.kwargs, fingerprint, worker.max_length))
    seen: set[str] = set()
    examples: collections.Counter = collections.Counter()
    with reading(input_path, CURATED_PARQUET):  # an unreadable file is named here, before any work
        total = pq.ParquetFile(input_path).metadata.num_rows
    bar = progress(total, f"tokenize {os.path.basename(os.fspath(input_path))}", unit="conversation", logger=log,
                   interval=progress_interval)

    def batches() -> Iterator[list[dict]]:
        row = 0
        for batch in read_curated(input_path, batch_size):
            keep = []
            for rec in batch:
                rid = rec.get("id")
                if not isinstance(rid, str) or not rid:
                    stats.add(ConversationResult(id=f"<row {row}>", source=rec.get("source") or "",
                                                 drop=DROP_INVALID_ROW, detail="field id: missing or empty"))
                    _log_drop(examples, log_examples, input_path, row, DROP_INVALID_ROW, "field id: missing or empty")
                elif rid in seen:
                    stats.drop_duplicate(rec.get("source") or "")
                    _log_drop(examples, log_examples, input_path, row, DROP_DUPLICATE_ID, f"field id: {rid!r} repeats")
                else:
                    seen.add(rid)
                    rec["_row"] = row
                    keep.append(rec)
                row += 1
            bar.update(len(batch) - len(keep))  # the rows dropped here; the kept ones once tokenized
            if keep:
                yield keep

    with contextlib.closing(bar), atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, schema) as writer:
            pending: list[TokenizedRow] = []

            def consume(records: list[dict], results: list[ConversationResult]) -> None:
                for rec, res in zip(records, results):
                    if prompt_only_ok and res.drop == DROP_NO_ASSISTANT and _is_prompt_only(rec):
                        stats.add_prompt_only(res.source)
                        continue
                    stats.add(res)
                    if res.drop:
                        _log_drop(examples, log_examples, input_path, rec["_row"], res.drop,
                                  f"id {res.id}: {res.detail}")
                    pending.extend(res.rows)
                bar.update(len(records))
                if len(pending) >= 2048:
                    writer.write_table(rows_table(pending, schema))
                    pending.clear()

            with contextlib.ExitStack() as stack:
                if pool is None:
                    pool = stack.enter_context(worker_pool(worker, threads))
                if pool is None:
                    for records in batches():
                        consume(records, worker.tokenize_batch(records))
                else:
                    # results are consumed in input order; records wait alongside in a bounded queue
                    queue: collections.deque = collections.deque()

                    def take() -> None:
                        nonlocal first
                        recs, fut = queue.popleft()
                        consume(recs, fut.get())
                        first = time.perf_counter() - t0 if first is None else first

                    for records in batches():
                        queue.append((records, pool.apply_async(_worker_run, (records,))))
                        while len(queue) > 4 * max(threads, 1):
                            take()
                    while queue:
                        take()
            if pending:
                writer.write_table(rows_table(pending, schema))
    report = stats.report()
    report["seconds"] = round(time.perf_counter() - t0, 3)
    report["conversations_per_second"] = round(stats.conversations_in / max(report["seconds"], 1e-9), 1)
    if first is not None:
        log.info("%s: the first batch came back from the worker processes after %.1f s of %.1f s", input_path, first,
                 report["seconds"])
    return report


def _is_prompt_only(record: dict) -> bool:
    """A conversation with user turns and no assistant turn at all (a benchmark prompt, e.g. MT-Bench)."""
    roles = [m.get("role") for m in (record.get("messages") or []) if isinstance(m, dict)]
    return "user" in roles and "assistant" not in roles


def _log_drop(examples: collections.Counter, limit: int, path, row: int, reason: str, detail: str) -> None:
    examples[reason] += 1
    if examples[reason] <= limit:
        log.warning("%s row %d dropped (%s): %s", path, row, reason, detail)
    elif examples[reason] == limit + 1:
        log.warning("%s: further '%s' drops are counted in the report only", path, reason)


def run(*, train_in, eval_in, target_dir, train_out, eval_out, report_out, settings: TokenizeSettings) -> dict:
    """The tokenize stage: both splits plus ``report.json``, from the target folder's tokenizer (loaded with
    ``settings.target.trust_remote_code``), rendered and cut as ``settings.tokenize`` says
    (:class:`TokenizeOptions`), with ``settings.tokenize.threads`` worker processes.

    Raises:
        TemplateError: the target's tokenizer has no chat template / no generation prompt.
        ValueError: bad config values or unreadable inputs (naming the file).
    """
    options = settings.tokenize
    max_length, overflow, threads = options.max_length, options.overflow, options.threads
    tokenizer = load_tokenizer(target_dir, trust_remote_code=settings.target.trust_remote_code)
    kwargs = check_template_kwargs(thaw(options.chat_template_kwargs))
    generation_prompt = check_generation_prompt(tokenizer, kwargs)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stop_ids = stop_token_ids(tokenizer, target_dir, kwargs)
    worker = ConversationTokenizer(tokenizer, options, stop_ids=stop_ids)
    log.info("tokenizer %s (fingerprint %s), generation prompt %r, stop token ids %s, kwargs %s, "
             "max_length %d (%s), %d worker(s)", target_dir, fingerprint[:16], generation_prompt, stop_ids,
             kwargs, max_length, overflow, threads)
    report = {
        "format": REPORT_FORMAT,
        "target": str(target_dir),
        "tokenizer_fingerprint": fingerprint,
        "chat_template_kwargs": kwargs,
        "generation_prompt": generation_prompt,
        "stop_token_ids": stop_ids,  # the policy regenerate and evaluate use too (stop_token_ids)
        "end_of_turn_token_ids": end_of_turn_token_ids(tokenizer, kwargs),
        "max_length": max_length,
        "overflow": overflow,
        "splits": {},
    }
    with worker_pool(worker, threads) as pool:  # one pool for both splits: its start-up is paid once
        reports = {split: tokenize_file(src, dst, worker, fingerprint=fingerprint, threads=threads, pool=pool,
                                        prompt_only_ok=split == "eval")
                   for split, src, dst in (("train", train_in, train_out), ("eval", eval_in, eval_out))}
    for split, rep in reports.items():
        report["splits"][split] = rep
        c, r, t = rep["conversations"], rep["rows"], rep["tokens"]
        if c["prompt_only"]:
            log.info("%s: %d prompt-only conversations (user turns without an answer, e.g. MT-Bench, tau2) give no "
                     "row: evaluate asks them as prompts", split, c["prompt_only"])
        log.info("%s: %d conversations in -> %d single-row + %d per-turn fallback + %d dropped %s; rows %d kept "
                 "of %d (dropped %s, truncated %d); %d tokens, %.1f%% supervised; %.0f conversations/s",
                 split, c["in"], c["single_row"], c["per_turn_fallback"], c["dropped"], c["dropped_by_reason"],
                 r["kept"], r["candidates"], r["dropped_by_reason"], r["truncated"], t["total"],
                 100 * t["supervised_fraction"], rep["conversations_per_second"])
    write_json(report_out, report)
    return report
