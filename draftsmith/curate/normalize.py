"""Normalisation and validation of one conversation into the curated row form, and its id."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from draftsmith.io import json_list

from .schema import DropRow

# ----------------------------------------------------------------------------------------------
# Normalisation and validation
# ----------------------------------------------------------------------------------------------

# Role spellings seen in the wild -> canonical role. Anything else is `unknown_role`.
ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
    "ipython": "tool",
}


_ROLE_LOOKUP = {**ROLE_ALIASES, **{k.capitalize(): v for k, v in ROLE_ALIASES.items()}}


@dataclasses.dataclass
class Conversation:
    """One normalised row: ``messages`` (list of 6-key dicts, :data:`MESSAGE_TYPE`), ``tools``
    (JSON string or None), ``id`` (:func:`conversation_id`), and how many leading / trailing
    messages the normaliser trimmed."""

    messages: list[dict]
    tools: str | None
    id: str
    trimmed_leading: int = 0
    trimmed_trailing: int = 0
    messages_json: str = ""  # compact JSON of ``messages`` (computed for the id anyway)

    def row(self, source: str) -> dict:
        """The row as a dict of the :data:`OUTPUT_SCHEMA` columns."""
        return {"id": self.id, "source": source, "messages": self.messages, "tools": self.tools}

    def json_line(self, source: str, origin: str = "") -> bytes:
        """The row as one JSON line (UTF-8): the :data:`OUTPUT_SCHEMA` columns + ``origin``."""
        messages_json = self.messages_json or _compact(self.messages)
        return (f'{{"id":"{self.id}","source":{_compact(source)},"messages":{messages_json},'
                f'"tools":{_compact(self.tools)},"origin":{_compact(origin)}}}\n').encode("utf-8")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _parse_json_object(text: str, what: str) -> dict:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise DropRow("invalid_tool_call", f"{what}: arguments are not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DropRow("invalid_tool_call", f"{what}: arguments are JSON {type(obj).__name__}, "
                                           "not an object")
    return obj


def _text(value: Any, where: str) -> str | None:
    """Message content as a string: str, None, or OpenAI content parts (text parts joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for k, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                if not isinstance(part.get("text"), str):
                    raise DropRow("bad_record", f"{where}: text part {k} has no string 'text'")
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DropRow("unsupported_content", f"{where}: content part {k} of type {kind!r}")
        return "".join(parts)
    raise DropRow("bad_record", f"{where}: content is {type(value).__name__}, not text")


def _optional_str(value: Any, where: str, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise DropRow("bad_record", f"{where} {field} is {type(value).__name__}, not a string")


def normalize_tool_calls(calls: Any, where: str) -> list[dict] | None:
    """Tool calls in OpenAI form: ``[{id, type: "function", function: {name, arguments}}]``.

    Accepts the OpenAI form, a flat ``{name, arguments}`` form and ``arguments`` given as a dict
    or a JSON string; ``arguments`` is stored as a JSON string of an object. Ids default to
    ``call_<k>``.

    Raises:
        DropRow("invalid_tool_call"): not a list of calls, a call without a name, arguments that do
            not parse as a JSON object (NaN / Infinity included).
    """
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise DropRow("invalid_tool_call", f"{where}: tool_calls is {type(calls).__name__}, not a list")
    out = []
    for k, call in enumerate(calls):
        what = f"{where} tool call {k}"
        if not isinstance(call, dict):
            raise DropRow("invalid_tool_call", f"{what} is not an object")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise DropRow("invalid_tool_call", f"{what}: function is not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise DropRow("invalid_tool_call", f"{what}: missing function name")
        args = fn.get("arguments", fn.get("parameters"))
        if args is None:
            args = {}
        elif isinstance(args, str):
            args = _parse_json_object(args, what)
        elif not isinstance(args, dict):
            raise DropRow("invalid_tool_call", f"{what}: arguments are {type(args).__name__}")
        kind = call.get("type") or "function"
        if kind != "function":
            raise DropRow("invalid_tool_call", f"{what}: type {kind!r} is not 'function'")
        call_id = call.get("id")
        out.append({
            "id": call_id if isinstance(call_id, str) and call_id else f"call_{k}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False,
                                                               allow_nan=False)},
        })
    return out


def normalize_tools(tools: Any) -> str | None:
    """The ``tools`` column: JSON string of ``[{"type": "function", "function": {name, ...}}]``.

    Accepts a list or a JSON string of one; bare ``{name, description, parameters}`` schemas are
    wrapped. An empty list becomes None.

    Raises:
        DropRow("invalid_tools"): not a list of function schemas with string names.
    """
    try:
        tools = json_list(tools, "tools")
    except ValueError as exc:
        raise DropRow("invalid_tools", str(exc)) from None
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise DropRow("invalid_tools", f"tool {k} is not an object")
        fn = tool.get("function") if "function" in tool else tool
        if (tool.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise DropRow("invalid_tools", f"tool {k} is not a function schema with a name")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise DropRow("invalid_tools", f"tool {k} ({fn['name']}): parameters is not an object")
        out.append({"type": "function", "function": fn})
    if not out:
        return None
    try:
        return json.dumps(out, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise DropRow("invalid_tools", str(exc)) from None


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _compact(obj: Any) -> str:
    """Compact UTF-8 JSON (no spaces, non-ASCII kept), the form hashed for ids and spooled."""
    if obj is None:
        return "null"
    if type(obj) is str:
        return json.encoder.encode_basestring(obj)
    return _ENCODER.encode(obj)


def canonical_json(messages: list[dict], tools: str | None) -> str:
    """The text that :func:`conversation_id` hashes: compact JSON of ``[messages, tools]``.

    The key order of normalised messages is fixed by :func:`normalize_conversation` (role, content,
    reasoning_content, tool_calls, tool_call_id, name; tool calls id, type, function{name,
    arguments}), so no key sorting is needed; ``arguments`` and ``tools`` are already JSON strings.
    """
    return _compact([messages, tools])


def conversation_id(messages: list[dict], tools: str | None = None) -> str:
    """Stable row id: sha256 hex [:16] of :func:`canonical_json` (UTF-8) of normalised messages + tools.

    Independent of the source, so the same conversation in two sources gets the same id (and is
    de-duplicated), and of the seed, so ids never change between runs.

    Raises:
        UnicodeEncodeError: text holding lone surrogates (not valid UTF-8).
    """
    return hashlib.sha256(canonical_json(messages, tools).encode("utf-8")).hexdigest()[:16]


def _bad_utf8_location(messages: list[dict], tools: str | None) -> str:
    for i, m in enumerate(messages):
        for key, value in m.items():
            texts = [value] if isinstance(value, str) else []
            if key == "tool_calls" and value:
                texts = [json.dumps(value, ensure_ascii=False)]
            for t in texts:
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return f"message {i} ({m['role']}) field {key} at character {exc.start}"
    return "tools"


def _check_tool_replies(out: list[dict], n_system: int, leading: int) -> None:
    """Drop a conversation with a tool reply that answers no tool call: a ``tool`` message whose nearest earlier
    non-tool message is not an assistant turn with ``tool_calls``, or whose ``tool_call_id`` (when it has one) is
    none of that turn's call ids. A chat template renders such a reply as a tool result out of nowhere.

    ``n_system`` / ``leading``: the system messages kept and the messages trimmed after them (to name a message by
    its index in the record).

    Raises:
        DropRow("orphan_tool_reply"): naming the message.
    """
    calls: list[dict] | None = None
    for k, m in enumerate(out):
        if m["role"] != "tool":
            calls = m["tool_calls"] if m["role"] == "assistant" else None
            continue
        i = k if k < n_system else k + leading
        if not calls:
            raise DropRow("orphan_tool_reply", f"message {i}: a tool reply that follows no assistant tool call")
        if m["tool_call_id"] is not None and m["tool_call_id"] not in {c["id"] for c in calls}:
            raise DropRow("orphan_tool_reply", f"message {i}: tool_call_id {m['tool_call_id']!r} is none of the "
                                               f"preceding tool calls {[c['id'] for c in calls]}")


def normalize_conversation(messages: Any, tools: Any = None, *, prompt_only: bool = False,
                           max_chars: int | None = None) -> Conversation:
    """Validate and normalise one conversation into the curated row form.

    Steps: map role aliases (:data:`ROLE_ALIASES`; ``function_call`` of legacy OpenAI messages becomes
    a tool call); content parts joined; tool calls / tools normalised; leading non-system messages
    before the first user turn are trimmed (e.g. ShareGPT splits starting with ``gpt``, the FastChat
    convention); unless ``prompt_only``, trailing messages after the last assistant turn are trimmed;
    then the checks below. Content is kept verbatim (no stripping).

    Args:
        messages: list of message dicts (``role``, ``content``, optional ``reasoning_content``,
            ``tool_calls``, ``tool_call_id``, ``name``).
        tools: list / JSON string of function schemas, or None.
        prompt_only: rows of prompt-only adapters (mtbench, tau2): no assistant turn required, but
            the row must end with a user turn.
        max_chars: drop when contents + reasoning + tool-call arguments + tools exceed it.

    Returns:
        :class:`Conversation` with the id.

    Raises:
        DropRow: with one of the reasons of :data:`DROP_REASONS` (``bad_record``, ``unknown_role``,
            ``unsupported_content``, ``invalid_tool_call``, ``invalid_tools``, ``invalid_utf8``,
            ``no_assistant_turn``, ``no_user_turn``, ``orphan_tool_reply``, ``too_long``).
    """
    if not isinstance(messages, list):
        raise DropRow("bad_record", f"messages is {type(messages).__name__}, not a list")
    out: list[dict] = []
    for i, m in enumerate(messages):
        if type(m) is not dict:
            raise DropRow("bad_record", f"message {i} is {type(m).__name__}, not an object")
        get = m.get
        raw_role = get("role")
        role = _ROLE_LOOKUP.get(raw_role) if type(raw_role) is str else None
        if role is None:
            if isinstance(raw_role, str):
                role = ROLE_ALIASES.get(raw_role.strip().lower())
            if role is None:
                raise DropRow("unknown_role", f"message {i}: role {raw_role!r}")
        calls = get("tool_calls")
        if calls is None and get("function_call") is not None:  # legacy OpenAI function calling
            calls = [{"type": "function", "function": m["function_call"]}]
        if calls is not None:
            calls = normalize_tool_calls(calls, f"message {i}")
            if calls and role != "assistant":
                raise DropRow("invalid_tool_call", f"message {i}: tool calls on a {role} message")
        content = get("content")
        if type(content) is not str:
            content = _text(content, f"message {i}") or ""
        reasoning = get("reasoning_content")
        if reasoning is None:
            reasoning = get("reasoning")
        tool_call_id = get("tool_call_id")
        name = get("name")
        if not (type(reasoning) is type(tool_call_id) is type(name) is type(None)):
            reasoning = _optional_str(reasoning, f"message {i}", "reasoning_content")
            tool_call_id = _optional_str(tool_call_id, f"message {i}", "tool_call_id")
            name = _optional_str(name, f"message {i}", "name")
        out.append({"role": role, "content": content, "reasoning_content": reasoning,
                    "tool_calls": calls, "tool_call_id": tool_call_id, "name": name})
    tools_json = normalize_tools(tools)

    n_system = 0
    while n_system < len(out) and out[n_system]["role"] == "system":
        n_system += 1
    first_user = next((i for i in range(n_system, len(out)) if out[i]["role"] == "user"), None)
    if first_user is None:
        raise DropRow("no_user_turn", f"{len(messages)} messages, none from the user")
    leading = first_user - n_system
    out = out[:n_system] + out[first_user:]
    trailing = 0
    if not prompt_only:
        last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=-1)
        trailing = len(out) - 1 - last if last >= 0 else 0
        out = out[:last + 1] if last >= 0 else out
        if not any(m["role"] == "assistant" and (m["content"].strip() or m["tool_calls"])
                   for m in out):
            raise DropRow("no_assistant_turn", f"{len(messages)} messages, none an assistant turn "
                                               "with text or tool calls")
    elif not out or out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise DropRow("no_user_turn", "a prompt-only row must end with a non-empty user turn")

    _check_tool_replies(out, n_system, leading)

    if max_chars is not None:
        n = len(tools_json or "") + sum(
            len(m["content"]) + len(m["reasoning_content"] or "")
            + sum(len(c["function"]["arguments"]) for c in m["tool_calls"] or []) for m in out)
        if n > max_chars:
            raise DropRow("too_long", f"{n} characters > max_chars {max_chars}")
    messages_json = _compact(out)
    canonical = f"[{messages_json},{_compact(tools_json)}]"  # == canonical_json(out, tools_json)
    try:
        row_id = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    except UnicodeEncodeError:
        raise DropRow("invalid_utf8", _bad_utf8_location(out, tools_json)) from None
    return Conversation(out, tools_json, row_id, leading, trailing, messages_json)
