"""Chat rendering and the stop policy: one definition for every stage that puts a conversation in front of the target.

tokenize renders training rows with it, regenerate renders the prompts the target answers, evaluate renders the
prompts it decodes: all through the target tokenizer's own chat template (``apply_chat_template``, the call a
serving stack makes), with the same ``chat_template_kwargs``, and all stop where :func:`stop_token_ids` says (the
eos ids of the tokenizer, ``config.json`` and ``generation_config.json`` plus the template's end-of-turn token).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from draftsmith.io import json_list
from draftsmith.regenerated import GENERATED_IDS

log = logging.getLogger("draftsmith.chat")

ROLES = ("system", "user", "assistant", "tool")
# Keyword arguments of apply_chat_template that the stage sets itself; config may not override them.
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "add_generation_prompt", "tokenize",
                            "continue_final_message", "return_dict", "return_assistant_tokens_mask",
                            "documents", "chat_template"}

# Conversation-level drop reasons raised here (tokenize counts them).
DROP_INVALID_MESSAGES = "invalid_messages"
DROP_INVALID_TOOLS = "invalid_tools"
DROP_INVALID_TOOL_ARGUMENTS = "invalid_tool_call_arguments"
DROP_INVALID_GENERATED_IDS = "invalid_generated_ids"


class TemplateError(ValueError):
    """The tokenizer has no usable chat template (none, or no generation prompt)."""


class InvalidConversation(ValueError):
    """A conversation that cannot be rendered; ``reason`` is the counted drop reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# --------------------------------------------------------------------------------------------------
# Messages and rendering


