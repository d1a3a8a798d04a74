"""Regenerate's turns: a conversation answered by the target turn by turn, and the batches that answer them.

:class:`Regenerator` takes curated records and answers every conversation's assistant text turns in order, each
from the serving prompt of the conversation *with the target's own earlier answers* (:class:`_Conv` is one
conversation's state), batching the pending turns of all conversations into one round of the engine
(:mod:`draftsmith.regenerate.engines`). Tool-call turns are kept verbatim; what ends a conversation early is counted
(:mod:`draftsmith.regenerate.report`).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Sequence

from draftsmith.chat import check_generation_prompt, check_template_kwargs, render_prompt, stop_token_ids
from draftsmith.regenerate.engines import ContinuousBatchingEngine, Engine, GenerateEngine
from draftsmith.regenerate.report import (
    CUT_EMPTY,
    CUT_MAX_NEW_TOKENS,
    CUT_MAX_TURNS,
    CUT_PROMPT_TOO_LONG,
    CUT_TEMPLATE_ERROR,
    DROP_NO_TURN_LEFT,
    DROP_UNSAMPLED_COPY,
)
from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.regenerate.static import StaticBatchEngine, resolve_engine
from draftsmith.regenerated import GENERATED_IDS

log = logging.getLogger("draftsmith.regenerate")


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


def _split_stop(ids: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """``(answer before the first stop token, whether a stop token ended it)``."""
    answer = []
    for t in ids:
        if t in stop_ids:
            return answer, True
        answer.append(int(t))
    return answer, False


class Regenerator:
    """Batched regeneration of assistant turns by the target (greedy unless a temperature is set).

    Args:
        model: the target (``AutoModelForCausalLM``, eval mode, on its device); None with a ready ``engine``.
        tokenizer: the target's tokenizer with its chat template.
        settings: the stage's settings (``regenerate``: the answers and the engine; ``tokenize``: the serving
            render's template kwargs and the prompt limit, :attr:`RegenerateShardSettings.max_prompt_tokens`).
        stop_ids: ids generation stops at (default :func:`stop_token_ids` of the tokenizer and template).
        engine: a ready generation engine (:class:`draftsmith.regenerate.engines.Engine`); default: the one
            ``settings.regenerate.engine`` names, built on ``model``.

    Raises:
        TemplateError: the template has no generation prompt (:func:`check_generation_prompt`).
        ValueError: no stop token, or no pad / eos id to left-pad with, or an engine that needs what is missing.
    """

    def __init__(self, model, tokenizer, settings: RegenerateShardSettings, stop_ids: Sequence[int] | None = None,
                 *, engine: Engine | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.kwargs = check_template_kwargs(settings.tokenize.chat_template_kwargs)
        check_generation_prompt(tokenizer, self.kwargs)
        self.stop_ids = sorted(set(stop_ids if stop_ids is not None
                                   else stop_token_ids(tokenizer, chat_template_kwargs=self.kwargs)))
        if not self.stop_ids:
            raise ValueError("the target has no eos / end-of-turn token id: generation could never stop")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.engine = engine if engine is not None else self._build_engine()
        self.progress = None  # a progress bar counting conversations (draftsmith.progress), set by regenerate_file
        self.fused = None  # what draftsmith.fused.fused_target changed while this regenerates (set by run)
        self._part_rows = 0  # conversations of the records being regenerated (the progress bar's in-flight part)

    def _build_engine(self) -> Engine:
        from transformers import GenerationConfig

        if self.model is None:
            raise ValueError("Regenerator needs a model or a ready engine")
        s = self.settings.regenerate
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
        raise ValueError(f"engine {name!r} loads the target itself: build a VLLMEngine and pass engine=")

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], int | None]]:
        """Continuation of each prompt (token ids) by the engine.

        Returns:
            Per prompt ``(answer_ids, stop_id)``: the generated ids before the first stop token, and the stop
            token that ended them (``None``: ``max_new_tokens`` was reached).
        """
        stops = set(self.stop_ids)
        bar, max_new = self.progress, self.settings.regenerate.max_new_tokens
        state = {"answers": 0, "rows": 0, "steps": 0}  # answers done; rows and decode steps of the batch in flight

        def show() -> None:  # the part in flight: done answers + the batch's steps of max_new, as conversations
            work = state["answers"] + state["rows"] * min(state["steps"], max_new) / max_new
            bar.set_partial(self._part_rows * min(work / len(prompts), 0.999))
            bar.set_postfix_str(f"{state['answers']}/{len(prompts)} answers of the part in flight (its conversations "
                                "count when it is saved)", refresh=False)

        def on_step(rows: int, steps: int, tokens: int) -> None:
            state["rows"], state["steps"] = rows, state["steps"] + steps
            bar.advance(**{"new tok": tokens})
            show()

        def on_done(n: int) -> None:
            state["answers"] += n
            state["rows"] = state["steps"] = 0
            show()

        out = self.engine.generate(prompts, on_done, on_step) if bar is not None else self.engine.generate(prompts)
        results = []
        for ids in out:
            answer, stopped = _split_stop(ids[:max_new], stops)
            results.append((answer, int(ids[len(answer)]) if stopped else None))
        return results

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
            max_turns = self.settings.regenerate.max_turns
            if max_turns is not None and conv.regenerated >= max_turns:
                conv.cut = CUT_MAX_TURNS
                return
            try:
                prompt = render_prompt(self.tokenizer, conv.out, conv.record.get("tools"), self.kwargs,
                                       stop_ids=self.stop_ids)
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
        self._part_rows = len(records)
        n = self.settings.regenerate.num_answers
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
            for c, (answer, stop) in zip(pending, results):
                c.prompt = None
                if not answer:
                    c.cut = CUT_EMPTY
                    continue
                original = c.messages[c.pos]
                # the ids are what tokenize trains on (decoding and encoding again need not give them back);
                # the text is for people
                c.out.append({**original, "content": self.decode(answer), "reasoning_content": None,
                              "tool_calls": None, GENERATED_IDS: answer + ([stop] if stop is not None else [])})
                c.pos += 1
                c.regenerated += 1
                stats["turns_regenerated"] += 1
                stats["tokens_generated"] += len(answer)
                if stop is None:
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
