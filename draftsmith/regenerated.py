"""The regenerated parquet: the contract between regenerate (which writes it) and tokenize (which reads it).

``results/regenerated/shard-<i>.parquet`` and ``train.parquet`` hold the curated columns (``id``, ``source``,
``messages``, ``tools``: :data:`draftsmith.curate.OUTPUT_SCHEMA`) with one more field in each message struct,
:data:`GENERATED_IDS` (list<int32>, :func:`regenerated_schema`):

* on an assistant turn the target answered: exactly the token ids it generated for that turn, the stop token that
  ended the answer last (one of :func:`draftsmith.chat.stop_token_ids`), or no stop token when the answer reached
  ``regenerate.max_new_tokens`` (then it is the conversation's last message). ``content`` holds the same answer as
  text for people (decoded without the stop token); the ids, not the text, are what tokenize trains on, since
  decoding and encoding again need not give the ids back (byte-level BPE merges, a random target's tokens);
* null on every other message (system, user, tool, kept tool-call turns, turns kept as curated).

tokenize renders such a conversation as the target's own session (:func:`draftsmith.chat.render_ids`): each
generated answer's ids follow the serving prompt they were generated from, then what the chat template writes after
the answer's end-of-turn token (the target's own stop token stands in for the template's), then the next messages.
Files without the field (curated input, ``regenerate.enabled: false``) are tokenized from their text as before.
"""

from __future__ import annotations

import pyarrow as pa

#: the message field holding the ids the target generated for an assistant turn
GENERATED_IDS = "generated_ids"
GENERATED_IDS_TYPE = pa.list_(pa.int32())


def regenerated_schema(curated: pa.Schema) -> pa.Schema:
    """The regenerated parquet's schema for input of schema ``curated``: its ``messages`` structs with
    :data:`GENERATED_IDS` (list<int32>) added last; the schema itself if they already have it.

    Raises:
        ValueError: ``curated`` has no ``messages`` column of list<struct>.
    """
    if "messages" not in curated.names:
        raise ValueError(f"no messages column to add {GENERATED_IDS} to (columns {curated.names})")
    field = curated.field("messages")
    if not (pa.types.is_list(field.type) and pa.types.is_struct(field.type.value_type)):
        raise ValueError(f"column messages is {field.type}, not a list of message structs")
    message = field.type.value_type
    if message.get_field_index(GENERATED_IDS) >= 0:
        return curated
    message = pa.struct(list(message) + [pa.field(GENERATED_IDS, GENERATED_IDS_TYPE)])
    return curated.set(curated.get_field_index("messages"), field.with_type(pa.list_(message)))