def parse_tools(tools: Any) -> list | None:
    """The curated ``tools`` column (JSON string of OpenAI function schemas, or null) as a list or ``None``.

    Raises:
        InvalidConversation: (reason ``invalid_tools``) not JSON, or not a JSON list.
    """
    try:
        return json_list(tools, "tools") or None
    except ValueError as exc:
        raise InvalidConversation(DROP_INVALID_TOOLS, str(exc)) from None


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Curated messages (Arrow structs with null fields) -> the dicts Hugging Face chat templates expect.

    Null fields are dropped (templates test ``is defined``), ``content`` null becomes ``""``, and each
    tool call's ``function.arguments`` JSON string (OpenAI format) is parsed into a dict, since HF
    templates render ``arguments | tojson``. ``reasoning_content``, ``tool_call_id`` and ``name`` are kept.

    Raises:
        InvalidConversation: reason ``invalid_messages`` (not a list of dicts, unknown role) or
            ``invalid_tool_call_arguments`` (arguments that are not valid JSON), naming the message.
    """
    if not isinstance(messages, (list, tuple)):
        raise InvalidConversation(DROP_INVALID_MESSAGES,
                                  f"field messages: expected a list, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidConversation(DROP_INVALID_MESSAGES,
                                      f"messages[{i}]: expected a struct, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidConversation(DROP_INVALID_MESSAGES, f"messages[{i}].role: {role!r} is not one of {ROLES}")
        msg: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = []
            for k, call in enumerate(calls):
                fn = dict((call or {}).get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as exc:
                        raise InvalidConversation(
                            DROP_INVALID_TOOL_ARGUMENTS,
                            f"messages[{i}].tool_calls[{k}].function.arguments: not valid JSON ({exc})") from None
                elif args is None:
                    args = {}
                tool_call: dict[str, Any] = {"type": call.get("type") or "function",
                                             "function": {"name": fn.get("name"), "arguments": args}}
                if call.get("id") is not None:
                    tool_call["id"] = call["id"]
                msg["tool_calls"].append(tool_call)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def check_template_kwargs(chat_template_kwargs: dict | None) -> dict:
    """Validate config ``tokenize.chat_template_kwargs``; returns a plain dict.

    Raises:
        ValueError: a key the stage sets itself (``add_generation_prompt``, ``tools``, ``tokenize``, ...).
    """
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if bad:
        raise ValueError(f"tokenize.chat_template_kwargs may not set {', '.join(bad)} (the stage sets them itself)")
    return kwargs


def render_text(tokenizer, messages: list[dict], tools: list | None, chat_template_kwargs: dict,
                add_generation_prompt: bool) -> str:
    """``apply_chat_template(..., tokenize=False)`` of already normalised messages (see template_messages)."""
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **chat_template_kwargs)


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered texts, batched, without added BOS/EOS (as apply_chat_template tokenizes)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def render_prompt(tokenizer, messages: Sequence[dict], tools: Any = None,
                  chat_template_kwargs: dict | None = None, *, stop_ids: Sequence[int] | None = None) -> list[int]:
    """Serving render of a conversation's prompt: its messages plus the template's generation prompt.

    This is exactly what the target is given at serving time (what vLLM / ``generate`` see after
    ``apply_chat_template(messages, tools=..., add_generation_prompt=True, **chat_template_kwargs)``), and
    the prefix of the training row of the next assistant turn. Evaluate and regenerate use it.

    Args:
        tokenizer: the target's Hugging Face tokenizer (with a chat template).
        messages: curated messages (Arrow structs or plain dicts; ``arguments`` may be JSON strings),
            normally everything before the assistant turn to be generated.
        tools: JSON string or list of OpenAI-style function schemas, or ``None``.
        chat_template_kwargs: e.g. ``{"enable_thinking": False}``; use the values recorded in the tokenized
            parquet metadata (:func:`read_tokenized_metadata`) so serving matches training.
        stop_ids: the stop policy, needed when messages carry the target's generated ids (regenerate's later
            turns): then the prompt is :func:`render_ids`, the earlier answers as the ids the target generated.

    Returns:
        list[int]: token ids (no BOS/EOS added beyond what the template writes).

    Raises:
        InvalidConversation: bad messages / tools (see :func:`template_messages`, :func:`parse_tools`).
        TemplateError: the tokenizer has no chat template.
        ValueError: messages with generated ids and no ``stop_ids``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    if any(isinstance(m, dict) and m.get(GENERATED_IDS) is not None for m in messages):
        if stop_ids is None:
            raise ValueError(f"messages carry {GENERATED_IDS}: render_prompt needs the stop_ids they were generated "
                             "with")
        return render_ids(tokenizer, messages, tools, chat_template_kwargs, add_generation_prompt=True,
                          stop_ids=stop_ids)
    text = render_text(tokenizer, template_messages(messages), parse_tools(tools),
                       check_template_kwargs(chat_template_kwargs), add_generation_prompt=True)
    return encode(tokenizer, [text])[0]


# The content a generated answer's ids stand in for while the template renders the messages around it.
_GENERATED_PLACEHOLDER = "\x00draftsmith generated answer\x00"


def generated_turns(messages: Sequence[dict], stop_ids: Sequence[int]) -> list[int]:
    """Indices of the messages that carry the target's generated ids (:data:`draftsmith.regenerated.GENERATED_IDS`),
    checked against the regenerated format.

    Raises:
        InvalidConversation: reason ``invalid_generated_ids``, naming the message: ids on a message that is not an
            assistant text turn (a role other than assistant, or tool calls), an empty list, a negative id, or an
            answer without a stop token (cut at ``regenerate.max_new_tokens``) that is not the conversation's last
            message. Ids past the tokenizer's last are valid: a target's vocabulary can be larger (padded
            embeddings), and what it generated is what it is trained on.
    """
    stops = set(stop_ids)
    found = []
    for i, m in enumerate(messages):
        ids = m.get(GENERATED_IDS) if isinstance(m, dict) else None
        if ids is None:
            continue
        where = f"messages[{i}].{GENERATED_IDS}"
        if m.get("role") != "assistant" or m.get("tool_calls"):
            raise InvalidConversation(DROP_INVALID_GENERATED_IDS,
                                      f"{where}: on a {m.get('role')!r} message; only assistant text turns are "
                                      "generated")
        if len(ids) == 0:
            raise InvalidConversation(DROP_INVALID_GENERATED_IDS, f"{where}: empty")
        bad = next((t for t in ids if int(t) < 0), None)
        if bad is not None:
            raise InvalidConversation(DROP_INVALID_GENERATED_IDS, f"{where}: negative id {bad}")
        if int(ids[-1]) not in stops and i != len(messages) - 1:
            raise InvalidConversation(DROP_INVALID_GENERATED_IDS,
                                      f"{where}: ends without a stop token (cut at the token budget) but "
                                      f"{len(messages) - 1 - i} message(s) follow it")
        found.append(i)
    return found


