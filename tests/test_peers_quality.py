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


def test_a_base_evaluated_before_the_next_turn_rule_is_named_in_the_summary(tmp_path):
    """A PEERS_BASE report whose later turns followed target-only answers (written before evaluate followed the
    lossless reference) pairs a peer's MT-Bench second turns only where the two answers agree: the note says so;
    a base evaluated under the current rule gets none."""
    from draftsmith.evaluate.decoders import NEXT_TURN_REFERENCE, NEXT_TURN_TARGET_ONLY

    report = tmp_path / "report.json"
    for run, noted in (({}, True), ({"next_turn": NEXT_TURN_TARGET_ONLY}, True), ({"next_turn": NEXT_TURN_REFERENCE},
                                                                                  False)):
        report.write_text(json.dumps({"run": run}))
        note = quality.base_turn_note(report)
        assert (note is not None) == noted
        if noted:
            assert str(report) in note and "pair only the turns asked the same" in note
