"""Tests of the regenerate stage with a tiny random target (CPU, float32): regenerated assistant text equals
what Hugging Face ``generate`` produces for the same serving prompt, turn by turn; tool-call turns kept;
cuts and drops counted and reconciled; a killed job resumes from its finished parts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftsmith.chat import render_prompt
from draftsmith.regenerate.engines import VLLMEngine
from draftsmith.regenerate.report import META_KEY, check_counts, read_report, summary
from draftsmith.regenerate.run import run
from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.regenerate.shards import PART_KEY, assemble_shards, num_parts, regenerate_file, shard_parts
from draftsmith.regenerate.static import (
    StaticBatchEngine,
    cache_bytes_per_row,
    resolve_engine,
    static_engine_supported,
)
from draftsmith.regenerate.turns import Regenerator, _split_stop
from tiny import CURATED, REGENERATED, tiny_target, tiny_tokenizer


def shard_settings(tokenize=None, **regenerate) -> RegenerateShardSettings:
    """rule regenerate_shard's settings with these ``regenerate`` keys (and ``tokenize`` keys), schema defaults for
    the rest."""
    return RegenerateShardSettings.from_config(regenerate=regenerate, tokenize=tokenize or {})


def msg(role, content="", **kw):
    return {"role": role, "content": content, "reasoning_content": None, "tool_calls": None, "tool_call_id": None,
            "name": None, **kw}


WEATHER = json.dumps([{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                        "parameters": {"type": "object", "properties": {}}}}])
CONVERSATIONS = [
    {"id": "a", "source": "s", "tools": None, "messages": [
        msg("system", "Be kind."), msg("user", "Hello!"), msg("assistant", "original 1"),
        msg("user", "What is the answer?"), msg("assistant", "original 2")]},
    {"id": "b", "source": "s", "tools": None, "messages": [
        msg("user", "Write a function that adds two numbers. Please explain speculative decoding."),
        msg("assistant", "original")]},
    {"id": "c", "source": "t", "tools": WEATHER, "messages": [
        msg("user", "What is the answer?"),
        msg("assistant", "", tool_calls=[{"id": "1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{}"}}]),
        msg("tool", "sunny", tool_call_id="1", name="get_weather"),
        msg("assistant", "original after tool")]},
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, model, tok):
    out = tmp_path_factory.mktemp("tiny-target")
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def stop(model, tok):
    """eos plus the 4th token the random target generates for conversation a's first prompt, so that turn
    stops after 3 tokens and its second turn is generated from a prompt holding that answer."""
    prompt = render_prompt(tok, CONVERSATIONS[0]["messages"][:2])
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=[2],
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert len(seq) == 4 and seq[3] not in seq[:3] + [2]
    return [2, seq[3]]


def reference(model, tok, messages, tools, max_new_tokens, stop, *, with_ids=False):
    """Unbatched, unpadded greedy HF generate of the serving prompt (earlier answers as their generated ids), cut
    after the first stop token: ``(text before the stop token, stopped)``, and with ``with_ids`` the generated ids
    through the stop token."""
    prompt = render_prompt(tok, messages, tools, stop_ids=stop)
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(seq) if t in stop), None)
    text = tok.decode(seq[:cut] if cut is not None else seq, skip_special_tokens=False,
                      clean_up_tokenization_spaces=False)
    if with_ids:
        return text, cut is not None, seq[:cut + 1] if cut is not None else seq
    return text, cut is not None


@pytest.mark.parametrize("engine", ["generate", "continuous", "static"])
def test_regenerated_text_equals_generate_turn_by_turn(model, tok, stop, engine):
    """Every in-process engine (HF generate on left-padded batches, transformers' continuous batching, the
    static-cache engine) gives the greedy answer of an unbatched, unpadded generate, token for token, turn by
    turn."""
    settings = shard_settings(max_new_tokens=12, batch_size=3, engine=engine)
    regen = Regenerator(model, tok, settings, stop)
    assert regen.engine.name == engine
    out, stats = regen.regenerate(json.loads(json.dumps(CONVERSATIONS)))
    by_id = {r["id"]: r for r in out}
    assert set(by_id) == {"a", "b", "c"}
    n_checked = 0
    stopped_any, hit_max_any = False, False
    for rec in out:
        msgs = rec["messages"]
        for j, m in enumerate(msgs):
            if m["role"] != "assistant" or m["tool_calls"]:
                continue
            # the prompt of turn j holds the target's own earlier answers (turn by turn)
            text, stopped, ids = reference(model, tok, msgs[:j], rec["tools"], 12, stop, with_ids=True)
            assert m["content"] == text and m["reasoning_content"] is None
            assert m["generated_ids"] == ids  # the ids as generated, the stop token last when one ended them
            assert not m["content"].startswith("original")
            stopped_any |= stopped
            hit_max_any |= not stopped
            n_checked += 1
    assert stopped_any and hit_max_any  # both ends of generation are exercised
    assert n_checked == stats["turns_regenerated"] == 4  # a: 2 turns, b: 1, c: 1 (after the tool result)
    assert [m["role"] for m in by_id["a"]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # tool-call turn and its result kept verbatim; the answer after the tool result regenerated
    c = by_id["c"]["messages"]
    assert c[1] == CONVERSATIONS[2]["messages"][1] and c[2] == CONVERSATIONS[2]["messages"][2]
    assert stats["turns_kept_tool_call"] == 1
    assert stats["conversations_in"] == stats["regenerated"] + stats["kept_original"] + sum(
        v for k, v in stats.items() if k.startswith("dropped."))
    # a conversation cut after a turn that hit max_new_tokens ends with that turn
    for rec in out:
        assert rec["messages"][-1]["role"] == "assistant"


def test_tokenize_trains_on_exactly_the_generated_ids(tmp_path, model, tok, stop):
    """regenerate -> tokenize on a tokenizer where the random target's answers do not survive decode + encode: every
    generated answer sits in its tokenized row right after the prompt the target was given (earlier answers as
    their ids: the second turn of conversation a too), as the very ids it generated, and the loss mask covers
    exactly them (the stop token included, the template's newline after it not); an answer cut at the token
    budget ends its row; the two stages' reports reconcile."""
    from draftsmith import tokenize as tk

    regen = Regenerator(model, tok, shard_settings(max_new_tokens=12, batch_size=3), stop)
    given = []  # the prompts the engine ran
    engine_generate = regen.engine.generate
    regen.engine.generate = lambda prompts, on_done=None, on_step=None: (
        given.extend(map(list, prompts)), engine_generate(prompts, on_done, on_step))[1]
    src = _write(tmp_path / "curated.parquet", json.loads(json.dumps(CONVERSATIONS)))
    report = regenerate_file(src, tmp_path / "regenerated.parquet", regen, target_key="tiny", chunk_size=8)
    records = pq.read_table(tmp_path / "regenerated.parquet").to_pylist()
    turns = [(r, j, m["generated_ids"]) for r in records for j, m in enumerate(r["messages"])
             if m["generated_ids"] is not None]
    assert len(turns) == report["counts"]["turns_regenerated"] == 4
    # the premise: the text does not give the ids back (the 0 of 12 on this tokenizer)
    answers = [ids[:-1] if ids[-1] in stop else ids for _, _, ids in turns]
    assert sum(tok(tok.decode(a), add_special_tokens=False)["input_ids"] == a for a in answers) < len(turns)

    worker = tk.ConversationTokenizer(tok, tk.TokenizeOptions.from_mapping(max_length=512), stop_ids=stop)
    tok_report = tk.tokenize_file(tmp_path / "regenerated.parquet", tmp_path / "tokenized.parquet", worker,
                                  fingerprint="tiny")
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "tokenized.parquet").to_pylist()}
    assert set(rows) == {"a", "b", "c"}  # one row per conversation (ChatML is prefix-stable)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    supervised = {k: [] for k in rows}
    stopped = cut = 0
    for rec, j, ids in turns:
        prompt = render_prompt(tok, rec["messages"][:j], rec["tools"], stop_ids=stop)
        assert prompt in given  # what the target was given for this turn
        row = rows[rec["id"]]
        end = len(prompt) + len(ids)
        assert row["input_ids"][:end] == prompt + ids
        assert row["loss_mask"][len(prompt) - 1:end] == [0] + [1] * len(ids)
        supervised[rec["id"]] += list(range(len(prompt), end))
        if ids[-1] in stop:  # then the template's newline after the end-of-turn, not supervised
            stopped += 1
            assert row["input_ids"][end:end + 1] == newline and row["loss_mask"][end] == 0
        else:  # cut at max_new_tokens: no end-of-turn the target never produced, the row ends with its ids
            cut += 1
            assert len(row["input_ids"]) == end and j == len(rec["messages"]) - 1
    assert stopped and cut
    # nothing else supervised but c's kept tool-call turn, rendered by this template as its end-of-turn alone
    tool_turn = render_prompt(tok, records[2]["messages"][:1])
    supervised["c"].append(len(tool_turn))
    for k, row in rows.items():
        assert [i for i, v in enumerate(row["loss_mask"]) if v] == sorted(supervised[k]), k
    counts = report["counts"]
    assert tok_report["generated"] == {
        "turns": counts["turns_regenerated"], "cut_at_max_new_tokens": counts["cut.hit_max_new_tokens"],
        "ids": counts["tokens_generated"] + counts["turns_regenerated"] - counts["cut.hit_max_new_tokens"]}