def render_ids(tokenizer, messages: Sequence[dict], tools: Any, chat_template_kwargs: dict | None, *,
               add_generation_prompt: bool, stop_ids: Sequence[int], memo: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered as the target's own session: assistant turns that carry the ids the
    target generated (:data:`draftsmith.regenerated.GENERATED_IDS`) keep exactly those ids.

    Without generated ids this is the template's render, encoded (:func:`render_prompt` with
    ``add_generation_prompt=True``). With them, let ``k`` be the last message carrying ids ``g`` (its stop token
    last, or none when the answer reached the token budget):

        ids(m, gen) = ids(m[:k], True) + g + after_k

    ``ids(m[:k], True)`` is the serving prompt ``g`` was generated from (recursively, the earlier generated
    answers keep their ids too), and ``after_k`` what the template writes after message ``k`` (the render of
    ``m`` with a placeholder for message ``k``'s content, encoded from the placeholder on) less its tokens
    through its first stop token: the template's end-of-turn, for which the target's own stop token, the last
    of ``g``, stands (ChatML: ``"<|im_end|>\\n"`` leaves ``"\\n"``). An answer cut at the budget has no
    end-of-turn and nothing after it: the render ends with ``g``. What the template would write *before* or
    *instead of* an earlier generated answer (its assistant header again, reasoning it drops from history) is
    not used: the context is what the target saw and produced. So ``ids(m[:j + 1], False)`` starts with
    ``ids(m[:j], True)`` followed by turn ``j``'s generated ids, by construction.

    Args:
        messages: curated messages (dicts), those with generated ids as :func:`generated_turns` checks them.
        tools: JSON string or list of OpenAI function schemas, or ``None``.
        stop_ids: the stop policy (:func:`stop_token_ids`) the ids were generated with.
        memo: a dict shared by the calls on prefixes of one conversation (reuses the renders of its prompts).

    Returns:
        list[int]: token ids.

    Raises:
        InvalidConversation: bad messages / tools; a generated answer without a stop token that is not last.
        ValueError: the template does not render the placeholder content once.
    """
    key = (len(messages), add_generation_prompt)
    if memo is not None and key in memo:
        return list(memo[key])
    kwargs = check_template_kwargs(chat_template_kwargs)
    rendered = template_messages(messages)
    k = max((i for i, m in enumerate(messages) if m.get(GENERATED_IDS) is not None), default=None)
    if k is None:
        ids = encode(tokenizer, [render_text(tokenizer, rendered, parse_tools(tools), kwargs,
                                             add_generation_prompt)])[0]
    else:
        generated = [int(t) for t in messages[k][GENERATED_IDS]]
        stops = set(int(t) for t in stop_ids)
        ids = render_ids(tokenizer, messages[:k], tools, kwargs, add_generation_prompt=True, stop_ids=stop_ids,
                         memo=memo) + generated
        if generated[-1] not in stops:
            if k != len(messages) - 1 or add_generation_prompt:
                raise InvalidConversation(DROP_INVALID_GENERATED_IDS,
                                          f"messages[{k}].{GENERATED_IDS}: ends without a stop token (cut at the "
                                          "token budget) but the render goes on after it")
        else:
            probe = {name: v for name, v in rendered[k].items() if name != "reasoning_content"}
            rendered[k] = {**probe, "content": _GENERATED_PLACEHOLDER}
            text = render_text(tokenizer, rendered, parse_tools(tools), kwargs, add_generation_prompt)
            at = text.find(_GENERATED_PLACEHOLDER)
            if at < 0 or text.find(_GENERATED_PLACEHOLDER, at + 1) >= 0:
                raise ValueError(f"the chat template does not render messages[{k}].content once as given: the "
                                 "generated ids cannot be placed")
            after = encode(tokenizer, [text[at + len(_GENERATED_PLACEHOLDER):]])[0]
            end = next((i + 1 for i, t in enumerate(after) if int(t) in stops), 0)
            ids += [int(t) for t in after[end:]]
    if memo is not None:
        memo[key] = list(ids)
    return ids


def check_generation_prompt(tokenizer, chat_template_kwargs: dict | None = None) -> str:
    """Raise unless the chat template exists and writes a generation prompt; returns that prompt's text.

    The probe renders ``[{"role": "user", "content": "Hello"}]`` with and without
    ``add_generation_prompt``; a template that renders both the same cannot mark where the assistant's
    answer starts (and a serving stack would not prompt the target to answer).

    Raises:
        TemplateError: no chat template, or no generation prompt.
    """
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"tokenizer {name!r} has no chat template (tokenizer_config.json 'chat_template' or "
                            "chat_template.jinja): tokenize renders with the target's own template")
    kwargs = check_template_kwargs(chat_template_kwargs)
    probe = [{"role": "user", "content": "Hello"}]
    with_prompt = render_text(tokenizer, probe, None, kwargs, add_generation_prompt=True)
    without = render_text(tokenizer, probe, None, kwargs, add_generation_prompt=False)
    if with_prompt == without or not with_prompt.startswith(without):
        raise TemplateError(
            f"the chat template of {name!r} has no generation prompt: add_generation_prompt=True renders "
            f"{with_prompt[-60:]!r} and False renders {without[-60:]!r}; without one the start of the "
            "assistant's answer is unknown (fix the template: it must append the assistant header)")
    return with_prompt[len(without):]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 hex of the tokenizer (its serialized ``tokenizer.json`` or its vocab) plus its chat template.

    Two tokenizers with the same fingerprint produce the same token ids for the same rendered
    conversation; extract and evaluate compare it with ``draftsmith.tokenizer_fingerprint`` of the tokenized
    parquet. Serialization is that of the installed ``tokenizers`` version.
    """
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode("utf-8"))
        digest.update(json.dumps(sorted(str(t) for t in tokenizer.all_special_tokens)).encode("utf-8"))
    template = tokenizer.chat_template
    digest.update(b"\0chat_template\0")
    digest.update((template if isinstance(template, str) else json.dumps(template, sort_keys=True)).encode("utf-8"))
    return digest.hexdigest()


