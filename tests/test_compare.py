"""draftsmith.evaluate.compare: two evaluation reports paired by prompt (synthetic reports; the comparison of two
real reports, DFlash against DFlash2, is in test_evaluate.py)."""

from __future__ import annotations

import json

import pytest

from draftsmith.evaluate.compare import compare_reports, load_report, main


def _row(key: str, committed: int, steps: int, seconds: float, **extra) -> dict:
    return {"prompt": f"{key}#0", "prompt_key": key, "new_tokens": committed + 1, "dflash_committed": committed,
            "dflash_steps": steps, "dflash_tokens": committed + 1, "dflash_s": seconds,
            "dflash_tau": committed / steps, **extra}


def _report(sets: dict[str, list[dict]], arch: str = "DFlashDraftModel") -> dict:
    def whole(rows):
        c, n = sum(r["dflash_committed"] for r in rows), sum(r["dflash_steps"] for r in rows)
        t, s = sum(r["dflash_tokens"] for r in rows), sum(r["dflash_s"] for r in rows)
        return {"prompts": len(rows), "dflash": {"tau": c / n, "tokens_per_s": t / s, "speedup": 1.5},
                "prompt_lookup": {"tau": 1.5, "tokens_per_s": 100.0}}

    unique = {r["prompt_key"]: r for rows in sets.values() for r in rows}
    return {"format": "draftsmith.eval/2", "run": {"drafter": "d", "drafter_architecture": arch, "block_size": 16},
            "sets": {name: {**whole(rows), "per_prompt": rows} for name, rows in sets.items()},
            "overall": whole(list(unique.values()))}


def test_prompts_are_paired_by_key_and_the_interval_brackets_the_ratio():
    base = _report({"a": [_row("p1", 20, 10, 1.0), _row("p2", 30, 10, 1.0), _row("p3", 10, 10, 1.0)],
                    "b": [_row("p4", 40, 20, 2.0)]})
    # p3 was decoded by base only (say a second turn whose first answer differed); p5 by new only
    new = _report({"a": [_row("p1", 30, 10, 1.0), _row("p2", 45, 10, 1.0), _row("p5", 99, 9, 1.0)],
                   "b": [_row("p4", 60, 20, 2.0)]}, arch="DFlash2DraftModel")
    cmp = compare_reports(base, new, names=("dflash", "dflash2"), resamples=500, seed=1)
    a = cmp["sets"]["a"]["paired"]
    assert (a["matched"], a["base_only"], a["new_only"]) == (2, 1, 1)
    assert a["tau"]["base"] == pytest.approx(50 / 20) and a["tau"]["new"] == pytest.approx(75 / 20)
    assert a["tau"]["ratio"] == pytest.approx(1.5)
    assert a["tau"]["ratio_low"] == pytest.approx(1.5) and a["tau"]["ratio_high"] == pytest.approx(1.5)  # 1.5x each
    assert a["tokens_per_s"]["ratio"] == pytest.approx(77 / 52)  # tokens = committed + 1
    # the whole-set ratio counts the unmatched prompts; the paired one does not
    assert cmp["sets"]["a"]["tau_ratio"] == pytest.approx((174 / 29) / (60 / 30))
    every = cmp["sets"]["all"]["paired"]
    assert every["matched"] == 3 and every["tau"]["ratio"] == pytest.approx(135 / 90)
    assert cmp["new_drafter"]["drafter_architecture"] == "DFlash2DraftModel"
    assert cmp["sets"]["a"]["new_faster_than_lookup"] is False


def test_the_interval_widens_when_prompts_disagree():
    base = _report({"a": [_row(f"p{i}", 20, 10, 1.0) for i in range(8)]})
    new = _report({"a": [_row(f"p{i}", 20 + 8 * (i % 2), 10, 1.0) for i in range(8)]})
    p = compare_reports(base, new, resamples=2000, seed=0)["sets"]["a"]["paired"]["tau"]
    assert p["ratio"] == pytest.approx(1.2)
    assert p["ratio_low"] < 1.2 < p["ratio_high"] and p["ratio_high"] - p["ratio_low"] > 0.1
    again = compare_reports(base, new, resamples=2000, seed=0)["sets"]["a"]["paired"]["tau"]
    assert again == p  # seeded