def test_cuts_and_drops_are_counted(model, tok, stop):
    convs = json.loads(json.dumps(CONVERSATIONS))
    # first turn only
    out, stats = Regenerator(model, tok, shard_settings(max_new_tokens=12, max_turns=1), stop
                             ).regenerate(convs)
    a = next(r for r in out if r["id"] == "a")["messages"]
    assert [m["role"] for m in a] == ["system", "user", "assistant"]
    # a's second turn is cut; c's first regenerated turn comes after its kept tool call
    assert stats["cut.max_turns_reached"] == 1 and stats["turns_removed_by_cut"] == 1
    check_counts(stats)
    # prompts too long: every conversation's first turn is over the limit -> all dropped, counted
    out, stats = Regenerator(model, tok, shard_settings(max_new_tokens=4, tokenize={"max_length": 3}), stop
                             ).regenerate(json.loads(json.dumps(CONVERSATIONS)))
    assert [r["id"] for r in out] == ["c"]  # c keeps its original tool-call turn, its text turn is cut
    assert stats["dropped.prompt_over_max_prompt_tokens"] == 2 and stats["cut.prompt_over_max_prompt_tokens"] == 3
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"]
    check_counts(stats)
    # an answer that hits max_new_tokens is kept and ends its conversation
    out, stats = Regenerator(model, tok, shard_settings(max_new_tokens=1), [2]).regenerate(
        json.loads(json.dumps(CONVERSATIONS[:1])))
    assert stats["cut.hit_max_new_tokens"] == 1 and stats["turns_removed_by_cut"] == 1
    assert len(tok(out[0]["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) >= 1
    check_counts(stats)


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), path)
    return path


def test_stage_output_schema_metadata_and_resume(tmp_path, target_dir, monkeypatch):
    src = _write(tmp_path / "train.parquet", json.loads(json.dumps(CONVERSATIONS)))
    settings = shard_settings(max_new_tokens=12, batch_size=2, chunk_size=1)
    report = run(conversations=src, target_dir=target_dir, output=tmp_path / "full.parquet", settings=settings,
                 device="cpu")
    full = pq.read_table(tmp_path / "full.parquet")
    assert full.schema.remove_metadata().equals(REGENERATED)
    assert read_report(tmp_path / "full.parquet") == report
    assert report["counts"]["conversations_in"] == 3 and report["stop_token_ids"] == [2]
    assert not (tmp_path / "full.parquet.parts").exists()

    # a job killed during its third part keeps the first two; the rerun only does the third
    calls = []
    real = Regenerator.regenerate

    def dying(self, records):
        calls.append(records[0]["id"])
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(self, records)

    monkeypatch.setattr(Regenerator, "regenerate", dying)
    with pytest.raises(KeyboardInterrupt):
        run(conversations=src, target_dir=target_dir, output=tmp_path / "out.parquet", settings=settings,
            device="cpu")
    assert not (tmp_path / "out.parquet").exists()
    assert sorted(p.name for p in (tmp_path / "out.parquet.parts").iterdir()) == [
        "part-000000.parquet", "part-000001.parquet"]
    calls.clear()
    monkeypatch.setattr(Regenerator, "regenerate", lambda self, r: (calls.append(r[0]["id"]), real(self, r))[1])
    run(conversations=src, target_dir=target_dir, output=tmp_path / "out.parquet", settings=settings,
        device="cpu")
    assert calls == ["c"]
    assert pq.read_table(tmp_path / "out.parquet").replace_schema_metadata(None).equals(
        full.replace_schema_metadata(None))
    assert read_report(tmp_path / "out.parquet")["counts"] == report["counts"]

    # parts of other settings are stale: redone, never mixed in
    (tmp_path / "out.parquet.parts").mkdir()
    pq.write_table(pq.read_table(tmp_path / "out.parquet").slice(0, 1).replace_schema_metadata(
        {PART_KEY: json.dumps({"key": "other", "stats": {}}).encode()}), tmp_path / "out.parquet.parts" /
        "part-000000.parquet")
    calls.clear()
    run(conversations=src, target_dir=target_dir, output=tmp_path / "out.parquet",
        settings=shard_settings(max_new_tokens=12, batch_size=2, chunk_size=1), device="cpu")
    assert calls == ["a", "b", "c"]


def test_fuse_compiles_the_target_and_keeps_the_answers(tmp_path, target_dir):
    """regenerate.fuse: true runs the stage with the target's norms and MLPs compiled (draftsmith.fused) and writes
    the same rows as the eager run (float32); the report says what was fused; "auto" on the CPU fuses nothing;
    afterwards the target's modules are eager again (fused_target is scoped)."""
    src = _write(tmp_path / "train.parquet", json.loads(json.dumps(CONVERSATIONS)))
    out = {}
    for fuse in ("auto", True):
        settings = shard_settings(max_new_tokens=12, batch_size=2, engine="static", fuse=fuse)
        report = run(conversations=src, target_dir=target_dir, output=tmp_path / f"{fuse}.parquet",
                     settings=settings, device="cpu")
        out[fuse] = (pq.read_table(tmp_path / f"{fuse}.parquet").replace_schema_metadata(None), report["fused"])
    assert out["auto"][1]["enabled"] is False and out["auto"][1]["compiled"] == {}
    assert out[True][1]["enabled"] is True
    assert out[True][1]["compiled"] == {"LlamaRMSNorm": 9, "LlamaMLP": 4}  # 4 layers x 2 norms + the final norm
    assert out[True][0].equals(out["auto"][0])
    with pytest.raises(ValueError, match="fuse must be true, false or 'auto'"):
        shard_settings(fuse="yes")


def _conversations(n: int, tag: str = "") -> list[dict]:
    """``n`` curated conversations cycling through CONVERSATIONS, each with its own id and user text."""
    out = []
    for i in range(n):
        rec = json.loads(json.dumps(CONVERSATIONS[i % len(CONVERSATIONS)]))
        rec["id"] = f"{rec['id']}{tag}{i}"
        for m in rec["messages"]:
            if m["role"] == "user":
                m["content"] += f" ({tag}{i})"
        out.append(rec)
    return out


def _write_groups(path, rows, row_group_size=3):
    """A curated parquet in row groups of 3 rows: parts of 2 rows straddle them."""
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), path, row_group_size=row_group_size)
    return path


