"""Configuration checks run by the Snakefile at parse time.

The schema (``schemas/config.schema.yaml``, JSON Schema in YAML) documents every key with a
description and default. :func:`check_config` reports *all* violations at once, each as one line
naming the key path (``extract.shards``), then lets Snakemake's validator fill in the defaults.
"""

from __future__ import annotations

import yaml
from jsonschema import Draft202012Validator


# the name of the held-out benchmark set's source (draftsmith.evaluate.prompts.HELDOUT)
HELDOUT = "heldout"


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


REMOVED_STOP_TOKENS = (
    "evaluate.stop_tokens is no longer read: regenerate, tokenize and evaluate share one stop policy "
    "(draftsmith.tokenize.stop_token_ids): the eos_token_id of the target's tokenizer, config.json and "
    "generation_config.json, plus the end-of-turn token its chat template writes. To stop at another token, "
    "add its id to eos_token_id in the target's generation_config.json (where transformers and vLLM read it "
    "too) and remove evaluate.stop_tokens")

