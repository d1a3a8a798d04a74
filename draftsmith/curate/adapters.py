"""Adapters: record shapes (ShareGPT, OpenAI, Alpaca, prompt/response) and the embedded datasets'
layouts (BFCL, ToolTalk, HumanEval, MMATH, CHAMP, MT-Bench, tau2) -> OpenAI chat messages + tools.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from .normalize import ROLE_ALIASES, normalize_tool_calls
from .readers import Item, _find, iter_json_document, iter_jsonl, iter_records
from .schema import CurateError, DropRow, Malformed

# ----------------------------------------------------------------------------------------------
# Record shapes -> OpenAI messages (shared by the generic and the named adapters)
# ----------------------------------------------------------------------------------------------

Converted = tuple[list, Any]  # (messages, tools)
COLUMN_FIELDS = ("messages", "conversations", "instruction", "input", "output", "prompt", "response",
                 "system", "tools", "history")


def _require(rec: Any, key: str, kinds: type | tuple = str) -> Any:
    if not isinstance(rec, dict):
        raise DropRow("bad_record", f"record is {type(rec).__name__}, not an object")
    if key not in rec or rec[key] is None:
        raise DropRow("bad_record", f"field {key!r} missing")
    if not isinstance(rec[key], kinds):
        raise DropRow("bad_record", f"field {key!r} is {type(rec[key]).__name__}")
    return rec[key]


def _system(rec: dict) -> list[dict]:
    system = rec.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise DropRow("bad_record", f"field 'system' is {type(system).__name__}")
    return [{"role": "system", "content": system}]


def convert_sharegpt(rec: dict) -> Converted:
    """ShareGPT ``{conversations: [{from, value}], system?, tools?}`` -> messages.

    ``from`` human/user -> user, gpt/chatgpt/bard/bing/assistant -> assistant, system, and the
    LLaMA-Factory tool turns: ``function_call`` (value = JSON ``{name, arguments}`` or a list of
    them) -> assistant tool calls, ``observation`` / ``tool`` -> tool result (linked to the
    preceding call when there is exactly one). ``role``/``content`` keys are accepted for
    ``from``/``value``. Anything else is ``unknown_role``.
    """
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    if conv is None and isinstance(rec, dict):
        conv = rec.get("messages")
    if not isinstance(conv, list):
        raise DropRow("bad_record", "field 'conversations' missing or not a list")
    messages = _system(rec)
    pending: list[dict] = []
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise DropRow("bad_record", f"turn {i} is not an object")
        who = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if isinstance(who, str) and who.strip().lower() == "function_call":
            try:
                calls = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError as exc:
                raise DropRow("invalid_tool_call", f"turn {i}: function_call is not JSON "
                                                   f"({exc.msg})") from None
            calls = calls if isinstance(calls, list) else [calls]
            pending = normalize_tool_calls(calls, f"turn {i}") or []
            messages.append({"role": "assistant", "content": "", "tool_calls": pending})
            continue
        role = ROLE_ALIASES.get(who.strip().lower()) if isinstance(who, str) else None
        msg = {"role": role or who, "content": value}
        if role == "tool" and len(pending) == 1:
            msg["tool_call_id"] = pending[0]["id"]
            msg["name"] = pending[0]["function"]["name"]
        messages.append(msg)
    return messages, rec.get("tools")


def convert_openai(rec: dict) -> Converted:
    """OpenAI chat ``{messages: [...], tools?}`` -> messages (validated by the normaliser)."""
    return _require(rec, "messages", list), rec.get("tools")


def convert_alpaca(rec: dict) -> Converted:
    """Alpaca ``{instruction, input?, output, system?, history?}`` -> [system?, (user, assistant)*].

    The user turn is ``instruction`` + a blank line + ``input`` when ``input`` is non-empty (the
    Stanford Alpaca convention); ``history`` is a list of earlier ``[user, assistant]`` pairs.
    """
    instruction = _require(rec, "instruction")
    extra = rec.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DropRow("bad_record", f"field 'input' is {type(extra).__name__}")
    output = _require(rec, "output")
    messages = _system(rec)
    for k, pair in enumerate(rec.get("history") or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DropRow("bad_record", f"history entry {k} is not a [user, assistant] pair")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = instruction + (f"\n\n{extra}" if extra and extra.strip() else "")
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return messages, rec.get("tools")


def convert_prompt_response(rec: dict) -> Converted:
    """``{prompt, response | completion | output, system?}`` -> [system?, user, assistant]."""
    prompt = _require(rec, "prompt")
    for key in ("response", "completion", "output"):
        if rec.get(key) is not None:
            answer = _require(rec, key)
            break
    else:
        raise DropRow("bad_record", "field 'response' missing")
    return _system(rec) + [{"role": "user", "content": prompt},
                           {"role": "assistant", "content": answer}], rec.get("tools")


def convert_auto(rec: dict) -> Converted:
    """Pick the record shape from its fields: messages / conversations / instruction / prompt.

    ``messages`` whose items use ``from``/``value`` are read as ShareGPT.
    """
    if not isinstance(rec, dict):
        raise DropRow("bad_record", f"record is {type(rec).__name__}, not an object")
    msgs = rec.get("messages")
    if isinstance(msgs, list):
        if msgs and isinstance(msgs[0], dict) and "from" in msgs[0]:
            return convert_sharegpt(rec)
        return convert_openai(rec)
    if rec.get("conversations") is not None:
        return convert_sharegpt(rec)
    if rec.get("instruction") is not None:
        return convert_alpaca(rec)
    if rec.get("prompt") is not None:
        return convert_prompt_response(rec)
    raise DropRow("bad_record", "no messages / conversations / instruction / prompt field "
                                f"(fields: {sorted(rec)[:8]}; map yours with `columns`)")


def _remap(rec: Any, columns: dict[str, str]) -> Any:
    if not columns:
        return rec
    if not isinstance(rec, dict):
        raise DropRow("bad_record", f"record is {type(rec).__name__}, not an object")
    out = dict(rec)
    for field, column in columns.items():
        if column not in rec:
            raise DropRow("bad_record", f"column {column!r} (mapped to {field}) missing")
        out[field] = rec[column]
    return out


# ----------------------------------------------------------------------------------------------
# Named adapters for the embedded datasets
# ----------------------------------------------------------------------------------------------

# BFCL parameter types -> JSON schema types (bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI;
# unknown types become "string" as in bfcl_eval.model_handler.utils._cast_to_openai_type).
BFCL_TYPES = {
    "integer": "integer", "number": "number", "float": "number", "string": "string",
    "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
    "object": "object", "tuple": "array", "any": "string", "byte": "integer", "short": "integer",
    "long": "integer", "double": "number", "char": "string", "ArrayList": "array", "Array": "array",
    "HashMap": "object", "Hashtable": "object", "Queue": "array", "Stack": "array", "Any": "string",
    "String": "string", "Bigint": "integer",
}


def bfcl_schema(node: Any) -> Any:
    """A BFCL parameter schema as JSON schema: ``dict`` -> ``object``, ``float`` -> ``number`` ...

    Recurses into ``properties`` and ``items``; a property without ``type`` becomes ``string``.
    """
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("type"), str):
        out["type"] = BFCL_TYPES.get(out["type"], "string")
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: bfcl_schema(dict(v, type=v.get("type", "string")))
                             if isinstance(v, dict) else v for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = bfcl_schema(out["items"])
    return out


def bfcl_ground_truth_value(options: Any) -> tuple[bool, Any]:
    """One value from a BFCL possible-answer list: ``(present, value)``.

    BFCL lists acceptable values per parameter; ``""`` among them means the parameter may be
    omitted, which is what a model calling the function does, so it is omitted. Otherwise the first
    value is taken; a dict value is itself a map of nested possible-answer lists.
    """
    if not isinstance(options, list):
        return True, options
    if "" in options or not options:
        return False, None
    value = options[0]
    if isinstance(value, dict):
        return True, bfcl_arguments(value)
    return True, value


def bfcl_arguments(params: dict) -> dict:
    """Concrete call arguments from a BFCL ``{param: [possible values]}`` map (see above)."""
    out = {}
    for key, options in params.items():
        present, value = bfcl_ground_truth_value(options)
        if present:
            out[key] = value
    return out


def convert_bfcl(rec: dict) -> Converted:
    """BFCL single-turn question + function docs + ground-truth calls -> [user(s), assistant calls].

    The record is a question line with its ``possible_answer`` line attached as ``ground_truth``
    by the reader. ``question`` must hold one turn (a list of messages, system allowed); every
    ground-truth call ``{name: {param: [values]}}`` becomes one tool call of a single assistant turn
    (parallel calls stay parallel). ``function`` docs become ``tools`` (:func:`bfcl_schema`).
    Function names keep BFCL's spelling (dots included).
    """
    question = _require(rec, "question", list)
    if len(question) != 1 or not isinstance(question[0], list):
        raise DropRow("bad_record", f"question has {len(question)} turns; only single-turn "
                                    "categories carry call ground truth")
    truth = rec.get("ground_truth")
    if not isinstance(truth, list) or not truth:
        raise DropRow("bad_record", "no ground-truth calls for this id in possible_answer/")
    calls = []
    for k, call in enumerate(truth):
        if not (isinstance(call, dict) and len(call) == 1 and isinstance(next(iter(call.values())), dict)):
            raise DropRow("bad_record", f"ground truth {k} is not a {{name: {{param: values}}}} call")
        (name, params), = call.items()
        calls.append({"id": f"call_{k}", "type": "function",
                      "function": {"name": name, "arguments": bfcl_arguments(params)}})
    tools = []
    for fn in _require(rec, "function", list):
        if not isinstance(fn, dict):
            raise DropRow("invalid_tools", "function doc is not an object")
        fn = dict(fn)
        fn["parameters"] = bfcl_schema(fn.get("parameters") or {"type": "object", "properties": {}})
        fn["parameters"]["type"] = "object"
        tools.append({"type": "function", "function": fn})
    return list(question[0]) + [{"role": "assistant", "content": "", "tool_calls": calls}], tools


def _bfcl_is_call_category(answer_file: Path) -> bool:
    """True when the first possible answer is a list of ``{name: {params}}`` calls."""
    for _, rec in iter_jsonl(answer_file):
        truth = rec.get("ground_truth") if isinstance(rec, dict) else None
        return isinstance(truth, list) and bool(truth) and all(
            isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict)
            for c in truth)
    return False


def iter_bfcl(path: Path, options: dict) -> Iterator[Item]:
    """BFCL v4 question files ``BFCL_v4_<category>.json`` (JSON lines) joined with
    ``possible_answer/BFCL_v4_<category>.json`` by ``id``.

    ``options.categories`` (default: every category whose possible answers are function calls:
    simple_python/java/javascript, multiple, parallel, parallel_multiple and the live_* ones; not
    multi_turn_* (answers are Python call strings needing an executor), memory, web_search,
    irrelevance).
    """
    files = [p for p in _find(path, "BFCL_v4_*.json", "BFCL question files")
             if p.parent.name != "possible_answer"]
    by_category = {p.stem[len("BFCL_v4_"):]: p for p in files}
    wanted = options.get("categories")
    if wanted is not None:
        missing = sorted(set(wanted) - set(by_category))
        if missing:
            raise CurateError(f"{path}: BFCL categories {missing} not found "
                              f"(have {sorted(by_category)})")
    for category, qfile in sorted(by_category.items()):
        afile = qfile.parent / "possible_answer" / qfile.name
        if wanted is None and not (afile.exists() and _bfcl_is_call_category(afile)):
            continue
        if wanted is not None and category not in wanted:
            continue
        truth = {}
        if afile.exists():
            for _, ans in iter_jsonl(afile):
                if isinstance(ans, dict) and "id" in ans:
                    truth[ans["id"]] = ans.get("ground_truth")
        for origin, rec in iter_jsonl(qfile):
            if isinstance(rec, dict):
                rec = dict(rec, ground_truth=truth.get(rec.get("id")))
            yield origin, rec


def _tooltalk_api_docs(apis_dir: Path) -> tuple[dict[str, dict], dict[str, list[str]]]:
    """ToolTalk API schemas parsed from ``tooltalk/apis/*.py`` with :mod:`ast` (never imported).

    Each ``class X(API)`` has literal ``description`` and ``parameters`` (``{name: {type,
    description, required}}``); the schema matches ``API.to_openai_doc`` with ``required`` moved
    inside ``parameters`` (JSON schema). Suites are the ``APISuite`` classes' ``apis`` lists.

    Returns:
        ``(schemas by API name, API names by suite name)``.
    """
    schemas, suites = {}, {}
    for py in sorted(apis_dir.glob("*.py")):
        for node in ast.parse(py.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = {}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                    attrs[stmt.targets[0].id] = stmt.value
            if "description" in attrs and "parameters" in attrs and "apis" not in attrs:
                params = ast.literal_eval(attrs["parameters"])
                props = {k: {kk: vv for kk, vv in v.items() if kk != "required"}
                         for k, v in params.items()}
                schemas[node.name] = {
                    "name": node.name,
                    "description": ast.literal_eval(attrs["description"]),
                    "parameters": {"type": "object", "properties": props,
                                   "required": [k for k, v in params.items() if v.get("required")]},
                }
            elif "apis" in attrs and "name" in attrs:
                suites[ast.literal_eval(attrs["name"])] = [
                    e.id for e in attrs["apis"].elts if isinstance(e, ast.Name)]
    return schemas, suites


TOOLTALK_SYSTEM = ("You are a helpful assistant. Here is some user data:\nlocation: {location}"
                   "\ntimestamp: {timestamp}\nusername (if logged in): {username}")
"""ToolTalk's own system prompt (tooltalk/evaluation/evaluate_openai.py, OpenAIPredictor)."""


def convert_tooltalk(rec: dict, api_docs: dict[str, dict], suites: dict[str, list[str]],
                     tool_mode: str) -> Converted:
    """A ToolTalk dialogue -> [system, user, (assistant tool call, tool result)*, assistant, ...].

    Each assistant turn's ``apis`` entries (executed in order, a later call may use an earlier
    result) become one assistant message with one tool call followed by a ``tool`` message whose
    content is ``json.dumps({"response", "exception"})`` (ToolTalk's own replay format), then the
    assistant's text. ``session_token`` is removed from call arguments: ToolTalk's executor injects
    it and the tool schemas do not list it. The system prompt is ToolTalk's (location, timestamp,
    username). ``tool_mode``: ``suite`` (tools of the dialogue's suites), ``exact`` (only the APIs
    it uses) or ``all``.
    """
    turns = _require(rec, "conversation", list)
    meta = rec.get("metadata") or {}
    messages = [{"role": "system", "content": TOOLTALK_SYSTEM.format(
        location=meta.get("location"), timestamp=meta.get("timestamp"),
        username=meta.get("username"))}]
    n_calls = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DropRow("bad_record", f"conversation turn {i} is not an object")
        for api in turn.get("apis") or []:
            req = api.get("request") if isinstance(api, dict) else None
            if not isinstance(req, dict) or not isinstance(req.get("api_name"), str):
                raise DropRow("invalid_tool_call", f"turn {i}: api entry without request.api_name")
            args = {k: v for k, v in (req.get("parameters") or {}).items() if k != "session_token"}
            call_id = f"call_{n_calls}"
            n_calls += 1
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": req["api_name"], "arguments": args}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "name": req["api_name"],
                             "content": json.dumps({"response": api.get("response"),
                                                    "exception": api.get("exception")},
                                                   ensure_ascii=False)})
        messages.append({"role": turn.get("role"), "content": turn.get("text")})
    if tool_mode == "all":
        names = sorted(api_docs)
    elif tool_mode == "suite":
        names = [n for s in rec.get("suites_used") or [] for n in suites.get(s, [])]
    else:
        names = list(rec.get("apis_used") or [])
    unknown = [n for n in names if n not in api_docs]
    if unknown:
        raise DropRow("invalid_tools", f"APIs {unknown} not defined in tooltalk/apis")
    return messages, [{"type": "function", "function": api_docs[n]} for n in names]


HUMANEVAL_USER = ("Complete the following Python function. Reply with the whole function in a "
                  "Python code block.\n\n```python\n{prompt}```")


def convert_humaneval(rec: dict) -> Converted:
    """HumanEval ``{task_id, prompt, canonical_solution}`` -> [user, assistant].

    User: the function signature + docstring in a code block (:data:`HUMANEVAL_USER`); assistant:
    the reference answer, prompt + canonical solution in a code block (eval rows keep it as the
    last assistant turn; the evaluate stage prompts with the messages before it).
    """
    prompt = _require(rec, "prompt")
    solution = _require(rec, "canonical_solution")
    return [{"role": "user", "content": HUMANEVAL_USER.format(prompt=prompt)},
            {"role": "assistant", "content": f"```python\n{prompt}{solution}```"}], None


# MMATH's own prompt per language (mmath/mmath_eval.py, LANG_TO_INSTRUCTIONS).
MMATH_PROMPTS = {
    "en": "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "es": "{question}\nPor favor, razona paso a paso y pon tu respuesta final dentro de \\boxed{{}}.",
    "fr": "{question}\nVeuillez raisonner étape par étape et mettre votre réponse finale dans "
          "\\boxed{{}}.",
    "zh": "{question}\n请逐步推理，并将您的最终答案放在 \\boxed{{}} 中。",
    "ja": "{question}\nステップバイステップで推論し、最終的な答えを \\boxed{{}} の中に入れてください。",
    "th": "{question}\nกรุณาเหตุผลขั้นตอนต่อขั้นตอนและใส่คำตอบสุดท้ายของคุณใน \\boxed{{}}.",
    "ko": "{question}\n단계별로 추론하고 최종 답변을 \\boxed{{}} 안에 넣어주세요.",
    "pt": "{question}\nPor favor, raciocine passo a passo e coloque sua resposta final dentro de "
          "\\boxed{{}}.",
    "vi": "{question}\nVui lòng lý giải từng bước và đặt câu trả lời cuối cùng của bạn trong "
          "\\boxed{{}}.",
    "ar": "{question}\nيرجى المنطق خطوة بخطوة، ووضع إجابتك النهائية داخل \\boxed{{}}.",
}


def convert_mmath(rec: dict, lang: str) -> Converted:
    """MMATH ``{question, answer}`` -> [user: MMATH's prompt, assistant: ``\\boxed{answer}``].

    MMATH ships final answers only, no worked solutions, so the reference assistant turn is the
    boxed answer the prompt asks for.
    """
    question = _require(rec, "question")
    answer = _require(rec, "answer", (str, int, float))
    return [{"role": "user", "content": MMATH_PROMPTS[lang].format(question=question)},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"}], None


CHAMP_SYSTEM = "You are an expert on mathematics."
CHAMP_USER = ("Solve the following problem. Make sure to show your work before giving the final "
              "answer.\n\n{problem}")


def convert_champ(rec: dict) -> Converted:
    """CHAMP problem -> [system, user, assistant: numbered solution steps + final answer].

    Prompts are CHAMP's own (champ_dataset/prompt.py ``sys_prompt`` / ``prompt_main``); the steps
    are numbered as in ``PromptGenerator.enumerate_solution``; text fields are the ``_text`` forms.
    """
    problem = _require(rec, "_text")
    steps = _require(rec, "solution", dict).get("steps")
    if not isinstance(steps, list) or not steps:
        raise DropRow("bad_record", "solution.steps missing or empty")
    lines = []
    for k, step in enumerate(steps):
        text = _require(step, "_text")
        lines.append(f"{k + 1}. {text}")
    answer = _require(rec, "_answer")
    return [{"role": "system", "content": CHAMP_SYSTEM},
            {"role": "user", "content": CHAMP_USER.format(problem=problem)},
            {"role": "assistant", "content": "\n".join(lines) + f"\n\nFinal answer: {answer}"}], None


def convert_mtbench(rec: dict) -> Converted:
    """MT-Bench ``{question_id, category, turns: [t1, t2]}`` -> [user: t1, user: t2] (prompt only).

    Turn 2 follows up on the *target's* answer to turn 1, so the row holds the questions only: the evaluate
    stage asks turn 1, then turn 2 after the target's own answer (a prompt-only row's user messages are its
    turns). Turns that are not text are dropped from the end (a row needs turn 1).
    """
    turns = _require(rec, "turns", list)
    if not turns or not isinstance(turns[0], str):
        raise DropRow("bad_record", "turns is empty or not text")
    asked = []
    for turn in turns:
        if not isinstance(turn, str) or not turn.strip():
            break
        asked.append({"role": "user", "content": turn})
    return asked, None


def convert_tau2(rec: dict, policy: str) -> Converted:
    """A tau2-bench task -> [system: domain policy, user: the scenario's opening] (prompt only).

    tau2 tasks describe a *user simulator's* scenario (reason for call, known info, instructions)
    and the expected actions, not a dialogue trace, and their tools are Python methods without
    static JSON schemas. So tau2 is an eval-only, prompt-only source: the agent's system prompt is
    the domain policy and the user turn is the scenario's ``reason_for_call`` followed by
    ``known_info`` (verbatim, second person as tau2 writes them; the ``mock`` domain's plain
    instruction string is used as is). No assistant turn; no tools.
    """
    scenario = _require(rec, "user_scenario", dict)
    instr = scenario.get("instructions")
    if isinstance(instr, dict):
        parts = [instr.get("reason_for_call"), instr.get("known_info")]
        user = "\n\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
    elif isinstance(instr, str):
        user = instr
    else:
        raise DropRow("bad_record", "user_scenario.instructions missing")
    return [{"role": "system", "content": policy}, {"role": "user", "content": user}], None


# ----------------------------------------------------------------------------------------------
# Adapter registry
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How one ``adapter:`` value reads a path and converts its records.

    ``read(path, options)`` yields ``(origin, record | Malformed)``; ``convert(record, options)``
    returns ``(messages, tools)`` or raises :class:`DropRow`; ``prompt_only`` adapters produce
    prompts without an assistant turn (allowed only with ``split: eval``); ``options`` lists the
    adapter's accepted ``options`` keys and ``columns`` whether ``columns`` applies.
    """

    read: Callable[[Path, dict], Iterator[Item]]
    convert: Callable[[Any, dict], Converted]
    prompt_only: bool = False
    options: tuple[str, ...] = ()
    columns: bool = False


def _read_generic(fmt):
    return lambda path, options: iter_records(path, fmt, split=options.get("split"))


def _read_tooltalk(path: Path, options: dict) -> Iterator[Item]:
    subsets = options.get("subsets", ["easy", "tooltalk"])
    files = [p for p in _find(path, "*.json", "ToolTalk dialogues")
             if p.parent.name in subsets and p.parent.parent.name == "data"]
    if not files:
        raise CurateError(f"{path}: no ToolTalk dialogues in data/{{{','.join(subsets)}}}/*.json")
    for f in files:
        yield from iter_json_document(f)


def _tooltalk_converter():
    cache: dict[str, Any] = {}

    def convert(rec: dict, options: dict) -> Converted:
        apis_dir = options["_apis_dir"]
        if apis_dir not in cache:
            cache[apis_dir] = _tooltalk_api_docs(Path(apis_dir))
        docs, suites = cache[apis_dir]
        return convert_tooltalk(rec, docs, suites, options.get("tools", "suite"))

    return convert


def _read_mmath(path: Path, options: dict) -> Iterator[Item]:
    for lang in options.get("languages", ["en"]):
        if lang not in MMATH_PROMPTS:
            raise CurateError(f"{path}: MMATH language {lang!r} unknown (have {sorted(MMATH_PROMPTS)})")
        files = [path] if path.is_file() else [
            p for p in _find(path, f"{lang}.json", f"MMATH {lang}.json") if p.parent.name == "mmath"]
        if not files:
            raise CurateError(f"{path}: no mmath/{lang}.json")
        for origin, rec in iter_json_document(files[0]):
            yield origin, (dict(rec, _lang=lang) if isinstance(rec, dict) else rec)


def _read_champ(path: Path, options: dict) -> Iterator[Item]:
    for f in _find(path, "dataset_files/*.json", "CHAMP dataset_files/*.json"):
        for origin, doc in iter_json_document(f):
            if isinstance(doc, Malformed):
                yield origin, doc
                continue
            problems = doc.get("problems") if isinstance(doc, dict) else None
            if not isinstance(problems, dict):
                raise CurateError(f"{f}: no 'problems' object (not a CHAMP dataset file)")
            for pid, rec in problems.items():
                yield f"{f}#{pid}", rec


def _read_tau2(path: Path, options: dict) -> Iterator[Item]:
    domains = options.get("domains")
    files = _find(path, "domains/*/tasks.json", "tau2 domains/*/tasks.json")
    have = {f.parent.name for f in files}
    if domains is not None and set(domains) - have:
        raise CurateError(f"{path}: tau2 domains {sorted(set(domains) - have)} not found "
                          f"(have {sorted(have)})")
    for f in files:
        if domains is not None and f.parent.name not in domains:
            continue
        policy_file = next((f.parent / n for n in ("policy.md", "main_policy.md")
                            if (f.parent / n).exists()), None)
        if policy_file is None:
            raise CurateError(f"{f.parent}: no policy.md / main_policy.md for the system prompt")
        policy = policy_file.read_text(encoding="utf-8")
        for origin, rec in iter_json_document(f):
            if isinstance(rec, list):  # tasks.json is one array document when small
                for k, task in enumerate(rec):
                    yield f"{f}#{k}", dict(task, _policy=policy) if isinstance(task, dict) else task
            else:
                yield origin, dict(rec, _policy=policy) if isinstance(rec, dict) else rec


def _read_humaneval(path: Path, options: dict) -> Iterator[Item]:
    for f in _find(path, "HumanEval*.jsonl*", "HumanEval.jsonl(.gz)"):
        yield from iter_jsonl(f)


def _read_mtbench(path: Path, options: dict) -> Iterator[Item]:
    for f in _find(path, "question.jsonl", "MT-Bench question.jsonl"):
        yield from iter_jsonl(f)


def _with_columns(convert):
    return lambda rec, options: convert(_remap(rec, options.get("_columns") or {}))


ADAPTERS: dict[str, Adapter] = {
    # user data, any file format; the record shape is fixed by the adapter
    "sharegpt": Adapter(_read_generic(None), _with_columns(convert_sharegpt), columns=True,
                        options=("split",)),
    "openai": Adapter(_read_generic(None), _with_columns(convert_openai), columns=True,
                      options=("split",)),
    "alpaca": Adapter(_read_generic(None), _with_columns(convert_alpaca), columns=True,
                      options=("split",)),
    # user data of one file format; the record shape is detected from the (mapped) fields
    "jsonl": Adapter(_read_generic("jsonl"), _with_columns(convert_auto), columns=True),
    "json": Adapter(_read_generic("json"), _with_columns(convert_auto), columns=True),
    "parquet": Adapter(_read_generic("parquet"), _with_columns(convert_auto), columns=True),
    "hf_disk": Adapter(_read_generic("hf_disk"), _with_columns(convert_auto), columns=True,
                       options=("split",)),
    # embedded benchmark / dataset layouts
    "bfcl": Adapter(iter_bfcl, lambda rec, o: convert_bfcl(rec), options=("categories",)),
    "tooltalk": Adapter(_read_tooltalk, _tooltalk_converter(), options=("subsets", "tools")),
    "humaneval": Adapter(_read_humaneval, lambda rec, o: convert_humaneval(rec)),
    "mmath": Adapter(_read_mmath, lambda rec, o: convert_mmath(rec, rec.get("_lang", "en")),
                     options=("languages",)),
    "champ": Adapter(_read_champ, lambda rec, o: convert_champ(rec)),
    "mtbench": Adapter(_read_mtbench, lambda rec, o: convert_mtbench(rec), prompt_only=True),
    "tau2": Adapter(_read_tau2, lambda rec, o: convert_tau2(rec, rec.get("_policy", "")),
                    prompt_only=True, options=("domains",)),
}
"""``adapter:`` name -> :class:`Adapter`. See each ``convert_*`` for the mapping it applies."""