def _sharded(src, folder, regen, shards, *, chunk_size=2):
    """Every shard of a ``shards``-shard run, then the assembly: ``(assembled table, its report, shard reports)``."""
    paths = [folder / f"shard-{i}.parquet" for i in range(shards)]
    reports = [regenerate_file(src, path, regen, target_key="tiny", chunk_size=chunk_size, shard=i, shards=shards)
               for i, path in enumerate(paths)]
    report = assemble_shards(paths, folder / "train.parquet")
    return pq.read_table(folder / "train.parquet"), report, reports


def test_shard_parts_cover_every_part_once():
    for parts in range(0, 12):
        for shards in range(1, 9):
            ranges = [shard_parts(parts, i, shards) for i in range(shards)]
            assert ranges[0][0] == 0 and ranges[-1][1] == parts
            assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:]))
    assert [shard_parts(4, i, 5) for i in range(5)] == [(0, 0), (0, 1), (1, 2), (2, 3), (3, 4)]
    assert num_parts(7, 2) == 4 and num_parts(8, 2) == 4 and num_parts(0, 2) == 0
    with pytest.raises(ValueError, match="shards are 0..1"):
        shard_parts(4, 2, 2)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_sharded_runs_assemble_to_the_one_shard_output(tmp_path, model, tok, stop, sampled):
    """7 conversations in parts of 2 (4 parts, input row groups of 3): 1 shard, 3 shards and 5 shards (the first
    empty) assemble to the same rows, ids and messages with the same counts; sampled answers too (2 per
    conversation at temperature 1: each part seeds from the global part number, whichever shard does it)."""
    kw = dict(temperature=1.0, num_answers=2, max_turns=1) if sampled else {}
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=8, batch_size=2, **kw), stop)
    src = _write_groups(tmp_path / "train.parquet", _conversations(7))
    runs = {n: _sharded(src, tmp_path / f"shards-{n}", regen, n) for n in (1, 3, 5)}
    one, one_report, (one_shard,) = runs[1]
    assert one.schema.remove_metadata().equals(REGENERATED)
    assert one.replace_schema_metadata(None).equals(
        pq.read_table(tmp_path / "shards-1" / "shard-0.parquet").replace_schema_metadata(None))
    assert one_report["counts"] == one_shard["counts"] and one_report["counts"]["records_in"] == 7
    assert one.num_rows == one_report["counts"]["regenerated"] + one_report["counts"].get("kept_original", 0)
    assert one_report["counts"]["turns_regenerated"] > 0
    expect_parts = {1: [[0, 4]], 3: [[0, 1], [1, 2], [2, 4]], 5: [[0, 0], [0, 1], [1, 2], [2, 3], [3, 4]]}
    for n, (table, report, shard_reports) in runs.items():
        assert [r["parts"] for r in shard_reports] == expect_parts[n]
        assert [r["shard"] for r in shard_reports] == list(range(n)) and {r["num_shards"] for r in shard_reports} == {n}
        assert table.replace_schema_metadata(None).equals(one.replace_schema_metadata(None)), n
        assert table.column("id").to_pylist() == one.column("id").to_pylist()
        assert table.column("messages").to_pylist() == one.column("messages").to_pylist()
        assert report["counts"] == one_report["counts"], n
        assert report["shards"] == shard_reports
        assert read_report(tmp_path / f"shards-{n}" / "train.parquet") == report
        assert report["seconds"] == max(r["seconds"] for r in shard_reports)
        rates = [r["new_tokens_per_s"] for r in shard_reports if r["new_tokens_per_s"] is not None]
        assert report["new_tokens_per_s"] == pytest.approx(sum(rates), abs=0.1)
        assert report["num_parts"] == 4 and report["input_rows"] == 7 and "shard" not in report
        assert not list((tmp_path / f"shards-{n}").glob("*.parts"))
    # more shards than parts: shard 0 of 5 holds nothing, in the regenerated schema, its counts zero
    empty = pq.read_table(tmp_path / "shards-5" / "shard-0.parquet")
    assert empty.num_rows == 0 and empty.schema.remove_metadata().equals(REGENERATED)
    assert runs[5][2][0]["counts"] == {"conversations_in": 0, "records_in": 0, "turns_in": 0}
    assert runs[5][2][0]["new_tokens_per_s"] is None
    if sampled:
        by_id = {r["id"]: r["messages"][-1]["content"] for r in one.to_pylist()}
        assert len(by_id) == 14 and any(by_id[i] != by_id.get(f"{i}@1") for i in by_id if "@" not in i)


