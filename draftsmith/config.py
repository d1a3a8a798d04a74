"""Configuration checks run by the Snakefile at parse time.

The schema (``schemas/config.schema.yaml``, JSON Schema in YAML) documents every key with a
description and default. :func:`check_config` reports *all* violations at once, each as one line
naming the key path (``extract.shards``), then lets Snakemake's validator fill in the defaults.
"""

from __future__ import annotations

import yaml
from jsonschema import Draft202012Validator


class ConfigError(ValueError):
    """The configuration violates the schema; the message lists every bad key."""


def _key_path(error) -> str:
    path = ".".join(str(p) for p in error.absolute_path)
    return path or "<top level>"


def config_errors(config: dict, schema: dict) -> list[str]:
    """One message per schema violation, e.g. ``extract.shards: -1 is less than the minimum of 1``."""
    validator = Draft202012Validator(schema)
    messages = []
    for err in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        messages.append(f"{_key_path(err)}: {err.message}")
    return messages


def check_config(config: dict, schema_path: str) -> None:
    """Validate ``config`` against the schema file and fill in defaults (in place).

    Raises:
        ConfigError: with one line per violation, naming the key.
    """
    from snakemake.utils import validate

    with open(schema_path, encoding="utf-8") as fh:
        schema = yaml.safe_load(fh)
    errors = config_errors(config, schema)
    if errors:
        raise ConfigError("invalid configuration (see schemas/config.schema.yaml):\n  "
                          + "\n  ".join(errors))
    validate(config, schema_path)  # fills in the documented defaults
    errors = cross_key_errors(config)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def cross_key_errors(config: dict) -> list[str]:
    """Violations of rules that tie several keys together (after defaults are filled), one line each."""
    errors = []
    regen = config.get("regenerate", {})
    if regen.get("enabled") and regen.get("temperature", 0) > 0:
        if not config.get("extract", {}).get("store_target_tokens", True) or config.get("train", {}).get(
                "labels", "target") != "target":
            errors.append("regenerate.temperature > 0 samples the training answers, so the labels must be the "
                          "target's own greedy next tokens: set extract.store_target_tokens: true and "
                          "train.labels: target")
    return errors
