"""bench/peers/quality.py's base check (``PEERS_BASE``): a peer is paired with an earlier draftsmith run only when this
run's features are that run's, judged by their feature indexes as training's run fingerprint judges them (counts,
taps, fingerprints, the sha256 of every chunk file; docs/peers/README.md, "Against an earlier draftsmith run"). The
base index is the committed one of docs/peers/quality-2026-12-04."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "peers"))

import quality  # noqa: E402

BASE_INDEX = REPO / "docs" / "peers" / "quality-2026-12-04" / "draftsmith" / "features-index.json"


def _copy(tmp_path: Path, edit=None) -> Path:
    index = json.loads(BASE_INDEX.read_text())
    if edit:
        edit(index)
    path = tmp_path / "index.json"
    path.write_text(json.dumps(index))
    return path


def test_the_same_features_pass_whatever_their_paths(tmp_path):
    def elsewhere(index):  # another machine's folders: chunk paths are no part of the data
        for chunk in index["chunks"]:
            chunk["path"] = "/elsewhere/" + str(chunk.get("path", ""))
    quality.check_same_features(BASE_INDEX, _copy(tmp_path, elsewhere))


@pytest.mark.parametrize("key, edit", [
    ("num_tokens", lambda ix: ix.update(num_tokens=ix["num_tokens"] + 1)),
    ("layer_ids", lambda ix: ix.update(layer_ids=list(reversed(ix["layer_ids"])))),
    ("target_fingerprint", lambda ix: ix.update(target_fingerprint="0" * 64)),
    ("content_sha256", lambda ix: ix["chunks"][0].update(sha256="0" * 64)),
])
def test_other_features_are_refused_naming_the_key(tmp_path, key, edit):
    index = _copy(tmp_path, edit)
    with pytest.raises(SystemExit, match=f"'{key}' differs from the base run's"):
        quality.check_same_features(BASE_INDEX, index)


def test_a_chunk_without_its_sha256_is_refused(tmp_path):
    index = _copy(tmp_path, lambda ix: ix["chunks"][0].pop("sha256"))
    with pytest.raises(SystemExit, match="has no sha256"):
        quality.check_same_features(BASE_INDEX, index)


def test_a_missing_index_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no feature index"):
        quality.check_same_features(BASE_INDEX, tmp_path / "index.json")


def test_reports_whose_later_turns_followed_different_answers_are_named_in_the_summary(tmp_path):
    """A PEERS_BASE report written before evaluate followed the lossless reference (no ``run.next_turn``: its later
    turns followed target-only answers) and a peer's evaluated on the GPU now pair their MT-Bench second turns only
    where the two first answers agree: the note says so. Two reports under the same rule (both new, or both from the
    CPU's dynamic path, where there is no reference) get none."""
    from draftsmith.evaluate.decoders import NEXT_TURN_REFERENCE, NEXT_TURN_TARGET_ONLY

    def report(name, run):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"run": run}))
        return path

    old, ref = report("old", {}), report("ref", {"next_turn": NEXT_TURN_REFERENCE})
    cpu = report("cpu", {"next_turn": NEXT_TURN_TARGET_ONLY})
    note = quality.turn_rule_note(old, ref)
    assert note is not None and str(old) in note and "pair only the turns asked the same" in note
    assert quality.turn_rule_note(ref, ref) is None and quality.turn_rule_note(old, cpu) is None
    assert quality.turn_rule_note(cpu, ref) is not None