def _with_report(src, dest, **changes):
    """A copy of shard file ``src`` whose report has ``changes``."""
    table = pq.read_table(src)
    report = {**read_report(src), **changes}
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(report).encode()}), dest)
    return dest


def test_assembly_refuses_a_missing_or_foreign_shard(tmp_path, model, tok, stop):
    """assemble_shards names the file: a shard missing in the middle or at the end, shards out of order, a shard of
    another input, of other settings, a file without a shard report, a file that does not exist; nothing written."""
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=6, batch_size=2), stop)
    src = _write_groups(tmp_path / "train.parquet", _conversations(7))
    _sharded(src, tmp_path / "run", regen, 3)
    s0, s1, s2 = (tmp_path / "run" / f"shard-{i}.parquet" for i in range(3))
    out = tmp_path / "out.parquet"
    with pytest.raises(ValueError, match=rf"{s2}: is shard 2 of 3, given as shard 1: a shard is missing"):
        assemble_shards([s0, s2], out)
    with pytest.raises(ValueError, match=rf"{s1}: the shards end at part 2 of the input's 4: a shard is missing"):
        assemble_shards([s0, s1], out)
    with pytest.raises(ValueError, match=rf"{s1}: is shard 1 of 3, given as shard 0"):
        assemble_shards([s1, s0, s2], out)
    # shard 1 of the same shape over another input file
    other = _write_groups(tmp_path / "other.parquet", _conversations(7, tag="x"))
    foreign = tmp_path / "foreign" / "shard-1.parquet"
    regenerate_file(other, foreign, regen, target_key="tiny", chunk_size=2, shard=1, shards=3)
    with pytest.raises(ValueError, match=rf"{foreign}: a shard of another regenerate run than {s0}: input "):
        assemble_shards([s0, foreign, s2], out)
    seeded = _with_report(s1, tmp_path / "seeded.parquet", seed=7)
    with pytest.raises(ValueError, match=rf"{seeded}: a shard of another regenerate run .*seed 7 != 0"):
        assemble_shards([s0, seeded, s2], out)
    overlapping = _with_report(s1, tmp_path / "overlap.parquet", parts=[0, 2])
    with pytest.raises(ValueError, match=rf"{overlapping}: holds parts \[0, 2\) but the parts before it end at 1"):
        assemble_shards([s0, overlapping, s2], out)
    plain = _write(tmp_path / "plain.parquet", _conversations(2))
    with pytest.raises(ValueError, match=rf"{plain}: no draftsmith.regenerate metadata"):
        assemble_shards([s0, plain, s2], out)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'run' / 'shard-9.parquet'}"):
        assemble_shards([s0, s1, tmp_path / "run" / "shard-9.parquet"], out)
    assert not out.exists()
    assemble_shards([s0, s1, s2], out)  # the shards of one run still assemble
    assert pq.read_table(out).num_rows == pq.read_table(tmp_path / "run" / "train.parquet").num_rows


