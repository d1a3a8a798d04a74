"""The exported drafter the evaluate stage decodes with: its folder read and checked, loaded in either
implementation, and checked against the target it will draft for."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from draftsmith.io import read_json


def load_drafter(folder: str | os.PathLike, *, device: torch.device | str, dtype: torch.dtype,
                 implementation: str = "draftsmith") -> nn.Module:
    """Load an exported DFlash or DFlash2 drafter folder (z-lab format: config.json + model.safetensors), as the
    class its ``architectures`` names.

    Args:
        implementation: ``draftsmith`` (``draftsmith.modeling.DFlashDraftModel`` /
            ``draftsmith.modeling_dflash2.DFlash2DraftModel``) or ``dflash`` (the official z-lab package, if
            installed); both have the same inference interface.

    Raises:
        FileNotFoundError: missing folder / files.
        ValueError: an unknown implementation.
    """
    folder = Path(folder)
    raw = drafter_config(folder)  # the folder's checks, before loading weights
    two = drafter_architecture(raw) == "DFlash2DraftModel"
    if implementation == "draftsmith":
        from draftsmith.modeling_dflash2 import model_class_for

        return model_class_for(raw.get("architectures")).from_pretrained(folder, dtype=dtype, device=device).eval()
    if implementation == "dflash":
        from dflash import model as official

        cls = official.DFlash2DraftModel if two else official.DFlashDraftModel
        return cls.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    raise ValueError(f"unknown drafter implementation {implementation!r} (draftsmith, dflash)")


def drafter_config(folder: str | os.PathLike) -> dict:
    """An exported drafter folder's ``config.json`` (a dict), read without loading weights.

    Raises:
        FileNotFoundError: no ``config.json`` (naming the path).
        ValueError: ``architectures`` names neither ``DFlashDraftModel`` nor ``DFlash2DraftModel``.
    """
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist: not an exported drafter folder")
    raw = read_json(cfg_path)
    names = raw.get("architectures") or ["DFlashDraftModel"]
    if not {"DFlashDraftModel", "DFlash2DraftModel"} & set(names):
        raise ValueError(f"{cfg_path}: architectures {names} is neither DFlashDraftModel nor DFlash2DraftModel")
    return raw


def drafter_architecture(raw: dict) -> str:
    """``DFlash2DraftModel`` or ``DFlashDraftModel`` (the default of configs that name none), from a drafter
    ``config.json`` dict."""
    return "DFlash2DraftModel" if "DFlash2DraftModel" in (raw.get("architectures") or []) else "DFlashDraftModel"


def check_pair(drafter: nn.Module, target: nn.Module) -> None:
    """Raise ``ValueError`` (naming the field) unless the drafter was built for this target: width,
    number of target layers, tapped layer ids within range, mask token inside the embedding."""
    from draftsmith.target import num_layers, text_config
    from draftsmith.target_layers import validate_layer_ids

    L = num_layers(target)
    tcfg = text_config(target.config)
    n_cfg = getattr(drafter.config, "num_target_layers", None)
    if n_cfg is not None and int(n_cfg) != L:
        raise ValueError(f"drafter config num_target_layers={n_cfg} but the target has {L} decoder layers: "
                         "the drafter was trained for another target")
    validate_layer_ids(list(drafter.target_layer_ids), L)
    if int(drafter.config.hidden_size) != int(tcfg.hidden_size):
        raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} != target hidden_size {tcfg.hidden_size}")
    rows = target.get_input_embeddings().weight.shape[0]
    if drafter.mask_token_id is None or not 0 <= int(drafter.mask_token_id) < rows:
        raise ValueError(f"drafter dflash_config.mask_token_id={drafter.mask_token_id} is not a row of the "
                         f"target's embedding (0..{rows - 1})")
