"""stream: the global plan of a stream-mode run (rule stream_plan) and the disk check before regeneration (disk_plan).

The plan's phases are StreamPlan's (tests/test_batch_plan.py holds them to the offline plan); here: the files the
rule writes, each slice's extraction plan, the held-out samples, the disk refusals and their message, and that the
projection before regeneration is an upper bound of what tokenize makes of the same conversations.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith import disk
from draftsmith import stream as st
from draftsmith.batch_plan import StreamPlan, split_samples
from draftsmith.disk import DiskSpaceError
from draftsmith.io import read_json
from draftsmith.stages import num_phases
from extraction import write_tokenized
from tiny import CURATED, tiny_target, tiny_tokenizer

LENGTHS = [40 + (7 * i) % 90 for i in range(120)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    tiny_target("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _settings(**sections):
    base = {"stream": {"slices": 3, "reuse": 1, "heldout_samples": 5},
            "train": {"gpus": 1, "seed": 0, "epochs": 2, "tokens_per_batch": 256, "grad_accum": 1,
                      "eval_fraction": 0.1},
            "extract": {"shards": 2, "storage_dtype": "bfloat16"},
            "drafter": {"num_layers": 1, "target_layer_ids": [1, 3]}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return st.StreamPlanSettings.from_config(base)


def test_the_plan_writes_each_slice_s_extraction_plan(tmp_path, target):
    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    settings = _settings()
    plan = st.build_stream_plan(tmp_path / "train.parquet", target, tmp_path / "stream", settings)
    assert read_json(tmp_path / "stream" / "plan.json") == plan
    assert len(plan["phases"]) == num_phases(2, 3, 1) == 6
    train_rows, held = split_samples(list(range(len(LENGTHS))), 0.1, 0)
    expected = StreamPlan(LENGTHS, train_rows, 256, seed=0, world=1, grad_accum=1, epochs=2, slices=3)
    assert plan["total_steps"] == expected.total_steps
    for phase, want in zip(plan["phases"], expected.phases):
        assert (phase["first_step"], phase["end_step"]) == (want.first_step, want.end_step)
        extraction = read_json(tmp_path / "stream" / "plans" / f"phase-{phase['phase']}.json")
        assert extraction["subset"] == {"phase": phase["phase"]} and extraction["num_shards"] == 2
        rows = sorted(r for s in extraction["shards"] for r in s["rows"])
        assert rows == list(want.samples) and phase["num_samples"] == len(rows)
        assert phase["tokens"] == sum(LENGTHS[r] for r in rows)
        assert extraction["layer_ids"] == [1, 3]
    heldout = read_json(tmp_path / "stream" / "plans" / "heldout.json")
    kept = heldout["shards"][0]["rows"]
    assert len(kept) == 5 and set(kept) <= set(held)  # stream.heldout_samples of the held-out split
    # a phase's slice never holds a held-out row; the slices of a pass are disjoint
    for x in range(2):
        seen: set[int] = set()
        for p in plan["phases"][3 * x:3 * x + 3]:
            rows = {r for s in read_json(tmp_path / "stream" / "plans" / f"phase-{p['phase']}.json")["shards"]
                    for r in s["rows"]}
            assert not rows & set(held) and not rows & seen
            seen |= rows


def test_the_plan_counts_the_target_topk_and_records_it_only_when_stored(tmp_path, target):
    """extract.store_target_topk = 8 adds 6 x 8 bytes a token to the slices' projection and is recorded with the
    plan's settings; at its default 0 the plan records the settings it did before the key existed."""
    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    plain = st.build_stream_plan(tmp_path / "train.parquet", target, tmp_path / "plain", _settings())
    topk = st.build_stream_plan(tmp_path / "train.parquet", target, tmp_path / "topk",
                                _settings(extract={"store_target_topk": 8}))
    assert topk["disk"]["bytes_per_token"] == plain["disk"]["bytes_per_token"] + 48
    assert [p["bytes"] for p in topk["phases"]] == [p["bytes"] + 48 * p["tokens"] for p in plain["phases"]]
    assert topk["settings"]["extract"]["store_target_topk"] == 8
    assert "store_target_topk" not in plain["settings"]["extract"]
    with pytest.raises(ValueError, match="extract.store_target_topk 8 must be 0, or > 0 with"):
        _settings(extract={"store_target_topk": 8, "store_target_tokens": False})