def test_a_killed_shard_resumes_from_its_finished_parts(tmp_path, model, tok, stop, monkeypatch):
    """Shard 1 of 2 (parts 2 and 3 of 4) killed during part 3 keeps part 2 in shard-1.parquet.parts; the rerun
    regenerates part 3 only and writes what an uninterrupted shard writes. A part finished for another part range
    (the same folder under 4 shards) is reused: a part does not depend on its shard."""
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=6, batch_size=2), stop)
    src = _write_groups(tmp_path / "train.parquet", _conversations(7))
    full = regenerate_file(src, tmp_path / "full" / "shard-1.parquet", regen, target_key="tiny", chunk_size=2,
                           shard=1, shards=2)
    out = tmp_path / "shard-1.parquet"
    calls = []
    real = Regenerator.regenerate

    def dying(self, records):
        calls.append([r["id"] for r in records])
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(self, records)

    monkeypatch.setattr(Regenerator, "regenerate", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate_file(src, out, regen, target_key="tiny", chunk_size=2, shard=1, shards=2)
    assert calls == [["b4", "c5"], ["a6"]] and not out.exists()
    assert [p.name for p in (tmp_path / "shard-1.parquet.parts").iterdir()] == ["part-000002.parquet"]
    calls.clear()
    monkeypatch.setattr(Regenerator, "regenerate",
                        lambda self, r: (calls.append([x["id"] for x in r]), real(self, r))[1])
    report = regenerate_file(src, out, regen, target_key="tiny", chunk_size=2, shard=1, shards=2)
    assert calls == [["a6"]]
    assert pq.read_table(out).replace_schema_metadata(None).equals(
        pq.read_table(tmp_path / "full" / "shard-1.parquet").replace_schema_metadata(None))
    assert report["counts"] == full["counts"] and report["parts"] == [2, 4]
    assert not (tmp_path / "shard-1.parquet.parts").exists()

    # part 2 finished by shard 1 of 2 (parts [2, 4)), resumed as shard 2 of 4 (parts [2, 3), its own folder): the
    # part is taken from shard-1's folder, nothing is regenerated
    monkeypatch.setattr(Regenerator, "regenerate", dying)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        regenerate_file(src, out, regen, target_key="tiny", chunk_size=2, shard=1, shards=2)
    assert [p.name for p in (tmp_path / "shard-1.parquet.parts").iterdir()] == ["part-000002.parquet"]
    calls.clear()
    monkeypatch.setattr(Regenerator, "regenerate",
                        lambda self, r: (calls.append([x["id"] for x in r]), real(self, r))[1])
    report = regenerate_file(src, tmp_path / "shard-2.parquet", regen, target_key="tiny", chunk_size=2, shard=2,
                             shards=4)
    assert report["parts"] == [2, 3] and calls == [] and report["new_tokens_per_s"] is None
    # shard 2's folder is gone; shard 1's, emptied, stays for assembly to remove (a running shard may still use it)
    assert not (tmp_path / "shard-2.parquet.parts").exists() and not any((tmp_path / "shard-1.parquet.parts").iterdir())
    # a stale part (other settings) is redone, never mixed in
    other = Regenerator(model, tok, shard_settings(max_new_tokens=5, batch_size=2), stop)
    monkeypatch.setattr(Regenerator, "regenerate", dying)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        regenerate_file(src, out, other, target_key="tiny", chunk_size=2, shard=1, shards=2)
    calls.clear()
    monkeypatch.setattr(Regenerator, "regenerate",
                        lambda self, r: (calls.append([x["id"] for x in r]), real(self, r))[1])
    regenerate_file(src, tmp_path / "shard-2.parquet", regen, target_key="tiny", chunk_size=2, shard=2, shards=4)
    assert calls == [["b4", "c5"]]


def test_a_killed_sharded_run_resumes_with_another_shard_count(tmp_path, model, tok, stop, monkeypatch):
    """2 shards killed after part 0 (shard 0) and part 2 (shard 1) of 4, resumed with 3 shards: each finished part
    is taken from the old layout's folders, only parts 1 and 3 are regenerated, the assembled output equals a
    one-shard run's, and no parts folder is left."""
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=6, batch_size=2), stop)
    src = _write_groups(tmp_path / "train.parquet", _conversations(7))
    one, _, _ = _sharded(src, tmp_path / "one", regen, 1)
    run = tmp_path / "run"
    real = Regenerator.regenerate
    calls = []

    def dying(self, records):
        calls.append([r["id"] for r in records])
        if len(calls) % 2 == 0:  # the second part of each shard
            raise KeyboardInterrupt("killed")
        return real(self, records)

    monkeypatch.setattr(Regenerator, "regenerate", dying)
    for shard in range(2):
        with pytest.raises(KeyboardInterrupt):
            regenerate_file(src, run / f"shard-{shard}.parquet", regen, target_key="tiny", chunk_size=2,
                            shard=shard, shards=2)
    assert sorted(p.name for p in run.glob("*.parts/*")) == ["part-000000.parquet", "part-000002.parquet"]
    calls.clear()
    monkeypatch.setattr(Regenerator, "regenerate",
                        lambda self, r: (calls.append([x["id"] for x in r]), real(self, r))[1])
    shards = [run / f"shard-{i}.parquet" for i in range(3)]  # parts [0, 1), [1, 2), [2, 4)
    for i, path in enumerate(shards):
        regenerate_file(src, path, regen, target_key="tiny", chunk_size=2, shard=i, shards=3)
    assert calls == [["c2", "a3"], ["a6"]]  # parts 1 and 3
    assemble_shards(shards, run / "train.parquet")
    assert pq.read_table(run / "train.parquet").replace_schema_metadata(None).equals(one.replace_schema_metadata(None))
    assert not list(run.glob("*.parts"))


def test_sampled_answers_are_separate_rows_and_counts_reconcile(model, tok, stop):
    """num_answers = 2 at temperature 1: each conversation is answered twice (ids a, a@1, ...), the copies come
    from sampling (not all equal), a copy with nothing to sample (none here) would be dropped, counts reconcile."""
    torch.manual_seed(0)
    settings = shard_settings(max_new_tokens=12, batch_size=3, temperature=1.0, num_answers=2, max_turns=1)
    out, stats = Regenerator(model, tok, settings, stop).regenerate(json.loads(json.dumps(CONVERSATIONS)))
    ids = sorted(r["id"] for r in out)
    assert ids == ["a", "a@1", "b", "b@1", "c", "c@1"]
    assert stats["records_in"] == 3 and stats["conversations_in"] == 6
    assert stats["conversations_in"] == stats["regenerated"] + stats["kept_original"] + sum(
        v for k, v in stats.items() if k.startswith("dropped."))
    check_counts(stats)
    by_id = {r["id"]: r for r in out}
    answers = [(by_id[i]["messages"][-1]["content"], by_id[f"{i}@1"]["messages"][-1]["content"]) for i in "ab"]
    assert any(x != y for x, y in answers)


def test_greedy_copies_and_unknown_engines_are_refused():
    with pytest.raises(ValueError, match="temperature > 0"):
        shard_settings(num_answers=2)
    with pytest.raises(ValueError, match="engine must be one of"):
        shard_settings(engine="tgi")


def test_settings_hold_exactly_the_rules_keys():
    """Both rules' settings hold exactly the keys draftsmith.stages names for them (output and runtime), built from
    the rule as the scripts do (schema defaults here); the prompt limit is tokenize.max_length; a misspelled key is
    refused with the key it resembles."""
    from draftsmith.config import schema_defaults
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.stages import STAGE_KEYS, rule_params

    config = {section: schema_defaults(section) for section in ("regenerate", "target", "tokenize", "gpu")}
    for cls in (RegenerateShardSettings, RegenerateSettings):
        keys = {section: set(kinds.get("output", ()) + kinds.get("runtime", ()))
                for section, kinds in STAGE_KEYS[cls.STAGE].items()}
        assert {section: set(names) for section, names in cls.keys().items()} == keys
        built = cls.from_rule(rule_params(config, cls.STAGE), config)
        assert built.to_dict() == {section: {k: config[section][k] for k in names} for section, names in keys.items()}
    assert shard_settings(tokenize={"max_length": 77}).max_prompt_tokens == 77
    with pytest.raises(ValueError, match="regenerate.max_turn: no such key .*did you mean 'max_turns'"):
        shard_settings(max_turn=1)


def test_auto_engine_is_generate_on_cpu(model):
    assert resolve_engine("auto", model) == "generate"
    assert resolve_engine("auto", tiny_target("qwen3_5")) == "generate"
    assert resolve_engine("continuous", model) == "continuous"
    assert static_engine_supported(tiny_target("qwen3_5")) == (True, "")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "qwen3_next"])
