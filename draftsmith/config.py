"""Configuration checks run by the Snakefile at parse time.

The schema (``schemas/config.schema.yaml``, JSON Schema in YAML) documents every key with a
description and default. :func:`check_config` reports *all* violations at once, each as one line
naming the key path (``extract.shards``), then lets Snakemake's validator fill in the defaults.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from jsonschema import Draft202012Validator

# the name of the held-out benchmark set's source (draftsmith.evaluate.prompts.HELDOUT)
HELDOUT = "heldout"


class ConfigError(ValueError):
    """The configuration violates the schema; the message lists every bad key."""


#: the configuration schema: every key with its type, bounds, description and default
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "config.schema.yaml"


@functools.lru_cache(maxsize=8)
def _parsed_schema(path: str, mtime_ns: int, size: int) -> dict:
    with open(path, encoding="utf-8") as fh:  # libyaml's parser where PyYAML has it: 10x the pure-Python one
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict:
    """The config schema at ``path`` as a dict (a fresh copy each call), parsed once per process and file version:
    every job reads its defaults from it several times, and Snakemake parses the workflow for every dry run.

    Raises:
        FileNotFoundError: no such file.
    """
    st = os.stat(path)
    return copy.deepcopy(_parsed_schema(os.fspath(path), st.st_mtime_ns, st.st_size))


def schema_defaults(section: str) -> dict:
    """``{key: default}`` of one config section, read from :data:`SCHEMA_PATH` (defaults live only there).

    Raises:
        FileNotFoundError: the schema is not beside the package (draftsmith runs from its checkout).
        KeyError: no such section.
    """
    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(f"{SCHEMA_PATH} does not exist: draftsmith reads its config defaults from the "
                                "schema of its checkout")
    schema = load_schema(SCHEMA_PATH)
    try:
        props = schema["properties"][section]["properties"]
    except KeyError:
        raise KeyError(f"{SCHEMA_PATH}: no config section {section!r}") from None
    return {key: node.get("default") for key, node in props.items()}


#: the schema keyword of a key whose default depends on ``drafter.architecture``: ``{architecture: default}``
BY_ARCHITECTURE = "x-by-architecture"


@functools.lru_cache(maxsize=None)
def architecture_defaults() -> MappingProxyType:
    """``{(section, key): {architecture: default}}`` (read-only, read once) of the keys whose schema default is
    null, meaning "the drafter architecture's" (their ``x-by-architecture`` entry in :data:`SCHEMA_PATH`). An
    architecture the entry leaves out keeps null (``train.loss_gamma`` for dflash: 7 B / 16, resolved when training
    starts).

    Raises:
        FileNotFoundError: the schema is not beside the package.
    """
    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(f"{SCHEMA_PATH} does not exist: draftsmith reads its config defaults from the "
                                "schema of its checkout")
    schema = load_schema(SCHEMA_PATH)
    return MappingProxyType({(section, key): MappingProxyType(node[BY_ARCHITECTURE])
                             for section, snode in schema["properties"].items()
                             for key, node in (snode.get("properties") or {}).items() if BY_ARCHITECTURE in node})


def fill_architecture_defaults(config: dict, architecture: str | None = None) -> dict[str, Any]:
    """Replace, in place, each null or missing key of :func:`architecture_defaults` by its default for
    ``architecture`` (default: the config's ``drafter.architecture``, else the schema's default architecture), so
    that the trained weights' and the features' keys are concrete values: a later change of an architecture's
    default reruns what it changes (:mod:`draftsmith.stale`). Sections the config lacks are left alone.

    Returns:
        ``{"section.key": value}`` filled.
    """
    arch = (architecture or (config.get("drafter") or {}).get("architecture")
            or schema_defaults("drafter")["architecture"])
    filled = {}
    for (section, key), by_arch in architecture_defaults().items():
        values = config.get(section)
        if isinstance(values, dict) and values.get(key) is None and by_arch.get(arch) is not None:
            values[key] = filled[f"{section}.{key}"] = by_arch[arch]
    return filled


def schema_entry_defaults(section: str, key: str) -> dict:
    """``{field: default}`` of each entry of a mapping-valued key, from its ``additionalProperties`` in
    :data:`SCHEMA_PATH` (``evaluate.sets``: every set's ``max_prompts`` and ``max_new_tokens``); fields without a
    default (a set's ``source``) are left out.

    Raises:
        FileNotFoundError: the schema is not beside the package.
        KeyError: no such section or key, or the key's entries declare no fields.
    """
    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(f"{SCHEMA_PATH} does not exist: draftsmith reads its config defaults from the "
                                "schema of its checkout")
    schema = load_schema(SCHEMA_PATH)
    try:
        props = schema["properties"][section]["properties"][key]["additionalProperties"]["properties"]
    except (KeyError, TypeError):
        raise KeyError(f"{SCHEMA_PATH}: {section}.{key} is not a mapping whose entries declare fields") from None
    return {field: node["default"] for field, node in props.items() if "default" in node}


def _key_path(error, config: dict | None = None) -> str:
    """Dotted key of a schema error; a data source is also named (``data.sources.1 (bfcl).adapter``)."""
    parts = [str(p) for p in error.absolute_path]
    if len(parts) >= 3 and parts[:2] == ["data", "sources"] and parts[2].isdigit() and isinstance(config, dict):
        sources = (config.get("data") or {}).get("sources") or []
        i = int(parts[2])
        if i < len(sources) and isinstance(sources[i], dict) and sources[i].get("name"):
            parts[2] = f"{i} ({sources[i]['name']})"
    return ".".join(parts) or "<top level>"


#: other tools' names for draftsmith keys (the Hugging Face Trainer's, model configs'), so that "did you mean" finds
#: ``train.lr`` for ``train.learning_rate`` (or its misspelling) where the names share too few letters
KEY_ALIASES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm": "grad_clip",
    "max_seq_length": "max_length",
    "max_seq_len": "max_length",
    "num_hidden_layers": "num_layers",
    "block_len": "block_size",
}
_RANGE_VALIDATORS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _schema_paths(schema: dict, prefix: str = "") -> list[str]:
    """Every dotted key path the schema declares (list items and map entries without an index)."""
    paths = []
    for key, node in (schema.get("properties") or {}).items():
        paths.append(prefix + key)
        paths += _schema_paths(node, f"{prefix}{key}.")
        for nested in (node.get("items"), node.get("additionalProperties")):
            if isinstance(nested, dict):
                paths += _schema_paths(nested, f"{prefix}{key}.")
    return paths


def closest_key(word: str, known: list[str], schema: dict | None = None) -> str | None:
    """The key ``word`` was probably meant to be: the closest of ``known`` (the keys at its level, by spelling or
    through :data:`KEY_ALIASES`), else a key of that name or spelling elsewhere in ``schema`` (dotted); None if
    nothing is close (:func:`difflib.get_close_matches`, cutoff 0.6)."""
    names = {k: k for k in known} | {alias: key for alias, key in KEY_ALIASES.items() if key in known}
    close = difflib.get_close_matches(word.lower(), list(names), n=1, cutoff=0.6)
    if close:
        return names[close[0]]
    if schema is not None:
        elsewhere = {path.rsplit(".", 1)[-1]: path for path in reversed(_schema_paths(schema)) if "." in path}
        close = difflib.get_close_matches(word.lower(), list(elsewhere), n=1, cutoff=0.8)
        if close:
            return elsewhere[close[0]]
    return None


def _unknown_key_errors(err, config: dict, schema: dict) -> list[str]:
    """One line per key an object does not allow, with the key it was probably meant to be."""
    known = list((err.schema.get("properties") or {}))
    where = _key_path(err, config)
    prefix = "" if where == "<top level>" else where + "."
    level = "at the top level" if not prefix else f"in {where}"
    lines = []
    for word in sorted(k for k in err.instance if k not in known):
        guess = closest_key(str(word), known, schema)
        if guess is not None:
            # a data source's path carries its name ("data.sources.0 (chat)."): the key alone reads better there
            shown = guess if "." in guess or "(" in prefix else prefix + guess
            hint = f"did you mean {shown}?"
        else:
            hint = f"the keys {level} are: {', '.join(known)}"
        lines.append(f"{prefix}{word}: unknown key ({word!r} was unexpected); {hint}")
    return lines


def config_errors(config: dict, schema: dict) -> list[str]:
    """One message per schema violation, e.g. ``extract.shards: -1 is less than the minimum of 1``; an unknown key
    is named with the key it was probably meant to be (``train.lerning_rate: unknown key ...; did you mean
    train.lr?``); a value out of range comes with the key's description (the allowed range and why)."""
    validator = Draft202012Validator(schema)
    messages = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            messages += _unknown_key_errors(err, config, schema)
            continue
        message = f"{_key_path(err, config)}: {err.message}"
        if err.validator in _RANGE_VALIDATORS and err.schema.get("description"):
            message += f" ({' '.join(err.schema['description'].split())})"
        messages.append(message)
    return messages


def duplicate_key_errors(path: str | Path) -> list[str]:
    """One message per mapping key written twice in the YAML (or JSON) config file ``path``.

    YAML keeps only the last of two equal keys, and Snakemake's loader does the same, so an overlay with two
    ``train:`` sections silently loses the first one's keys. Each message names the file, the line, the key's
    dotted path and the line of its first occurrence, e.g. ``my.yaml:7: train appears again (first on line 2)``.
    A file that does not parse gives no message here (Snakemake has reported it already).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            root = yaml.compose(fh, Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return []
    errors: list[str] = []

    def walk(node: yaml.Node | None, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                name = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
                line = key_node.start_mark.line + 1
                if key_node.value in first:
                    errors.append(f"{path}:{line}: {name} appears again (first on line {first[key_node.value]}); "
                                  "YAML keeps only the last one, so the keys under the first are lost: merge "
                                  "the two")
                else:
                    first[key_node.value] = line
                walk(value_node, name)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}.{i}")

    walk(root, "")
    return errors


def check_config_files(paths) -> None:
    """Refuse config files that write a key twice (:func:`duplicate_key_errors`); called by the Snakefile with
    ``workflow.configfiles`` (config.yaml and every ``--configfile``) before :func:`check_config`.

    Raises:
        ConfigError: one line per repeated key, naming the file, line and key.
    """
    errors = [e for path in paths for e in duplicate_key_errors(path)]
    if errors:
        raise ConfigError("invalid configuration file(s):\n  " + "\n  ".join(errors))


def check_config(config: dict, schema_path: str, overlay: dict | None = None, *,
                 workdir: str | Path | None = None) -> list[str]:
    """Validate ``config`` against the schema file and fill in defaults (in place); with ``drafter.init_from``, make
    the start folder the drafter's shape (:func:`draftsmith.warm_start.resolve_init_from`) before the cross-key
    rules run on the result.

    Args:
        overlay: the keys the user set (:func:`draftsmith.warm_start.overlay_keys`: ``--configfile`` files and
            ``--config``, config.yaml left out), which a start folder must not contradict; None: every key is a
            default.
        workdir: the project folder (default: the current one).

    Returns:
        Lines to log (which drafter keys a start folder decided; for a drafter architecture other than the
        default, the keys its own defaults filled: :func:`fill_architecture_defaults`).

    Raises:
        ConfigError: with one line per violation, naming the key (:class:`draftsmith.warm_start.InitFromError`
            for a start folder that cannot start the run).
    """
    from snakemake.utils import validate

    schema = load_schema(schema_path)
    errors = config_errors(config, schema)
    if errors:
        raise ConfigError("invalid configuration (see schemas/config.schema.yaml):\n  "
                          + "\n  ".join(errors))
    sets = (config.get("evaluate") or {}).get("sets")
    if isinstance(sets, dict):  # `name: null` removes a set (an overlay config dropping one of config.yaml's)
        sets = config["evaluate"]["sets"] = {name: s for name, s in sets.items() if s is not None}
        only = config["evaluate"].get("only")
        if only is not None:  # evaluate.only chooses the sets
            unknown = [name for name in only if name not in sets]
            if unknown:
                raise ConfigError("invalid configuration:\n  " + "\n  ".join(
                    f"evaluate.only: {name!r} is no set of evaluate.sets" + "".join(
                        f" (did you mean {c!r}?)" for c in difflib.get_close_matches(str(name), list(sets), n=1))
                    + f"; the sets are {', '.join(sets) or 'none'}" for name in unknown))
            config["evaluate"]["sets"] = {name: s for name, s in sets.items() if name in only}
    validate(config, schema_path)  # fills in the documented defaults
    notes = []
    if (config.get("drafter") or {}).get("init_from"):
        from draftsmith.warm_start import resolve_init_from

        notes = resolve_init_from(config, overlay, workdir=workdir)
    filled = fill_architecture_defaults(config)  # after the start folder has decided drafter.architecture
    arch = (config.get("drafter") or {}).get("architecture")
    if filled and arch != schema_defaults("drafter")["architecture"]:  # say which recipe a DFlash2 run trains
        shown = ", ".join(f"{key} {str(value).lower() if isinstance(value, bool) else value}"
                          for key, value in filled.items())
        notes = [*notes, f"drafter.architecture {arch}: its defaults {shown} (schemas/config.schema.yaml, "
                         "x-by-architecture)"]
    errors = cross_key_errors(config)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return notes


def cross_key_errors(config: dict) -> list[str]:
    """Violations of rules that tie several keys together (after defaults are filled), one line each."""
    errors = []
    regen = config.get("regenerate", {})
    if regen.get("enabled") and regen.get("temperature", 0) > 0:
        if not config.get("extract", {}).get("store_target_tokens", True) or config.get("train", {}).get(
                "labels", "target") not in ("target", "target_topk"):
            errors.append("regenerate.temperature > 0 samples the training answers, so the labels must be the "
                          "target's own: set extract.store_target_tokens: true and train.labels: target (or "
                          "target_topk)")
    extract, labels = config.get("extract", {}), config.get("train", {}).get("labels", "target")
    if labels == "target_topk" and (extract.get("store_target_topk", 0) < 2
                                    or not extract.get("store_target_tokens", True)):
        errors.append(f"train.labels: target_topk trains on the target's top-k distribution, which extraction stores "
                      f"with extract.store_target_topk >= 2 (it is {extract.get('store_target_topk', 0)}) and "
                      f"extract.store_target_tokens: true (it is {extract.get('store_target_tokens', True)})")
    labels_topk = config.get("train", {}).get("labels_topk")  # read with soft labels only
    if labels == "target_topk" and labels_topk is not None and labels_topk > extract.get("store_target_topk", 0):
        errors.append(f"train.labels_topk {labels_topk} keeps the first of the target's stored top-k soft labels: "
                      f"extract.store_target_topk must be >= {labels_topk} (it is "
                      f"{extract.get('store_target_topk', 0)})")
    # the drafter's shape (draftsmith.drafter_config.build_drafter_config checks it again when training starts:
    # here it fails before regenerate and extraction have run)
    drafter = config.get("drafter", {})
    layers, types = drafter.get("num_layers", 1), drafter.get("layer_types")
    if types is not None and len(types) != layers:
        errors.append(f"drafter.layer_types has {len(types)} entries for drafter.num_layers = {layers}: give one "
                      "per layer, or null (all full_attention)")
    if types and "sliding_attention" in types and not drafter.get("sliding_window"):
        errors.append("drafter.layer_types has sliding_attention layers but drafter.sliding_window is not set")
    # the tapped layers (their range in the target: draftsmith.target_checks, once the target's config.json is read)
    ids, taps = drafter.get("target_layer_ids"), drafter.get("num_target_features")
    if ids is not None and len(set(ids)) != len(ids):
        errors.append(f"drafter.target_layer_ids {list(ids)} has duplicates: list each tapped layer once")
    if ids is not None and taps is not None and len(ids) != taps:
        errors.append(f"drafter.num_target_features is {taps} but drafter.target_layer_ids lists {len(ids)} layers "
                      f"{list(ids)}: the drafter reads one feature per listed layer; set num_target_features to "
                      f"{len(ids)} or null (it only sizes the official formula when target_layer_ids is null)")
    block, max_length = drafter.get("block_size"), config.get("tokenize", {}).get("max_length")
    if block is not None and max_length is not None and block > max_length:
        errors.append(f"drafter.block_size {block} is above tokenize.max_length {max_length}: block slots "
                      f"{max_length}..{block - 1} lie past the end of every training row and are never supervised; "
                      f"use a block size of at most {max_length} (published DFlash drafters use 8-16)")
    verify = (config.get("evaluate") or {}).get("block_size")
    if verify is not None and block is not None and verify > block:
        errors.append(f"evaluate.block_size {verify} is above drafter.block_size {block}: the drafter was never "
                      f"trained on block slots {block}..{verify - 1}, so it would draft noise there; use at most "
                      f"{block}, or null (the drafter's own)")
    return errors


REMOVED_STOP_TOKENS = (
    "evaluate.stop_tokens is no longer read: regenerate, tokenize and evaluate share one stop policy "
    "(draftsmith.chat.stop_token_ids): the eos_token_id of the target's tokenizer, config.json and "
    "generation_config.json, plus the end-of-turn token its chat template writes. To stop at another token, "
    "add its id to eos_token_id in the target's generation_config.json (where transformers and vLLM read it "
    "too) and remove evaluate.stop_tokens")


def check_eval_sets(evaluate_cfg: dict, sources: list[dict]) -> None:
    """Parse-time check of config ``evaluate`` against ``data.sources``, before anything runs.

    A set's ``source`` must be ``heldout`` (which needs a ``split: both`` source) or the name of a configured
    source whose rows reach the eval split (``split: eval`` or ``both``): a typo would otherwise surface only
    when evaluate starts, after the whole DAG. (Whether a ``both`` source's eval share is non-empty is known
    only after curate; ``draftsmith.evaluate.load_sets`` checks that.)

    Args:
        evaluate_cfg: config ``evaluate`` (``sets``, ``stop_tokens``).
        sources: config ``data.sources``.

    Raises:
        ConfigError: one line per bad set, naming the set, its source and the sources it could use; or no
            set at all; or ``evaluate.stop_tokens`` set (see :data:`REMOVED_STOP_TOKENS`).
    """
    if evaluate_cfg.get("stop_tokens"):
        raise ConfigError(REMOVED_STOP_TOKENS)
    sets = evaluate_cfg.get("sets") or {}
    if not sets:
        raise ConfigError("evaluate.sets is empty: nothing to evaluate (e.g. heldout: {source: heldout})")
    split = {s["name"]: s.get("split", "both") for s in sources}
    usable = [HELDOUT] * any(v == "both" for v in split.values()) + [n for n, v in split.items() if v != "train"]
    errors = []
    for name, cfg in sets.items():
        source = (cfg or {}).get("source")
        where = f"evaluate.sets.{name}.source: {source!r}"
        if source == HELDOUT and HELDOUT not in usable:
            errors.append(f"{where} is the held-out split of the split: both sources, but no data source has "
                          "split: both")
        elif source != HELDOUT and source not in split:
            close = difflib.get_close_matches(str(source), usable, n=1)
            errors.append(f"{where} is no data source" + (f" (did you mean {close[0]!r}?)" if close else "")
                          + f"; sets can use {usable}; to leave the set out, name the sets to run in "
                          f"evaluate.only or set evaluate.sets.{name}: null")
        elif source != HELDOUT and split[source] == "train":
            errors.append(f"{where} has split: train, so the eval split holds none of its rows (set its split to "
                          "eval or both)")
    if errors:
        raise ConfigError("evaluate.sets name sources the eval split cannot have:\n  " + "\n  ".join(errors))