def test_an_older_report_gives_whole_sets_only(tmp_path, capsys):
    old = _report({"a": [_row("p1", 20, 10, 1.0)]})
    for row in old["sets"]["a"]["per_prompt"]:
        del row["dflash_steps"]
    new = _report({"a": [_row("p1", 30, 10, 1.0)], "extra": [_row("p9", 3, 3, 1.0)]})
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 0
    out = capsys.readouterr().out
    assert "| a | 2.00 | 3.00 | 1.500x |" in out
    assert "| a | a report has no per-prompt sums" in out
    assert "Sets in one report only: new: extra" in out


def test_a_file_that_is_no_report_is_named(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"format": "draftsmith.tokenize-report/1"}))
    with pytest.raises(ValueError, match="x.json: format 'draftsmith.tokenize-report/1' is not an evaluate report"):
        load_report(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{not json")
    assert main([str(tmp_path / "y.json"), str(tmp_path / "x.json")]) == 2
    assert "y.json: not JSON" in capsys.readouterr().err


def test_the_target_mtp_head_is_compared_at_its_fastest_k(tmp_path, capsys):
    """A report whose target has an MTP head (format 3: a set's ``mtp`` section): the comparison shows the new run's
    MTP τ and tokens/s at its fastest k and whether the new drafter is faster; a report without MTP rows gives '-'."""
    base = _report({"a": [_row("p1", 20, 10, 1.0)]})
    new = _report({"a": [_row("p1", 30, 10, 1.0)]})
    new["format"] = "draftsmith.eval/3"
    new["sets"]["a"]["mtp"] = {"fastest": 2, "by_tokens": {"1": {"tau": 1.6, "tokens_per_s": 20.0, "speedup": 1.3},
                                                           "2": {"tau": 2.1, "tokens_per_s": 40.0, "speedup": 1.6}}}
    cmp = compare_reports(base, new, names=("x", "y"), resamples=0)
    a = cmp["sets"]["a"]
    assert (a["new"]["mtp_k"], a["new"]["mtp_tau"], a["new"]["mtp_tokens_per_s"]) == (2, 2.1, 40.0)
    assert a["new_faster_than_mtp"] is False  # 31 tokens / 1 s < 40
    assert cmp["sets"]["all"]["new_faster_than_mtp"] is None and a["base"]["mtp_k"] is None
    (tmp_path / "x.json").write_text(json.dumps(base))
    (tmp_path / "y.json").write_text(json.dumps(new))
    assert main([str(tmp_path / "x.json"), str(tmp_path / "y.json"), "--names", "x,y", "--resamples", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 2.10 (k=2) | 40.0 | no |" in out and "| - | - | - |" in out


def test_a_report_decoded_on_a_shared_gpu_is_named_and_its_speed_flagged():
    """evaluate.workers_per_gpu > 1: τ pairs as ever; the comparison names the report whose tokens/s were measured
    by processes sharing a GPU, and report.md says so too."""
    from draftsmith.evaluate.compare import render_markdown as compare_markdown

    base = _report({"a": [_row("p1", 20, 10, 1.0), _row("p2", 30, 10, 1.0)]})
    new = _report({"a": [_row("p1", 30, 10, 1.0), _row("p2", 45, 10, 1.0)]})
    assert compare_reports(base, new, resamples=0)["shared_gpu"] == {}
    new["run"].update(decoding_workers=3, workers_per_gpu=3)
    cmp = compare_reports(base, new, names=("dflash", "shared"), resamples=0)
    assert cmp["shared_gpu"] == {"shared": 3}
    assert cmp["sets"]["a"]["paired"]["tau"]["ratio"] == pytest.approx(1.5)
    md = compare_markdown(cmp)
    assert "- **shared was decoded by 3 processes sharing each GPU: its tok/s and speedups are no speed figures" in md
    assert "dflash was decoded" not in md
