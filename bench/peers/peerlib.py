"""Shared helpers of the peer benchmark (bench/peers/): a run's configuration as the workflow sees it, draftsmith's
train / held-out split of the merged features, and the peers' offline layouts as constants (what their readers
expect, from their code: docs/peers/README.md, "How each peer reads its data").

Nothing here imports a peer package: the layouts are checked against files, never against the peers' code, so the
product's CI (which has neither peer) runs the checks.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------------------------------------
# the peers' offline layouts (docs/peers/README.md cites the wheel file and line of each)
# --------------------------------------------------------------------------------------------------------------

#: SpecForge 0.2.0: one ``torch.save`` dict per sample, any file named ``*.ckpt`` under ``data.hidden_states_path``
#: (found recursively, sorted by path); ``hidden_states`` holds the taps concatenated in ``target_layer_ids`` order
#: (z-lab ids: tap i = output of decoder layer i).
SPECFORGE_SUFFIX = ".ckpt"
SPECFORGE_KEYS = {"input_ids": "int64", "loss_mask": "int64", "hidden_states": "bfloat16"}

#: speculators 0.9.0 (file backend): ``save_to_disk`` dataset columns and one ``hidden_states/hs_{i}.safetensors``
#: per dataset row i; ``hidden_states`` ``[T, n_taps + 1, H]``: the taps (speculators ids = z-lab ids + 1), then
#: the last decoder layer's output before the final norm.
SPECULATORS_COLUMNS = ("input_ids", "loss_mask", "seq_len")
SPECULATORS_HS_DIR = "hidden_states"
SPECULATORS_HS_KEYS = {"hidden_states": "bfloat16", "token_ids": "int64"}


def speculators_hs_name(i: int) -> str:
    """The file speculators' ``FileTransfer`` reads for dataset row ``i`` (its global index)."""
    return f"hs_{i}.safetensors"


def speculators_layer_ids(zlab_ids: Sequence[int]) -> list[int]:
    """speculators' ``--target-layer-ids`` for taps given in the z-lab convention (id i = output of decoder layer
    i = HF ``hidden_states[i + 1]``): speculators id j names HF ``hidden_states[j]``, so j = i + 1. The last layer
    (i = L - 1) becomes L, which speculators accepts (its "final hidden state")."""
    return [int(i) + 1 for i in zlab_ids]


def zlab_layer_ids(speculators_ids: Sequence[int]) -> list[int]:
    """The inverse of :func:`speculators_layer_ids` (every tap kept, none dropped)."""
    return [int(j) - 1 for j in speculators_ids]


def has_supervised_pair(loss_mask: Sequence[int], max_length: int | None = None) -> bool:
    """Whether the first ``max_length`` tokens hold two consecutive supervised tokens (SpecForge's DFlash
    normaliser raises ValueError on a sample without one, after cutting it to ``data.max_length``)."""
    values = list(loss_mask[:max_length] if max_length else loss_mask)
    return any(a and b for a, b in zip(values, values[1:]))


def speculators_train_ratio(num_train: int, num_rows: int) -> float:
    """``--train-data-ratio`` whose split puts exactly the first ``num_train`` of ``num_rows`` dataset rows in
    training: speculators takes rows ``[0, int(num_rows * ratio))`` for training and the rest for validation, and
    wants the ratio strictly inside (0, 1)."""
    if not 0 < num_train < num_rows:
        raise ValueError(f"speculators needs training and validation rows: {num_train} of {num_rows} for training")
    ratio = (num_train + 0.5) / num_rows
    if int(num_rows * ratio) != num_train:
        raise AssertionError(f"ratio {ratio} splits {num_rows} rows at {int(num_rows * ratio)}, not {num_train}")
    return ratio


# --------------------------------------------------------------------------------------------------------------
# a run's configuration
# --------------------------------------------------------------------------------------------------------------

def _merge(base: dict, over: Mapping) -> dict:
    """``over`` merged into ``base`` recursively (mappings key by key, anything else replaced), as Snakemake merges
    ``--configfile`` files over ``configfile:``."""
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def load_config(files: Sequence[str | os.PathLike] = (), *, validate: bool = True) -> dict:
    """The configuration a workflow run with ``--configfile FILES`` sees: config.yaml, each file merged over it in
    order, validated against the schema and filled with its defaults (draftsmith.config.check_config).

    Raises:
        FileNotFoundError: a file that does not exist.
        draftsmith.config.ConfigError: an invalid key or value (named).
    """
    config = yaml.safe_load((REPO / "config.yaml").read_text(encoding="utf-8")) or {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        _merge(config, yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    if validate:
        from draftsmith.config import check_config

        check_config(config, str(REPO / "schemas" / "config.schema.yaml"))
    return config


def draftsmith_split(index, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train rows, held-out rows)``, each in row order: the tokenized train rows draftsmith's trainer trains on and
    holds out for its held-out metrics (``train.eval_fraction``, ``train.seed``), exactly as
    :func:`draftsmith.train.plan.plan_data` splits an offline index."""
    from draftsmith.batch_plan import split_samples

    rows = [s.row for s in index.samples]
    train, heldout = split_samples(rows, eval_fraction, seed)
    return sorted(rows[i] for i in train), sorted(rows[i] for i in heldout)


def disk_room(folder: str | os.PathLike, needed: int, what: str, headroom: float = 1.05) -> None:
    """Refuse to write ``needed`` bytes (times ``headroom``) into ``folder`` when its disk has less free space.

    Raises:
        OSError: naming the folder, the bytes needed and the bytes free.
    """
    from draftsmith.disk import free_disk_bytes

    probe = Path(folder)
    while not probe.exists():
        probe = probe.parent
    free = free_disk_bytes(probe)
    if needed * headroom > free:
        raise OSError(f"{what}: {needed / 1e9:.2f} GB to write into {folder} (x{headroom} headroom) but its disk "
                      f"has {free / 1e9:.2f} GB free: free space (delete another peer's files) or write elsewhere")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def json_ready(value: Any) -> Any:
    """``value`` with tuples as lists and numpy / torch scalars as Python numbers (for json.dumps)."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