def test_static_engine_equals_unbatched_generate(kind):
    """The static-cache engine (left padding, a shared cache index, rows masked before their padding, decode
    steps that would be CUDA graphs on a GPU) gives each prompt's unbatched greedy answer exactly, for prompts of
    very different lengths in batches of 3, stopping rows (stop token kept at the end), the token budget, and a
    prefill run in slices of the sequence; hybrid Gated DeltaNet targets too (their recurrent states reset per
    batch, left padding kept out of them)."""
    tgt = tiny_target(kind, initializer_range=0.1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 40, 7, 19, 64, 5, 11)]
    refs = [tgt.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    stop = refs[1][4]  # a token prompt 1 generates at step 4: its row (and maybe others) stops early
    for prefill_tokens in (32768, 20):  # whole prompts at once, and a prefill in slices of 6 positions
        # pad with a token whose embedding is not zero (token 0 is the tiny config's padding_idx, embedded as
        # zeros: a recurrent layer would never see it): padding must be masked, not harmless by accident
        engine = StaticBatchEngine(tgt, pad_id=7, stop_ids=[stop], batch_size=3, max_new_tokens=20,
                                   check_every=2, prefill_tokens=prefill_tokens)
        out = engine.generate(prompts)
        for p, ref, got in zip(prompts, refs, out):
            cut = next((i + 1 for i, t in enumerate(ref) if t == stop), len(ref))
            assert got[:cut] == ref[:cut], (len(p), prefill_tokens, got, ref)
    first = refs[1].index(stop)
    assert _split_stop(out[1], {stop}) == (refs[1][:first], True)
    with pytest.raises(ValueError, match="cannot run"):
        StaticBatchEngine(tiny_target("qwen3", sliding_window=8, use_sliding_window=True,
                                      layer_types=["sliding_attention"] * 4), pad_id=0, stop_ids=[2],
                          batch_size=2, max_new_tokens=4)


def test_static_engine_phase_report_counts_every_forward(tmp_path, model, tok, stop):
    """The engine's phase report reconciles with what it ran: 5 prompts in batches of 2, 2, 1 rows, each batch
    prefilled at its longest prompt (padding counted) and decoded max_new_tokens - 1 one-token steps (no row
    stops: the stop id is never generated), so decode row-steps + one token per row from the prefill = the tokens
    generated; the stage report and its log line carry it."""
    g = torch.Generator().manual_seed(0)
    lengths = (9, 4, 30, 12, 6)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    engine = StaticBatchEngine(model, pad_id=0, stop_ids=[10 ** 6], batch_size=2, max_new_tokens=7)
    out = engine.generate(prompts)
    assert [len(o) for o in out] == [7] * 5
    p = engine.phase_report()
    assert (p["batches"], p["mean_rows"]) == (3, 1.67)  # 5 rows / 3 batches
    assert p["prefill_tokens"] == 2 * 30 + 2 * 9 + 1 * 4  # longest first: (30, 12), (9, 6), (4,)
    assert (p["decode_steps"], p["decode_row_steps"]) == (3 * 6, 5 * 6)
    assert p["decode_row_steps"] + 5 == sum(len(o) for o in out)
    assert p["prefill_s"] > 0 and p["decode_s"] > 0 and p["capture_s"] == 0  # no graphs on the CPU
    assert p["decode_ms_per_step"] == pytest.approx(1e3 * engine.phases["decode_s"] / 18, abs=1e-3)
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=12, batch_size=3), stop,
                        engine=StaticBatchEngine(model, pad_id=0, stop_ids=stop, batch_size=3,
                                                 max_new_tokens=12))
    src = _write(tmp_path / "train.parquet", json.loads(json.dumps(CONVERSATIONS)))
    report = regenerate_file(src, tmp_path / "out.parquet", regen, target_key="tiny", chunk_size=512)
    phases = report["static_engine"]
    assert phases == regen.engine.phase_report() and phases["batches"] >= 2
    # rows keep decoding after their stop token until the batch stops: at least the tokens the answers kept
    assert phases["decode_row_steps"] + regen.engine.phases["rows"] >= report["counts"]["tokens_generated"]
    assert "static engine: prefill" in summary(report) and "ms a step" in summary(report)


