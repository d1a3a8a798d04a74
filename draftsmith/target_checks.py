"""Settings checked against the target when the workflow is planned, before any GPU hour.

The target's ``config.json`` and tokenizer files are read as plain JSON (no torch, no transformers: the Snakefile
imports this module at parse time) and every setting that can be checked against them is:

* ``drafter.target_layer_ids`` (or the official formula over ``drafter.num_target_features`` taps) inside the
  target's decoder layers ``0 .. L - 1`` (:mod:`draftsmith.target_layers`);
* ``drafter.mask_token_id`` inside the target's vocabulary ``0 .. V - 1``;
* ``drafter.block_size`` and ``tokenize.max_length`` within the target's positions (``max_position_embeddings``);
* ``extract.store_target_topk`` (DFlash2's soft labels) only for a target whose logits are lm_head's output
  (:func:`logit_transform`);
* the folder holds a tokenizer the stages can load: a vocabulary file, ``tokenizer_config.json`` and a chat
  template;
* a start drafter (``drafter.init_from``) made for this target: its taps inside the decoder layers, its width and
  vocabulary the target's, its mask token none the target emits unless confirmed
  (:func:`draftsmith.warm_start.start_target_errors`).

Hybrid and multimodal checkpoints (Qwen3.5 / 3.6 ``Qwen3_5ForConditionalGeneration``) nest the decoder's keys under
``text_config``; they are read from there, as :func:`draftsmith.target.text_config` does.

The checks that need no target (``drafter.block_size`` above the published range, ``num_target_features`` against
``target_layer_ids``) are :func:`draftsmith.config.cross_key_errors` and :func:`block_size_warnings`.

An embedded target (``embedded:<name>``) is materialised by rule materialize_target, so on a first run its folder
does not exist yet at planning: the first rules that read it (disk_plan with regeneration, else tokenize) call
:func:`check_target_settings` before anything else, and before any GPU rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import ConfigError
from draftsmith.target_layers import default_target_layer_ids, num_tapped_layers, tapped_layer_ids
from draftsmith.warm_start import start_target_errors

#: block sizes of the published DFlash drafters (z-lab's Qwen3 / LLaMA / gpt-oss drafters, arXiv 2602.06036)
PUBLISHED_BLOCK_SIZES = (8, 16)

#: files one of which holds the tokenizer's vocabulary: fast (tokenizers), sentencepiece, byte-level BPE (slow)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
#: where transformers finds a chat template besides ``tokenizer_config.json``'s ``chat_template`` key
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")

# config.json names of the same quantity across architectures (transformers' attribute_map does this for AutoConfig)
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")


#: config keys by which a target transforms ``lm_head``'s output before its logits, each with its identity value
#: (Gemma 2 / 3's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
#: ``lm_head_multiplier``): lm_head's top-k is then not the target's distribution
LOGIT_TRANSFORM_KEYS = (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0),
                        ("lm_head_multiplier", 1.0))


def logit_transform(config) -> str:
    """What a target's text config (a ``config.json`` mapping or a transformers config object) does to
    ``lm_head``'s output before its logits: ``""`` for none, else the keys that say it (``"logit_scale = 0.0625"``;
    :data:`LOGIT_TRANSFORM_KEYS`). A transform it does not know is caught on extraction's first batch
    (``draftsmith.extract.FeatureExtractor``)."""
    get = config.get if isinstance(config, Mapping) else (lambda key, default=None: getattr(config, key, default))
    found = []
    for key, identity in LOGIT_TRANSFORM_KEYS:
        value = get(key, None)
        if value is not None and value != identity and not (key == "final_logit_softcapping" and not value):
            found.append(f"{key} = {value}")
    return ", ".join(found)


class TargetSettingsError(ConfigError):
    """A setting contradicts the target (its config.json or tokenizer files); the message lists every one."""


@dataclass(frozen=True)
class TargetShape:
    """What the checks read from a target's ``config.json`` (None where the file does not say).

    Attributes:
        path: the ``config.json`` read.
        num_hidden_layers: L, decoder layers.
        vocab_size: V, rows of the embedding (token ids ``0 .. V - 1``).
        max_position_embeddings: positions the target was built for.
        hidden_size: H, the decoder's width.
        logit_transform: what the target does to lm_head's output before its logits (:func:`logit_transform`;
            ``""``: nothing, so lm_head's top-k is its distribution).
    """

    path: Path
    num_hidden_layers: int | None
    vocab_size: int | None
    max_position_embeddings: int | None
    hidden_size: int | None = None
    logit_transform: str = ""


def _first(config: Mapping, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def read_target_shape(folder: str | Path) -> TargetShape:
    """The decoder's layer count, vocabulary and positions from ``<folder>/config.json`` (``text_config`` first).

    Raises:
        TargetSettingsError: no ``config.json``, or it is not a JSON object (the message names the file).
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise TargetSettingsError(f"target.model: {folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TargetSettingsError(f"target.model: {path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise TargetSettingsError(f"target.model: {path} holds a {type(config).__name__}, not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**config, **text}  # the decoder's own keys win over the wrapper's
    return TargetShape(path, _first(merged, _LAYER_KEYS), _first(merged, _VOCAB_KEYS),
                       _first(merged, _POSITION_KEYS), _first(merged, _HIDDEN_KEYS), logit_transform(merged))


def missing_tokenizer_files(folder: str | Path) -> list[str]:
    """What a target folder lacks for the stages to load its tokenizer and render its chat template (``[]`` when
    nothing): a vocabulary (one of :data:`VOCAB_FILES`; ``vocab.json`` needs ``merges.txt``),
    ``tokenizer_config.json`` (special tokens) and a chat template (``chat_template`` in ``tokenizer_config.json``,
    or one of :data:`CHAT_TEMPLATE_FILES`). Each entry names the file(s) and what they are for.
    """
    folder = Path(folder)
    missing = []
    has = {name: (folder / name).is_file() for name in (*VOCAB_FILES, "merges.txt", "tokenizer_config.json",
                                                        *CHAT_TEMPLATE_FILES)}
    if not (has["tokenizer.json"] or has["tokenizer.model"] or (has["vocab.json"] and has["merges.txt"])):
        missing.append("a vocabulary: tokenizer.json, tokenizer.model or vocab.json + merges.txt")
    template = any(has[name] for name in CHAT_TEMPLATE_FILES)
    if not has["tokenizer_config.json"]:
        missing.append("tokenizer_config.json (the special tokens)")
    elif not template:
        try:
            tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            missing.append(f"a readable tokenizer_config.json ({exc})")
            tok_config = {}
        template = isinstance(tok_config, dict) and bool(tok_config.get("chat_template"))
    if not template:
        missing.append("a chat template: chat_template.jinja, chat_template.json, or chat_template in "
                       "tokenizer_config.json")
    return missing


def _layer_errors(drafter: Mapping, L: int, where: Path) -> list[str]:
    """``drafter.target_layer_ids`` (or the formula's taps) against the target's L decoder layers."""
    ids, n = drafter.get("target_layer_ids"), drafter.get("num_target_features")
    if ids is not None:
        bad = [int(i) for i in ids if not 0 <= int(i) < L]
        if not bad:
            return []  # inside the layers (duplicates: draftsmith.config.cross_key_errors)
        try:
            default = (f"null with num_target_features: {len(ids)} (the official formula's "
                       f"{default_target_layer_ids(L, len(ids))})")
        except ValueError:
            default = "fewer taps"
        return [f"drafter.target_layer_ids: {bad} outside 0..{L - 1}, the {L} decoder layers of {where} (id i = "
                f"output of decoder layer i); use ids in 0..{L - 1}, or {default}"]
    taps = num_tapped_layers(None, n, drafter.get("num_layers"))
    try:
        tapped_layer_ids(None, n, drafter.get("num_layers"), L)
    except ValueError:
        key = "drafter.num_target_features" if n is not None else "drafter.num_layers (the taps by default)"
        return [f"{key}: the official formula cannot spread {taps} taps over the {L} decoder layers of {where} "
                f"(ids 1..{L - 3}, no duplicates); use at most {max(1, L - 3)} taps, or list drafter.target_layer_ids"]
    return []


def target_setting_errors(config: Mapping, folder: str | Path) -> list[str]:
    """Every setting of ``config`` (defaults filled) that contradicts the target folder, one line each, naming the
    key, the allowed range and what to do.

    Raises:
        TargetSettingsError: the folder has no readable ``config.json`` (see :func:`read_target_shape`).
    """
    folder = Path(folder)
    shape = read_target_shape(folder)
    drafter = config.get("drafter") or {}
    errors = []
    missing = missing_tokenizer_files(folder)
    if missing:
        errors.append(f"target.model: {folder} has no tokenizer the stages can load; it lacks "
                      + "; ".join(missing) + ". Copy the tokenizer files of the checkpoint into the folder "
                      "(save_pretrained of its tokenizer writes them)")
    L = shape.num_hidden_layers
    if L is not None:
        errors += _layer_errors(drafter, L, shape.path)
    V, mask = shape.vocab_size, drafter.get("mask_token_id")
    if V is not None and mask is not None and not 0 <= int(mask) < V:
        errors.append(f"drafter.mask_token_id: {mask} is outside the vocabulary 0..{V - 1} of {shape.path} "
                      "(vocab_size); use an id inside it, or null (the tokenizer's mask token, else the first "
                      "unused embedding row)")
    errors += start_target_errors(config, folder, num_layers=L, hidden_size=shape.hidden_size, vocab_size=V)
    top_k = (config.get("extract") or {}).get("store_target_topk") or 0
    transform = shape.logit_transform if top_k else ""
    if transform:
        errors.append(f"extract.store_target_topk: {top_k} (the default for drafter.architecture "
                      f"{drafter.get('architecture', 'dflash')} stores the soft labels of train.labels: target_topk) "
                      f"but {shape.path} transforms lm_head's output before its logits ({transform}), so lm_head's "
                      "top-k would not be its distribution; set extract.store_target_topk: 0 and train.labels: "
                      "target")
    P, block = shape.max_position_embeddings, drafter.get("block_size")
    if P is not None and block is not None and int(block) > P:
        errors.append(f"drafter.block_size: {block} is above the {P} positions of {shape.path} "
                      f"(max_position_embeddings); published DFlash drafters use {PUBLISHED_BLOCK_SIZES[0]}-"
                      f"{PUBLISHED_BLOCK_SIZES[1]}")
    return errors


def target_setting_warnings(config: Mapping, folder: str | Path) -> list[str]:
    """Settings that work with the target but probably not as meant, one line each (``[]`` when none):
    ``tokenize.max_length`` beyond the target's ``max_position_embeddings`` (rows past the positions it was
    trained on, unless its RoPE scaling extends them)."""
    shape = read_target_shape(folder)
    P = shape.max_position_embeddings
    max_length = (config.get("tokenize") or {}).get("max_length")
    if P is not None and max_length is not None and int(max_length) > P:
        return [f"tokenize.max_length: {max_length} is above the {P} positions of {shape.path} "
                "(max_position_embeddings): rows past them see positions the target was not trained on, unless "
                f"its RoPE scaling extends them; consider tokenize.max_length <= {P}"]
    return []


def block_size_warnings(config: Mapping) -> list[str]:
    """A loud warning for a ``drafter.block_size`` above the published DFlash drafters' 8-16 (the schema refuses
    more than 64): slots far from the anchor are rarely accepted, so τ hardly grows, while every verify forward
    of the target processes B tokens and training holds anchors x B block tokens per row."""
    block = (config.get("drafter") or {}).get("block_size")
    lo, hi = PUBLISHED_BLOCK_SIZES
    if block is not None and int(block) > hi:
        return [f"drafter.block_size: {block} is above the {lo}-{hi} of published DFlash drafters: the acceptance of "
                f"a slot falls with its distance from the anchor, so τ hardly grows past B = {hi}, while every "
                f"verify forward of the target processes B tokens and training holds anchors x B block tokens per "
                f"row (memory grows with B). Unless you are studying block sizes, use {hi}"]
    return []


def check_target_settings(config: Mapping, folder: str | Path) -> list[str]:
    """Refuse settings that contradict the target folder; return the warnings (target and block size) to log.

    Args:
        config: the workflow's config with the schema's defaults filled in (:func:`draftsmith.config.check_config`).
        folder: the target's Hugging Face folder (it must exist).

    Raises:
        TargetSettingsError: one line per contradiction (:func:`target_setting_errors`), naming the key, the target
            file and the allowed range.
    """
    errors = target_setting_errors(config, folder)
    if errors:
        raise TargetSettingsError(f"settings contradict the target {folder}:\n  " + "\n  ".join(errors))
    return target_setting_warnings(config, folder) + block_size_warnings(config)


def check_target_in_job(config: Mapping, folder: str | Path, log) -> None:
    """:func:`check_target_settings` from a rule's script, for a target materialised after the workflow was planned
    (an embedded target's first run): the warnings and the refusal go to the job's log (``log``, a
    :class:`logging.Logger`), the refusal without a traceback.

    Raises:
        SystemExit: (code 1) a setting contradicts the target.
    """
    try:
        warnings = check_target_settings(config, folder)
    except TargetSettingsError as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None
    for warning in warnings:
        log.warning("!!! %s", warning)
