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
  policy tokenize and evaluate share (:func:`draftsmith.tokenize.stop_token_ids`: eos ids plus the chat
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
(DESIGN.md), which still is the target's own greedy distribution; ``batch_size: 1`` is unpadded.

Resume: conversations are processed in parts of ``chunk_size``; each finished part is written atomically
to ``<output>.parts/part-NNNNNN.parquet`` with a key of everything that determines it (input sha256, target
fingerprint, settings). A killed job restarts from the first missing part; the output is assembled from the
parts atomically, then the parts are removed.
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

from draftsmith.target import target_fingerprint
from draftsmith.io import atomic_path, sha256_file
from draftsmith.tokenize import (check_generation_prompt, check_template_kwargs, render_prompt, stop_token_ids,
                                 tokenizer_fingerprint)

log = logging.getLogger("draftsmith.regenerate")

FORMAT = "draftsmith.regenerate/1"
META_KEY = b"draftsmith.regenerate"
PART_KEY = b"draftsmith.regenerate.part"

# counted outcomes
DROP_NO_TURN_LEFT = "no_assistant_turn_left"
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


@dataclass
class GenerationSettings:
    """Settings of one regenerate run.

    Args:
        max_new_tokens: generated tokens per assistant turn at most.
        batch_size: prompts generated together (left-padded).
        max_prompt_tokens: a turn whose serving prompt has this many tokens or more ends its conversation
            (``None`` = no limit); the workflow passes ``tokenize.max_length``.
        max_turns: regenerate at most this many assistant turns per conversation (``None`` = all).
        chat_template_kwargs: the template kwargs of the tokenize stage (``enable_thinking`` ...).
    """

    max_new_tokens: int = 256
    batch_size: int = 16
    max_prompt_tokens: int | None = None
    max_turns: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)


class Regenerator:
    """Greedy, batched regeneration of assistant turns with a Hugging Face causal LM.

    Args:
        model: the target (``AutoModelForCausalLM``, eval mode, on its device).
        tokenizer: the target's tokenizer with its chat template.
        settings: :class:`GenerationSettings`.
        stop_ids: ids generation stops at (default :func:`stop_token_ids` of the tokenizer and template).

    Raises:
        TemplateError: the template has no generation prompt (:func:`check_generation_prompt`).
        ValueError: no stop token, or no pad / eos id to left-pad with.
    """

    def __init__(self, model, tokenizer, settings: GenerationSettings, stop_ids: Sequence[int] | None = None):
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
        self.device = next(model.parameters()).device

    # -- generation -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """Greedy continuation of each prompt (token ids), batched with left padding.

        Returns:
            Per prompt ``(answer_ids, stopped)``: the generated ids before the first stop token, and
            whether a stop token ended it (False: ``max_new_tokens`` was reached).
        """
        from transformers import GenerationConfig

        gen = GenerationConfig(max_new_tokens=self.settings.max_new_tokens, do_sample=False,
                               eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b in range(0, len(order), self.settings.batch_size):
            idx = order[b:b + self.settings.batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i], dtype=torch.long)
                mask[r, width - len(prompts[i]):] = 1
            seqs = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                       generation_config=gen)
            new = seqs[:, width:].tolist()
            for r, i in enumerate(idx):
                answer, stopped = [], False
                for t in new[r]:
                    if t in self.stop_ids:
                        stopped = True
                        break
                    answer.append(t)
                out[i] = (answer, stopped)
        return out  # type: ignore[return-value]

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
        counted (``dropped.<reason>``). Counts: ``conversations_in`` = ``regenerated`` + ``kept_original`` +
        dropped; ``turns_in`` = ``turns_regenerated`` + ``turns_kept_tool_call`` + ``turns_kept_without_prompt``
        + ``turns_removed_by_cut``; ``cut.<reason>`` per conversation.
        """
        stats: collections.Counter = collections.Counter()
        convs = [_Conv(rec, list(rec.get("messages") or [])) for rec in records]
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