def test_a_plan_whose_slices_do_not_fit_is_refused_naming_what_fits(tmp_path, target, monkeypatch):
    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    settings = _settings(stream={"reserve_gb": 0})
    plan = st.build_stream_plan(tmp_path / "train.parquet", target, tmp_path / "ok", settings)
    largest = plan["disk"]["largest_slice_bytes"]
    # room for about half a slice: slices = 3 does not fit; the message names the smallest that does, and fp8
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: largest // 2 + plan["disk"]["heldout_bytes"])
    with pytest.raises(DiskSpaceError) as err:
        st.build_stream_plan(tmp_path / "train.parquet", target, tmp_path / "refused", settings)
    text = str(err.value)
    assert "stream.slices = 3" in text and "the smallest stream.slices that fits is" in text
    assert "float8_e4m3fn" in text
    assert not (tmp_path / "refused" / "plan.json").exists()


def _curated(path, conversations):
    rows = [{"id": f"c{i}", "source": "tiny", "messages": m, "tools": None} for i, m in enumerate(conversations)]
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), path)


def _msg(role, content):
    return {"role": role, "content": content, "tool_calls": None, "reasoning_content": None, "tool_call_id": None,
            "name": None}


CONVERSATIONS = [
    [_msg("user", "hello there, how are you?"), _msg("assistant", "fine, thanks")],
    [_msg("system", "be brief"), _msg("user", "count to three"), _msg("assistant", "one two three"),
     _msg("user", "and back"), _msg("assistant", "three two one")],
    [_msg("user", "a long question " * 30), _msg("assistant", "short")],
]


def _disk_settings(**sections):
    base = {"regenerate": {"max_new_tokens": 16, "max_turns": None, "num_answers": 1},
            "tokenize": {"max_length": 512, "chat_template_kwargs": {}},
            "extract": {"storage_dtype": "bfloat16"}, "drafter": {"num_layers": 1},
            "stream": {"slices": 1, "reserve_gb": 0}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return st.DiskPlanSettings.from_config(base)


def test_the_projection_before_regeneration_bounds_what_tokenize_makes(tmp_path, target):
    """Every answer regenerated at the full answer budget, tokenized with the real template: never more tokens
    than the bound."""
    from draftsmith.chat import render_text, template_messages

    tokenizer = tiny_tokenizer()
    settings = _disk_settings()
    bound, rows = st.upper_bound_tokens([{"messages": m, "tools": None} for m in CONVERSATIONS], tokenizer, settings)
    # an answer of exactly the answer budget (16 tokens)
    longest_answer = tokenizer.decode(tokenizer("words " * 40, add_special_tokens=False)["input_ids"][:16])
    actual = 0
    for conv in CONVERSATIONS:
        regenerated = [dict(m, content=longest_answer) if m["role"] == "assistant" else m for m in conv]
        text = render_text(tokenizer, template_messages(regenerated), None, {}, add_generation_prompt=False)
        actual += min(512, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    assert rows == len(CONVERSATIONS) and actual <= bound <= 3 * actual


def test_regeneration_is_refused_when_the_disk_cannot_hold_it(tmp_path, target, monkeypatch):
    _curated(tmp_path / "train.parquet", CONVERSATIONS)
    report = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "disk.json",
                                               _disk_settings())
    assert report["fits"] and read_json(tmp_path / "disk.json") == report
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: report["features_bytes_at_most"] // 3)
    with pytest.raises(DiskSpaceError, match="refused before regeneration") as err:
        st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "no.json",
                                          _disk_settings())
    assert "the smallest stream.slices that fits is" in str(err.value)
    assert not (tmp_path / "no.json").exists()
    # the same disk with the data in slices: accepted
    ok = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "sliced.json",
                                           _disk_settings(stream={"slices": 4}))
    assert ok["fits"] and ok["on_disk_bytes_at_most"] < report["features_bytes_at_most"]


# -- issue 46 item 3: refuse only what cannot fit, and advice that stream_plan accepts

MANY = [[_msg("user", f"question number {i} " * (1 + i % 5)), _msg("assistant", f"answer {i} " * (1 + i % 3))]
        for i in range(60)]