def _held_bytes(cache) -> int:
    """Bytes of every tensor the cache's layers hold that has a row dimension (keys, values, conv and recurrent
    states, whatever the layer class names them; the 0-d length counters left out)."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            for t in (value.values() if isinstance(value, dict) else [value]):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("kind, dtype, overrides", [
    ("llama", torch.float32, {}),
    ("qwen3", torch.float32, {}),
    ("qwen3", torch.float32, dict(sliding_window=8, use_sliding_window=True,  # 8 positions < the cache's 40
                                  layer_types=["sliding_attention", "full_attention"] * 2)),
    ("qwen3_5", torch.float32, {}),
    ("qwen3_5", torch.bfloat16, {}),  # conv state in bf16, recurrent state in float32
    ("qwen3_next", torch.float32, {}),
])
def test_cache_bytes_per_row_equals_what_the_static_cache_holds(kind, dtype, overrides):
    """cache_bytes_per_row is exact: after a prefill and decode steps through transformers' StaticCache of 40
    positions and 3 rows, the tensors the cache holds take rows x cache_bytes_per_row(40) bytes, for attention-only,
    sliding-window and hybrid Gated DeltaNet targets, in float32 and bf16."""
    from transformers import StaticCache

    from draftsmith.hybrid_cache import cache_kwargs

    tgt = tiny_target(kind, **overrides).to(dtype)
    rows, length = 3, 40
    cache = StaticCache(config=tgt.config, max_cache_len=length)
    ids = torch.randint(3, 500, (rows, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = tgt(input_ids=ids, use_cache=True, **cache_kwargs(tgt, cache))
        for _ in range(3):
            out = tgt(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwargs(tgt, cache))
    assert _held_bytes(cache) == rows * cache_bytes_per_row(tgt.config, length, dtype)
    if (kind, dtype) == ("qwen3_5", torch.float32):  # by hand: 3 Gated DeltaNet layers + 1 attention layer
        conv = (2 * 2 * 16 + 4 * 16) * 4 * 4  # [conv_dim, kernel] float32
        recurrent = 4 * 16 * 16 * 4  # [value heads, key dim, value dim] float32
        assert cache_bytes_per_row(tgt.config, length, dtype) == 3 * (conv + recurrent) + 2 * 2 * 16 * length * 4


def test_cache_bytes_per_row_of_the_27b_hybrid_shape():
    """The Qwen3.5-27B shape (48 Gated DeltaNet + 16 attention layers) in bf16 at 3,072 + 256 positions: 355.75
    MiB per row, so 64 rows take 22.2 GiB on top of 50.1 GiB of weights (the rehearsal's 81.9 GiB peak); unknown
    layer types are refused."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_extract import QWEN35_27B, qwen35_config

    cfg = qwen35_config(QWEN35_27B)
    per_row = cache_bytes_per_row(cfg, 3328, torch.bfloat16)
    assert per_row == 48 * (10240 * 4 * 2 + 48 * 128 * 128 * 4) + 16 * 2 * 4 * 256 * 3328 * 2
    assert per_row / 2 ** 20 == 355.75
    cfg.layer_types = ["conv"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="'conv' layers is unknown"):
        cache_bytes_per_row(cfg, 3328, torch.bfloat16)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_static_engine_caps_rows_to_the_memory_budget(kind, model, tok, caplog, monkeypatch):
    """A budget that fits exactly 2 rows of the batch's cache (after what is allocated already) makes a
    batch_size-4 run go in batches of 2, 2, 2, 1 (the prompts a cut batch leaves go to the next), logged and
    counted; the answers equal the uncapped run's and unbatched greedy generate's token for token (float32). A
    budget too small for one row runs 1 row with a warning. On the CPU, memory_gib is ignored."""
    tgt = tiny_target(kind, initializer_range=0.1)
    g = torch.Generator().manual_seed(0)
    lengths = (3, 40, 7, 19, 64, 5, 11)  # + 20 new tokens: one cache length (128) for every batch
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    refs = [tgt.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    stop = refs[1][4]

    def run_engine(**kw):
        # prefill slices of 8 tokens over all rows: the workspace estimate is the same for every batch
        engine = StaticBatchEngine(tgt, pad_id=7, stop_ids=[stop], batch_size=4, max_new_tokens=20, check_every=2,
                                   prefill_tokens=8, **kw)
        sizes = []
        return engine, engine.generate(prompts, sizes.append), sizes

    plain, uncapped, sizes = run_engine()
    assert plain.memory_budget is None and sizes == [4, 3] and plain.rows_capped_batches == 0
    allocated = 10 ** 6  # "weights" on a fake device, which also holds the cache of the engine's last batch
    budget = allocated + plain.projected_bytes(2, 64, 128)
    assert plain.projected_bytes(3, 64, 128) > plain.projected_bytes(2, 64, 128)
    monkeypatch.setattr(StaticBatchEngine, "allocated_bytes", lambda self: allocated + self._held_cache_bytes())
    with caplog.at_level("INFO", logger="draftsmith.regenerate"):
        capped, out, sizes = run_engine(memory_budget_bytes=budget)
        assert sizes == [2, 2, 2, 1] and capped.rows_capped_batches == 3
        assert "2 of 4 rows on a 128-position cache" in caplog.text
        caplog.clear()
        tiny, out_1, sizes_1 = run_engine(memory_budget_bytes=allocated + 1)
    assert sizes_1 == [1] * 7 and tiny.rows_capped_batches == 6
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "too small for one row" in warnings[0].getMessage()
    assert warnings[0].args[1] * 2 ** 30 == pytest.approx(tiny.projected_bytes(1, 64, 128) - 1)  # short by
    for ref, a, b, c in zip(refs, uncapped, out, out_1):
        cut = next((i + 1 for i, t in enumerate(ref) if t == stop), len(ref))
        assert a[:cut] == b[:cut] == c[:cut] == ref[:cut]
    settings = shard_settings(max_new_tokens=4, engine="static", memory_gib=1e-6)
    assert Regenerator(model, tok, settings, [2]).engine.memory_budget is None  # the CPU: no cap
    assert shard_settings().regenerate.memory_gib is None
    with pytest.raises(ValueError, match="memory_gib must be > 0"):
        shard_settings(memory_gib=0)


def test_memory_plan_counts_the_captured_decode_step_of_hybrid_targets(monkeypatch):
    """With CUDA graphs, a hybrid target's captured decode step keeps every Gated DeltaNet layer's new states in its
    graph pool (rows x cache_bytes_per_row(config, 0)): the projection adds it, the last batch's graph counts as
    held, and a budget that fits a batch's cache and prefill but not its graph cuts the rows. Attention-only targets
    and runs without graphs add nothing. At the Qwen3.5-27B shape, 256 rows: 36.9 GiB (measured: 37.1)."""
    import sys
    from pathlib import Path

    hybrid, plain = tiny_target("qwen3_5"), tiny_target("llama")
    graphs = StaticBatchEngine(hybrid, pad_id=0, stop_ids=[2], batch_size=8, max_new_tokens=4)
    graphs.cuda_graphs = True  # as on a GPU
    eager = StaticBatchEngine(hybrid, pad_id=0, stop_ids=[2], batch_size=8, max_new_tokens=4, cuda_graphs=False)
    attention = StaticBatchEngine(plain, pad_id=0, stop_ids=[2], batch_size=8, max_new_tokens=4)
    attention.cuda_graphs = True
    states = cache_bytes_per_row(hybrid.config, 0, torch.float32)
    assert states > 0 and graphs.decode_graph_bytes(8) == 8 * states
    assert eager.decode_graph_bytes(8) == 0 and attention.decode_graph_bytes(8) == 0
    assert graphs.projected_bytes(8, 40, 128) == eager.projected_bytes(8, 40, 128) + 8 * states
    graphs._graph = ((8, 128), None, None)  # the last batch's shape
    assert graphs._held_cache_bytes() == 8 * (cache_bytes_per_row(hybrid.config, 128, torch.float32) + states)
    graphs._graph = None
    # a budget of exactly what 8 rows need without the graph term: the graph engine cuts the batch
    monkeypatch.setattr(StaticBatchEngine, "allocated_bytes", lambda self: 0)
    for engine in (graphs, eager):
        engine.memory_budget = eager.projected_bytes(8, 40, 128)
    assert eager._rows(8, 40, 128) == 8 and graphs._rows(8, 40, 128) < 8

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_extract import QWEN35_27B, qwen35_config

    per_row = cache_bytes_per_row(qwen35_config(QWEN35_27B), 0, torch.bfloat16)
    assert round(256 * per_row / 2 ** 30, 1) == 36.9


def test_report_holds_the_memory_budget_and_capped_batches(tmp_path, model, tok, stop, monkeypatch):
    """The stage report names the static engine's memory budget (GiB) and how many batches it cut to fit it."""
    monkeypatch.setattr(StaticBatchEngine, "allocated_bytes", lambda self: 2 ** 30 - 1)  # a full fake GPU
    engine = StaticBatchEngine(model, pad_id=0, stop_ids=stop, batch_size=3, max_new_tokens=12,
                               memory_budget_bytes=2 ** 30)
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=12, batch_size=3), stop, engine=engine)
    src = _write(tmp_path / "train.parquet", json.loads(json.dumps(CONVERSATIONS)))
    report = regenerate_file(src, tmp_path / "out.parquet", regen, target_key="tiny", chunk_size=512)
    assert report["engine"] == "static" and report["memory_budget_gib"] == 1.0
    # first round: 3 prompts in batches of 1, 1, 1 (two cut); second round: a's second turn alone (not cut)
    assert report["rows_capped_batches"] == engine.rows_capped_batches == 2
    assert report["counts"]["turns_regenerated"] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fuse", [False, True], ids=["eager-modules", "fused"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_static_engine_with_cuda_graphs_equals_unbatched_generate(kind, fuse):
    """On a GPU the decode step is a captured CUDA graph (hybrid targets: their recurrent states in the graph's
    static buffers, put back after the capture's warm-up forwards): float32 answers equal unbatched greedy
    generate, batch after batch on one captured graph; also with the target fused (regenerate.fuse: compiled
    norms / MLPs inside the captured graph, fla's conv1d in the prefill)."""
    from draftsmith import fused

    tgt = tiny_target(kind, initializer_range=0.1).cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 30, 12, 25, 6, 17)]
    refs = [tgt.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = StaticBatchEngine(tgt, pad_id=7, stop_ids=[1], batch_size=2, max_new_tokens=24)
    with fused.fused_target(tgt, enabled=fuse) as report:
        out = engine.generate(prompts)
    assert report["enabled"] is fuse and bool(report["compiled"]) is fuse
    assert engine.graphs_captured >= 1 and engine.graph_failures == 0
    for ref, got in zip(refs, out):
        cut = next((i + 1 for i, t in enumerate(ref) if t == 1), len(ref))
        assert got[:cut] == ref[:cut]


def test_vllm_engine_passes_token_ids_and_stop_ids(monkeypatch):
    """The vLLM engine's glue, against a stand-in ``vllm`` module (vLLM itself is not a dependency): prompts go
    as token ids, stop ids and sampling settings as SamplingParams, and an answer vLLM ended at a stop token
    without returning it still counts as stopped."""
    import sys
    import types
    from dataclasses import dataclass as dc

    seen = {}

    @dc
    class Out:
        token_ids: list
        finish_reason: str

    class LLM:
        def __init__(self, **kw):
            seen["llm"] = kw

        def generate(self, requests, params, use_tqdm=False):
            seen["requests"], seen["params"] = requests, params
            return [types.SimpleNamespace(outputs=[Out([5, 6, 7], "stop")]),
                    types.SimpleNamespace(outputs=[Out([8, 2], "stop")]),
                    types.SimpleNamespace(outputs=[Out([9, 9, 9, 9], "length")])]

    fake = types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    engine = VLLMEngine("/models/t", dtype="bfloat16", max_new_tokens=4, stop_ids=[2, 3], temperature=0.0,
                        top_p=1.0, seed=0, max_model_len=64, trust_remote_code=False)
    out = engine.generate([[1, 2], [3], [4, 4]])
    assert seen["requests"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [4, 4]}]
    assert seen["params"].stop_token_ids == [2, 3] and seen["params"].max_tokens == 4
    assert seen["llm"]["model"] == "/models/t" and seen["llm"]["max_model_len"] == 64
    assert [_split_stop(o, {2, 3}) for o in out] == [([5, 6, 7], True), ([8], True), ([9, 9, 9, 9], False)]
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match="vllm package is not installed"):
        VLLMEngine("/models/t", dtype="bfloat16", max_new_tokens=4, stop_ids=[2], temperature=0.0, top_p=1.0,
                   seed=0, max_model_len=None, trust_remote_code=False)


