"""export: the trained drafter as a z-lab DFlash / DFlash2 folder (``results/drafter/final/``).

The folder holds ``config.json`` (``model_type: qwen3``, ``architectures: ["DFlashDraftModel"]`` or
``["DFlash2DraftModel"]``, ``dflash_config: {target_layer_ids, mask_token_id, block_size}`` plus, for DFlash2,
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``; ``num_target_layers``,
``layer_types``, explicit ``is_causal``) and ``model.safetensors`` with the z-lab weight names and no embedding /
LM head. It loads unchanged in the official ``dflash`` package (tested), vLLM and SGLang.

Export refuses a drafter whose config does not state ``target_layer_ids`` and ``mask_token_id`` (guessing them at
serving time is a known silent failure, SGLang #37475), one that does not fit the target (width, layer count,
vocabulary), and non-finite weights. The written folder is read back and compared with the trained weights.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open

from draftsmith.io import read_json, save_pretrained_atomic
from draftsmith.modeling_dflash2 import model_class_for
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.target import DTYPES, EMBED_KEYS, text_config, weight_files

log = logging.getLogger("draftsmith.export")


class ExportError(ValueError):
    """The trained drafter cannot be exported as it is (the message names the file and field)."""


@dataclass(frozen=True)
class ExportDrafterOptions(SectionSettings):
    """The ``drafter`` key export reads: ``export_dtype``, the weight dtype of the export (``bfloat16``,
    ``float16`` or ``float32``).

    Raises:
        ExportError: an unknown dtype.
    """

    SECTION: ClassVar[str] = "drafter"
    export_dtype: str

    def __post_init__(self) -> None:
        if self.export_dtype not in DTYPES:
            raise ExportError(f"unknown export dtype {self.export_dtype!r} ({', '.join(DTYPES)})")


@dataclass(frozen=True)
class ExportSettings(StageSettings):
    """What rule ``export`` reads (:func:`export_drafter`)."""

    STAGE: ClassVar[str] = "export"
    drafter: ExportDrafterOptions


def _target_embedding_shape(target_dir: Path) -> tuple[int, int] | None:
    files = weight_files(target_dir)
    key = next((k for k in EMBED_KEYS if k in files), None)
    if key is None:
        return None
    with safe_open(str(files[key]), framework="pt") as fh:
        return tuple(fh.get_slice(key).get_shape())  # header only, no tensor read


def check_against_target(config: dict[str, Any], target_dir: str | os.PathLike, where: str) -> None:
    """Raise :class:`ExportError` unless the drafter config fits the target folder.

    Checks: ``dflash_config.target_layer_ids`` and ``mask_token_id`` present; ids inside ``0 .. L - 1`` and
    ``num_target_layers == L``; ``hidden_size`` equal to the target's; ``vocab_size`` equal to the target
    embedding's rows and the mask token inside it.
    """
    from transformers import AutoConfig

    dflash = config.get("dflash_config") or {}
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if dflash.get(key) is None:
            raise ExportError(f"{where}: dflash_config.{key} is not set explicitly; refusing to export a drafter "
                              f"whose serving engines would have to guess it (set drafter.{key} and retrain)")
    target_dir = Path(target_dir)
    tcfg = text_config(AutoConfig.from_pretrained(target_dir))
    L = int(tcfg.num_hidden_layers)
    ids = [int(i) for i in dflash["target_layer_ids"]]
    if any(not 0 <= i < L for i in ids):
        raise ExportError(f"{where}: dflash_config.target_layer_ids {ids} outside 0..{L - 1} of target {target_dir}")
    if int(config.get("num_target_layers", -1)) != L:
        raise ExportError(f"{where}: num_target_layers {config.get('num_target_layers')} != {L} layers of {target_dir}")
    if int(config["hidden_size"]) != int(tcfg.hidden_size):
        raise ExportError(f"{where}: hidden_size {config['hidden_size']} != target hidden_size {tcfg.hidden_size}")
    shape = _target_embedding_shape(target_dir)
    vocab = shape[0] if shape else int(tcfg.vocab_size)
    if int(config["vocab_size"]) != vocab:
        raise ExportError(f"{where}: vocab_size {config['vocab_size']} != target embedding rows {vocab}")
    if not 0 <= int(dflash["mask_token_id"]) < vocab:
        raise ExportError(f"{where}: dflash_config.mask_token_id {dflash['mask_token_id']} outside 0..{vocab - 1}")


def export_drafter(trained_dir: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                   settings: ExportSettings) -> dict[str, Any]:
    """Export ``trained_dir`` (config.json + model.safetensors) to ``out_dir`` in the z-lab format.

    Args:
        settings: ``drafter.export_dtype``, the weight dtype of the export (``bfloat16``, ``float16`` or
            ``float32``).

    Returns:
        Summary: architecture (``DFlashDraftModel`` / ``DFlash2DraftModel``), parameters, bytes, dtype, target
        layer ids, mask token id, block size, max abs difference
        between the written weights and the trained ones cast to ``dtype`` (0.0).

    Raises:
        ExportError: missing explicit ids, a mismatch with the target, non-finite weights, or a read-back
            difference (weights, or RoPE inverse frequencies / attention scaling).
    """
    trained_dir, out_dir = Path(trained_dir), Path(out_dir)
    dtype = settings.drafter.export_dtype
    cfg_path = trained_dir / "config.json"
    raw = read_json(cfg_path)
    check_against_target(raw, target_dir, str(cfg_path))
    model_class = model_class_for(raw.get("architectures"))
    try:
        model = model_class.from_pretrained(trained_dir, dtype=torch.float32)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    state = model.trainable_state_dict()
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise ExportError(f"{trained_dir / 'model.safetensors'}: non-finite values in {bad[:8]}")
    save_pretrained_atomic(model, out_dir, dtype=DTYPES[dtype])
    back = model_class.from_pretrained(out_dir)
    diff = max((back.trainable_state_dict()[k].float() - v.to(DTYPES[dtype]).float()).abs().max().item()
               for k, v in state.items())
    if diff != 0.0 or not math.isfinite(diff):
        raise ExportError(f"{out_dir}: read-back differs from the trained weights by {diff}")
    rope_in, rope_out = model.rotary_emb, type(model.rotary_emb)(back.config)  # float32, from the written config
    if not torch.equal(rope_in.inv_freq, rope_out.inv_freq) or rope_in.attention_scaling != rope_out.attention_scaling:
        raise ExportError(f"{out_dir}/config.json: read-back RoPE {back.config.rope_parameters} differs from the "
                          f"trained {model.config.rope_parameters}")
    summary = {
        "architecture": back.config.ARCHITECTURE, "parameters": sum(v.numel() for v in state.values()),
        "dtype": dtype,
        "bytes": (out_dir / "model.safetensors").stat().st_size,
        "target_layer_ids": back.target_layer_ids, "mask_token_id": back.mask_token_id,
        "block_size": back.block_size, "layers": back.config.num_hidden_layers,
        "layer_types": list(back.config.layer_types), "rope_parameters": dict(back.config.rope_parameters),
        "readback_max_abs_diff": diff,
    }
    log.info("exported %s -> %s: %s", trained_dir, out_dir, summary)
    return summary