def regenerate_file(input_path: str | os.PathLike, output_path: str | os.PathLike, regenerator: Regenerator, *,
                    target_key: str, chunk_size: int = 512) -> dict:
    """Regenerate a curated parquet into ``output_path`` (same schema), resumable by parts; returns the report.

    Raises:
        ValueError: the input lacks the curated columns (names the file).
    """
    t0 = time.perf_counter()
    output_path = Path(output_path)
    pf = pq.ParquetFile(input_path)
    schema = pf.schema_arrow
    missing = [c for c in ("id", "messages") if c not in schema.names]
    if missing:
        raise ValueError(f"{input_path}: curated parquet lacks column(s) {', '.join(missing)}")
    s = regenerator.settings
    key = hashlib.sha256(json.dumps({
        "format": FORMAT, "input": sha256_file(input_path), "target": target_key,
        "tokenizer": tokenizer_fingerprint(regenerator.tokenizer), "kwargs": regenerator.kwargs,
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens, "max_turns": s.max_turns,
        "stop_ids": regenerator.stop_ids, "chunk_size": chunk_size,
        "dtype": str(next(regenerator.model.parameters()).dtype),
    }, sort_keys=True).encode()).hexdigest()
    parts_dir = output_path.with_name(output_path.name + ".parts")
    parts_dir.mkdir(parents=True, exist_ok=True)
    clean_schema = schema.remove_metadata()
    total: collections.Counter = collections.Counter()
    part_paths = []
    n_rows = pf.metadata.num_rows
    for k, batch in enumerate(pf.iter_batches(batch_size=chunk_size)):
        part = parts_dir / f"part-{k:06d}.parquet"
        part_paths.append(part)
        if part.exists():
            meta = pq.read_schema(part).metadata or {}
            info = json.loads(meta.get(PART_KEY, b"{}"))
            if info.get("key") == key:
                total.update(info["stats"])
                log.info("part %d: reused (finished earlier)", k)
                continue
            log.info("part %d: stale (other input or settings): redone", k)
        records = batch.to_pylist()
        t1 = time.perf_counter()
        out, stats = regenerator.regenerate(records)
        _check_counts(stats)
        table = pa.Table.from_pylist(out, schema=clean_schema)
        table = table.replace_schema_metadata({PART_KEY: json.dumps({"key": key, "stats": dict(stats)}).encode()})
        with atomic_path(part, suffix=".parquet") as tmp:
            pq.write_table(table, tmp)
        total.update(stats)
        done = min((k + 1) * chunk_size, n_rows)
        log.info("part %d: %d conversations -> %d rows, %d turns regenerated, %d tokens in %.1f s (%d/%d done)",
                 k, len(records), len(out), stats["turns_regenerated"], stats["tokens_generated"],
                 time.perf_counter() - t1, done, n_rows)
    _check_counts(total)
    report = {
        "format": FORMAT,
        "input": str(input_path),
        "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens, "max_turns": s.max_turns,
        "chat_template_kwargs": regenerator.kwargs, "stop_token_ids": regenerator.stop_ids,
        "target_fingerprint": target_key,
        "counts": dict(sorted(total.items())),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    with atomic_path(output_path, suffix=".parquet") as tmp:
        with pq.ParquetWriter(tmp, clean_schema.with_metadata({META_KEY: json.dumps(report).encode()})) as w:
            for part in part_paths:
                w.write_table(pq.read_table(part).replace_schema_metadata(None).cast(clean_schema))
    shutil.rmtree(parts_dir, ignore_errors=True)
    return report


def read_report(path: str | os.PathLike) -> dict:
    """The regenerate report stored in a regenerated parquet's metadata (``draftsmith.regenerate``)."""
    meta = pq.read_schema(path).metadata or {}
    if META_KEY not in meta:
        raise ValueError(f"{path}: no {META_KEY.decode()} metadata (not written by the regenerate stage)")
    return json.loads(meta[META_KEY])


def run(*, conversations: str, target_dir: str, output: str, settings: GenerationSettings, dtype: str = "auto",
        attn_implementation: str = "sdpa", trust_remote_code: bool = False, chunk_size: int = 512,
        device: str | torch.device | None = None) -> dict:
    """The regenerate stage: load the target, regenerate ``conversations`` into ``output``; returns the report."""
    from draftsmith.target import load_target
    from draftsmith.tokenize import load_tokenizer

    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    model = load_target(target_dir, dtype=dtype, device=device, attn_implementation=attn_implementation,
                        trust_remote_code=trust_remote_code)
    regen = Regenerator(model, tokenizer, settings,
                        stop_token_ids(tokenizer, target_dir, check_template_kwargs(settings.chat_template_kwargs)))
    log.info("target %s on %s (%s), stop ids %s, pad id %d, settings %s", target_dir, regen.device,
             next(model.parameters()).dtype, regen.stop_ids, regen.pad_id, settings)
    report = regenerate_file(conversations, output, regen, target_key=target_fingerprint(target_dir),
                             chunk_size=chunk_size)
    c = report["counts"]
    log.info("%d conversations in -> %d regenerated, %d kept original, dropped %s; "
             "%d turns regenerated (%d tokens, %.1f%% re-tokenize exactly), %d tool-call turns kept, cuts %s; %.1f s",
             c.get("conversations_in", 0), c.get("regenerated", 0), c.get("kept_original", 0),
             {k: v for k, v in c.items() if k.startswith("dropped.")},
             c.get("turns_regenerated", 0), c.get("tokens_generated", 0),
             100 * c.get("turns_retokenize_exact", 0) / max(c.get("turns_regenerated", 0), 1),
             c.get("turns_kept_tool_call", 0), {k: v for k, v in c.items() if k.startswith("cut.")},
             report["seconds"])
    return report