# Assistant content of the end-of-turn probe: plain words every tokenizer and template keep as they are.
_END_OF_TURN_PROBE = "draftsmith probe answer"


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens: ``all_special_ids`` plus added tokens marked special
    (Llama 3's ``<|eot_id|>`` is an added special token that is not in ``all_special_ids``)."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    for idx, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


def end_of_turn_token_ids(tokenizer, chat_template_kwargs: dict | None = None) -> list[int]:
    """The chat template's end-of-turn token: the first special token it writes after an assistant
    message's content.

    Found by rendering ``[user "Hello", assistant <probe>]`` with the target's own template (no
    generation prompt, the given ``chat_template_kwargs``) and tokenizing what follows the probe text:
    ``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3 (whose eos is ``<|end_of_text|>``),
    ``<end_of_turn>`` for Gemma, ``<|return|>`` for gpt-oss.

    Returns:
        list[int]: one id, or ``[]`` when the tokenizer has no chat template, the template writes no
        special token after the content, or it refuses the probe conversation (logged).
    """
    return end_of_turn_probe(tokenizer, chat_template_kwargs)[0]


def end_of_turn_probe(tokenizer, chat_template_kwargs: dict | None) -> tuple[list[int], int | None]:
    """``(end-of-turn ids, tokens the template writes after it)`` (see :func:`end_of_turn_token_ids`);
    the count is ``None`` when there is no end-of-turn token (ChatML: 1, its ``"\\n"``; Llama 3: 0)."""
    if not getattr(tokenizer, "chat_template", None):
        return [], None
    probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": _END_OF_TURN_PROBE}]
    try:
        text = render_text(tokenizer, probe, None, check_template_kwargs(chat_template_kwargs),
                           add_generation_prompt=False)
    except Exception as exc:  # a template that raises on this conversation (e.g. requires a system turn)
        log.warning("the chat template refuses the end-of-turn probe (%s: %s): stop tokens are the eos ids only",
                    type(exc).__name__, exc)
        return [], None
    at = text.rfind(_END_OF_TURN_PROBE)
    if at < 0:
        return [], None
    specials = special_token_ids(tokenizer)
    tail = encode(tokenizer, [text[at + len(_END_OF_TURN_PROBE):]])[0]
    for k, t in enumerate(tail):
        if int(t) in specials:
            return [int(t)], len(tail) - k - 1
    return [], None


def _config_eos_ids(path: Path) -> set[int]:
    """``eos_token_id`` (int or list) of a JSON config file, and of its ``text_config`` (multimodal folders)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return set()
    ids = set()
    for section in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        eos = section.get("eos_token_id") if isinstance(section, dict) else None
        for value in eos if isinstance(eos, list) else [eos]:
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
    return ids


def stop_token_ids(tokenizer, target_dir: str | os.PathLike | None = None,
                   chat_template_kwargs: dict | None = None) -> list[int]:
    """The stop policy of draftsmith, the one function regenerate, tokenize and evaluate all call.

    A generation stops at (and includes) the first of these ids: the tokenizer's eos, ``eos_token_id``
    of the target's ``generation_config.json`` and ``config.json`` (int or list, also under
    ``text_config``: the ids ``generate`` and vLLM stop at), plus the chat template's end-of-turn token
    (:func:`end_of_turn_token_ids`), which need not be an eos: Llama-3-Instruct ends turns with
    ``<|eot_id|>`` while its tokenizer's eos is ``<|end_of_text|>``. So regenerate stops where a served
    target stops, tokenize supervises each answer through its first stop token and nothing after, and
    evaluate decodes to the same token.

    Args:
        tokenizer: the target's tokenizer (with its chat template).
        target_dir: the target's Hugging Face folder (``None``: tokenizer and template only).
        chat_template_kwargs: the template kwargs of the run (``enable_thinking`` ...), used by the probe.

    Returns:
        list[int]: sorted, possibly empty (callers that generate raise on an empty policy).
    """
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if target_dir is not None:
        for name in ("generation_config.json", "config.json"):
            ids |= _config_eos_ids(Path(target_dir) / name)
    ids.update(end_of_turn_token_ids(tokenizer, chat_template_kwargs))
    return sorted(ids)


def load_tokenizer(path: str | os.PathLike, *, trust_remote_code: bool = False):
    """The target's tokenizer from its local Hugging Face folder (no hub access).

    Raises:
        FileNotFoundError: the folder does not exist.
    """
    from transformers import AutoTokenizer

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    # whole conversations are longer than some tokenizers' nominal limit: no truncation, no warning
    tokenizer.model_max_length = int(1e30)
    if not getattr(tokenizer, "is_fast", False):
        log.warning("tokenizer %s is not a fast (Rust) tokenizer: tokenization is much slower", path)
    return tokenizer