def _free_disk(monkeypatch, free: int) -> None:
    """Every file system has ``free`` bytes free (shutil.disk_usage, what every disk check reads)."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**13, 0, free))


def test_before_regeneration_only_what_cannot_fit_is_refused(tmp_path, target, monkeypatch, caplog):
    """The upper bound (every answer at regenerate.max_new_tokens) exceeds the disk, the expected size (each answer as
    long as its curated one) fits: a warning with both numbers, no refusal (main refused: on the gpu-proof data it
    projected 13.6M tokens where the run made 7.7M). The expected size not fitting is refused, naming both and the
    key that accepts the risk; the prompts alone not fitting is refused whatever the key."""
    import logging

    caplog.set_level(logging.INFO, logger="draftsmith")
    _curated(tmp_path / "train.parquet", MANY)
    base = {"regenerate": {"max_new_tokens": 64}, "stream": {"slices": 1, "reserve_gb": 0}}
    report = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "roomy.json",
                                               _disk_settings(**base))
    upper, expected = report["need_bytes"], report["need_bytes_expected"]
    assert report["tokens_at_least"] < report["tokens_expected"] < report["tokens_at_most"] and expected < upper
    _free_disk(monkeypatch, (upper + expected) // 2)
    caplog.clear()
    ok = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "warned.json",
                                           _disk_settings(**base))
    assert ok["fits_expected"] and not ok["fits"] and read_json(tmp_path / "warned.json") == ok
    assert "at the expected size the features fit the disk, at the upper bound they do not" in caplog.text
    assert f"about {ok['tokens_expected']:,} tokens" in caplog.text
    assert f"at most {ok['tokens_at_most']:,}" in caplog.text

    _free_disk(monkeypatch, expected - 1)
    with pytest.raises(DiskSpaceError, match="refused before regeneration") as err:
        st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "no.json",
                                          _disk_settings(**base))
    assert f"about {ok['tokens_expected']:,} tokens" in str(err.value)
    assert "Set stream.accept_disk_risk: true" in str(err.value)
    risky = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "risky.json",
                                              _disk_settings(**{**base, "stream": {**base["stream"],
                                                                                   "accept_disk_risk": True}}))
    assert risky["accepted_risk"] and not risky["fits_expected"]
    _free_disk(monkeypatch, 1000)
    with pytest.raises(DiskSpaceError, match="even the prompts alone do not fit"):
        st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "never.json",
                                          _disk_settings(**{**base, "stream": {**base["stream"],
                                                                               "accept_disk_risk": True}}))
    assert not (tmp_path / "no.json").exists() and not (tmp_path / "never.json").exists()


def test_the_advised_slices_pass_stream_plan_with_max_steps(tmp_path, target, monkeypatch):
    """With train.max_steps set, the stream.slices disk_plan advises is one stream_plan accepts on the data
    regenerated anywhere between the expected and the upper size (main advised 4 on the gpu-proof data, and
    stream_plan then failed: "phase 3 has no optimizer steps"); where the disk needs more slices than the steps
    allow, it says so instead."""
    import re

    _curated(tmp_path / "train.parquet", MANY)
    train = {"epochs": 1, "max_steps": 32, "tokens_per_batch": 128, "eval_fraction": 0.1, "gpus": 1, "seed": 0,
             "grad_accum": 1}
    keys = {"regenerate": {"max_new_tokens": 64}, "stream": {"slices": 1, "reserve_gb": 0}, "train": train}
    roomy = st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "roomy.json",
                                              _disk_settings(**keys))
    assert roomy["max_slices"] == 2  # 42 / 54 steps a pass (expected / upper lengths): 3 slices leave no step
    projection = st.project_tokens([{"messages": m, "tools": None} for m in MANY], tiny_tokenizer(),
                                   _disk_settings(**keys))

    def stream_plan_accepts(slices: int) -> None:
        _free_disk(monkeypatch, 10**13)
        for name, lengths in (("expected", projection.expected), ("at_most", projection.at_most)):
            write_tokenized(tmp_path / f"{name}.parquet", lengths)
            plan = st.build_stream_plan(tmp_path / f"{name}.parquet", target, tmp_path / f"plan-{name}-{slices}",
                                        _settings(stream={"slices": slices, "reuse": 1, "heldout_samples": 5,
                                                          "reserve_gb": 0}, train=train))
            assert len(plan["phases"]) == slices

    for slices_needed in (3, 2):  # the expected features need 3 slices (more than the steps allow), then 2
        features = roomy["features_bytes_expected"]
        _free_disk(monkeypatch, -(-features // slices_needed) * 105 // 100 + 2)
        with pytest.raises(DiskSpaceError) as err:
            st.check_disk_before_regeneration(tmp_path / "train.parquet", target, tmp_path / "no.json",
                                              _disk_settings(**keys))
        text = str(err.value)
        advised = re.search(r"The smallest stream.slices that fits is (\d+) with", text)
        if slices_needed == 3:
            assert advised is None, text
            assert "The smallest stream.slices that fits is 3, but with about 54 optimizer steps a pass" in text
            assert "train.max_steps 32, at most 2 give every phase an optimizer step: raise train.max_steps" in text
        else:
            assert advised is not None and int(advised[1]) == 2, text
            stream_plan_accepts(int(advised[1]))
    # stream_plan's own refusal names the largest count these data and max_steps allow
    with pytest.raises(ValueError, match=r"has no optimizer steps.*at most 2 stream.slices give every phase"):
        st.build_stream_plan(tmp_path / "at_most.parquet", target, tmp_path / "plan-3",
                             _settings(stream={"slices": 3, "reuse": 1, "heldout_samples": 5}, train=train))
