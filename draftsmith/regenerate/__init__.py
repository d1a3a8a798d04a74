"""regenerate: the target answers the training prompts itself (greedy), so the drafter learns the
target's own distribution. A standard step for drafters (EAGLE-3 / SpecForge / DFlash recipes train on
target-regenerated responses; ~800K regenerated samples in the published DFlash recipe).

Input is a curated parquet file (``results/curated/train.parquet``), output the regenerated one
(``results/regenerated/train.parquet``, :mod:`draftsmith.regenerated`: the curated schema with the generated ids of
each regenerated turn, the same ``id`` / ``source`` per row, so rows stay traceable to their source record).

Choices (documented, tested):

* **Turn by turn.** Assistant turns are regenerated in order; the prompt of turn j is the conversation
  *with the target's own earlier answers* (``render_prompt``, the serving render, with
  the configured ``chat_template_kwargs``), so every supervised token of a later turn is conditioned on what
  the target itself said. ``max_turns`` (config) stops after that many regenerated turns (1 = first turn only;
  the rest of the conversation is cut, since later user turns answer the original reply).
* **Tool-call turns are kept.** An assistant message with ``tool_calls`` is kept verbatim (with its tool
  results), because the tool results that follow it belong to those exact calls; assistant text turns after
  the tool results are regenerated.
* **Stops.** Generation is greedy (``do_sample=False``) and stops at the first stop token of the one stop
  policy tokenize and evaluate share (:func:`draftsmith.chat.stop_token_ids`: eos ids plus the chat
  template's end-of-turn token, e.g. Llama 3's ``<|eot_id|>``, whose eos is ``<|end_of_text|>``). The
  answer's ids are stored as generated, the stop token that ended it last (``generated_ids``: what tokenize
  trains on), and the ids before the stop token, decoded without skipping special tokens, as ``content`` for
  people (``reasoning_content`` null: a thinking target's ``<think>...</think>`` stays inline in ``content``).
  Decoding and encoding again need not give the ids back, so a later turn's prompt holds the earlier answers as
  their ids too (:func:`draftsmith.chat.render_ids`): the context the target continues is its own tokens.
* **Cuts, all counted.** An answer that hits ``max_new_tokens`` is kept truncated and the conversation ends
  after it; an empty answer, a prompt of ``max_prompt_tokens`` tokens or more (the training rows would
  hold no answer token) or a turn the template cannot render ends the conversation before that turn. A
  conversation left without any assistant turn is dropped (reason counted). Conversations in =
  regenerated + kept original (nothing to regenerate, e.g. tool calls only) + dropped; assistant turns in =
  regenerated + kept (tool calls, or no prompt before them) + removed by cuts.

Generation is batched and left-padded (HF ``generate``), prompts sorted by length. Left padding is exact
to ~1e-6 in float32; in bf16 a hybrid GDN target can differ from unpadded generation in rare tokens
(docs/design.md), which still is the target's own greedy distribution; ``batch_size: 1`` is unpadded.

Shards and resume: the input's conversations are cut into global parts of ``chunk_size`` (``P = ceil(rows /
chunk_size)``); shard i of n (``regenerate.shards`` jobs, one GPU lease each) regenerates the contiguous parts
``floor(i P / n) .. floor((i + 1) P / n) - 1`` (:func:`.shards.shard_parts`) into its own parquet, part k exactly as a
one-shard run does (sampling seeds follow the global k), and :func:`.shards.assemble_shards` concatenates the shards in
order, so the output equals a one-shard run's row for row. Each finished part is written atomically to
``<shard output>.parts/part-NNNNNN.parquet`` with a key of everything that determines it (input sha256, target
fingerprint, tokenizer, settings; not the shard). A killed job restarts from the first missing part; the shard's
output is assembled from its parts atomically, then the parts are removed.

Modules: :mod:`.settings` (the rules' settings), :mod:`.turns` (a conversation answered turn by turn:
:class:`~.turns.Regenerator`), :mod:`.engines` (the generation engines and the report they share), :mod:`.static`
(the static-cache engine and its memory plan), :mod:`.shards` (parts, shards, resume, assembly), :mod:`.report`
(counts, the stored report, its log line), :mod:`.run` (the regenerate_shard job). This package imports nothing
itself: import from its modules.
"""
