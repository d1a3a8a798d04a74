"""Resume: the decoded conversations each decoding process saves, and the keys that tell whether they still hold.

Each decoding process (``main``, or ``worker-<w>-of-<n>``) saves the conversations of a set it has decoded to
``partial/<set>/<writer>.json`` (atomically): ``{"key": set key, "conversations": {conversation id: record}}``. The
set key (:func:`set_key`) is a sha256 of :func:`run_key` (the drafter weights, target, tokenizer, template kwargs,
sampling and decoding settings) and the set's own settings and rows, so a rerun reuses exactly the conversations
decoded with the same inputs, whatever process saved them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from draftsmith.evaluate.decoders import NEXT_TURN_RULE
from draftsmith.evaluate.prompts import BenchmarkSet, Conversation
from draftsmith.evaluate.report import REPORT_FORMAT
from draftsmith.io import read_json, sha256_file, target_fingerprint, write_json

log = logging.getLogger("draftsmith.evaluate")


def saved_file(partial: Path, set_name: str, writer: str) -> Path:
    """Where one decoding process (``writer``: ``main`` or ``worker-<w>-of-<n>``) saves a set's conversations."""
    return partial / set_name / f"{writer}.json"


def save_conversations(path: Path, key: str, records: dict[str, dict]) -> None:
    """Save a set's decoded conversations (atomically): ``{"key": set key, "conversations": {id: record}}``."""
    write_json(path, {"key": key, "conversations": records})


def load_saved(partial: Path, set_name: str, key: str) -> dict[str, dict]:
    """Every conversation of a set that any decoding process saved with this key (a file that is not valid JSON
    or was computed with other inputs is logged and left out): ``{conversation id: record}``."""
    out: dict[str, dict] = {}
    for path in sorted((partial / set_name).glob("*.json")):
        try:
            data = read_json(path)
        except ValueError:
            log.warning("%s is not valid JSON: its conversations are decoded again", path)
            continue
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("conversations"), dict):
            log.info("%s was computed with other inputs: its conversations are decoded again", path)
            continue
        out.update(data["conversations"])
    return out


def unsaved(bset: BenchmarkSet, saved: dict[str, dict]) -> list[Conversation]:
    """The conversations of a set that no decoding process has saved."""
    return [c for c in bset.conversations if c.id not in saved]


def run_key(decoders, target_dir: str, drafter_dir: str) -> dict:
    """What every set's saved results depend on, whatever the set: the report format, the drafter weights'
    sha256 (``"drafter"``), the target's fingerprint (its ``mtp.*`` tensors included), and the tokenizer, template
    kwargs, sampling and decoding settings of ``decoders`` (:class:`draftsmith.evaluate.decoders.Decoders`; the MTP
    head's numbers of drafts among them), which answer later turns follow (``NEXT_TURN_RULE`` and
    ``evaluate.static_cache``: :func:`set_key` keeps them for sets with later turns only) and, with
    ``drafter.init_from``, the start drafter's weights' sha256."""
    return {"format": REPORT_FORMAT, "drafter": sha256_file(Path(drafter_dir) / "model.safetensors"),
            "target": target_fingerprint(target_dir),
            "tokenizer": decoders.tokenizer_fingerprint, "template_kwargs": decoders.template_kwargs,
            "sampling": dataclasses.asdict(decoders.sampling), "seed": decoders.seed,
            "block_size": decoders.block_size,
            "lookup": [decoders.lookup.max_ngram, decoders.lookup.max_drafts], "stops": decoders.stops,
            "device": decoders.device.type, "dtype": str(decoders.dtype), "rollback": decoders.rollback,
            "max_prompt_tokens": decoders.max_prompt_tokens, "mtp": decoders.mtp_tokens,
            # which answer later turns follow: the rule, and the setting that decides whether there is a reference
            # (with the device, the target and the sampling above); only multi-turn sets' keys hold it (set_key)
            "next_turn": {"rule": NEXT_TURN_RULE, "static_cache": decoders.static_cache},
            **({"start": decoders.start_sha} if decoders.start_dir else {})}


def set_key(base_key: dict, bset: BenchmarkSet) -> str:
    """The key of one set's saved results: :func:`run_key`, the set's settings and rows (sha256 hex). A set whose
    conversations are single-turn leaves out ``next_turn`` (no later turn follows any answer), so its saved results
    outlive a change of that rule."""
    if not any(len(c.user_turns) > 1 for c in bset.conversations):
        base_key = {k: v for k, v in base_key.items() if k != "next_turn"}
    return hashlib.sha256(json.dumps({**base_key, "set": [bset.name, bset.source, bset.max_prompts,
                                                          bset.max_new_tokens],
                                      "rows": [c.id for c in bset.conversations]}, sort_keys=True).encode()).hexdigest()