def test_progress_lines_come_every_interval_with_advancing_token_counts(tmp_path, model, tok, stop, caplog,
                                                                         monkeypatch):
    """A slow target (every forward sleeps 0.2 s) regenerating one part of 3 conversations in one batch: a line at
    least every second (progress_interval 1 s), before the first conversation is done, with the new tokens of the
    batch in flight counted and rising, and an ETA once tokens are generated (issue 34: 31 minutes of
    ``0/660 (0%) ETA ?``)."""
    import re
    import time

    from tiny import assert_steady, progress_lines

    real_forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.2)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_forward)
    src = _write(tmp_path / "train.parquet", json.loads(json.dumps(CONVERSATIONS)))
    regen = Regenerator(model, tok, shard_settings(max_new_tokens=16, batch_size=4, max_turns=1), stop)
    t0 = time.time()
    with caplog.at_level("INFO", logger="draftsmith.regenerate"):
        report = regenerate_file(src, tmp_path / "out.parquet", regen, target_key="t", chunk_size=8,
                                 progress_interval=1.0)
    end = time.time() - t0
    lines = progress_lines(caplog.records, "regenerate", t0)
    assert_steady(lines, 1.0, end)
    def new_tokens(line):
        return int(re.search(r", ([\d,]+) new tok,", line).group(1).replace(",", ""))

    # the part's only batch takes > 3 s: lines while no conversation is done (after tqdm's first, at 0 s)
    in_flight = [line for _, line in lines[1:] if line.startswith("regenerate: 0/3 conv")]
    assert len(in_flight) >= 2, lines
    tokens = [new_tokens(line) for line in in_flight]
    assert tokens[0] > 0 and tokens == sorted(tokens) and tokens[-1] > tokens[0], in_flight
    assert "ETA ?" not in in_flight[-1] and re.search(r"new tok/s", in_flight[-1]), in_flight[-1]
    assert lines[-1][1].startswith("regenerate: 3/3 conv")
    assert new_tokens(lines[-1][1]) >= report["counts"]["tokens_generated"] > 0
