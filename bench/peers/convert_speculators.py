"""A speculators 0.9.0 DFlash / DFlash2 checkpoint -> a z-lab DFlash folder (the format draftsmith exports and the
official ``dflash`` package, vLLM and SGLang load), for the peer benchmark only.

speculators saves, per checkpoint (``SAVE_PATH/<epoch>/``), ``config.json`` (a ``DFlashSpeculatorConfig`` /
``DFlash2SpeculatorConfig``: the draft's Qwen3 ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` in its own
convention, ``block_size``, ``mask_token_id``, ``sliding_window_non_causal``, ``sample_from_anchor``) and
``model.safetensors`` holding the z-lab weight names (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.*``; DFlash2 adds
``layers.{i}.{attention,mlp}_conv.*`` and ``candidate_selector.*``) without the verifier's embedding, LM head and
final norm. Details and wheel lines: docs/peers/README.md.

The conversion keeps **every** tap and shifts its id into the z-lab convention: speculators id j names HF
``hidden_states[j]`` (the input of decoder layer j), z-lab id i the output of decoder layer i = ``hidden_states[i +
1]``, so i = j - 1; the last layer (j = L) becomes L - 1 and stays. (speculators' own z-lab -> speculators converter,
``convert/dflash/converter.py``, drops a tap on the last layer instead, and its fused-qkv remap slices ``fc`` down to
fewer taps; neither is done here: ``fc`` must have exactly one H-wide slice per tap, or the conversion stops.)

The z-lab config is built by draftsmith's own :func:`draftsmith.drafter_config.build_drafter_config` from the target's
config and the checkpoint's sizes, then written by draftsmith's export (:func:`draftsmith.export.export_drafter`:
checks against the target, read-back of every weight). The conversion stops (naming the field) where the z-lab format
cannot say what speculators trained: a reduced draft vocabulary (``t2d`` / ``d2t``), ``sample_from_anchor``, a tap
on the embedding output (j = 0), a RoPE or another Qwen3 field that differs from what the target gives the drafter.
Causality: speculators' full-attention layers see their whole block and its sliding layers are causal inside the
block unless ``sliding_window_non_causal``; z-lab's ``is_causal`` is left per layer type, or set false (every layer
bidirectional) for ``sliding_window_non_causal``. Its sliding window counts from the anchor (context positions >=
anchor - W for the whole block) where z-lab's counts per slot (>= anchor + k - (W - 1)): a difference inside
speculators' training, reported, not converted.

    python bench/peers/convert_speculators.py --checkpoint /tmp/peers/speculators-out/2 \
        --target resources/targets/smollm2-135m-instruct --out /tmp/peers/speculators-zlab

Prints (and writes to ``OUT/conversion.json``) what was converted and the checks' results; with the official
``dflash`` package importable, also that it loads the folder and drafts the same logits as draftsmith's model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peerlib import json_ready, zlab_layer_ids

log = logging.getLogger("peers.convert")

#: tensors speculators keeps outside the draft body (loaded from the verifier, never part of a z-lab folder)
VERIFIER_OWNED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: draft-vocabulary maps: a z-lab drafter drafts over the target's whole vocabulary
VOCAB_MAPS = ("t2d", "d2t")
#: transformer_layer_config fields that must equal the z-lab config built from the target
MATCHED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "vocab_size")


class ConversionError(ValueError):
    """The checkpoint cannot be written in the z-lab format as it is (the file and field named)."""


def read_checkpoint(folder: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json as a dict, {tensor name: tensor})`` of a speculators checkpoint folder.

    Raises:
        FileNotFoundError: no config.json or model.safetensors (named).
    """
    folder = Path(folder)
    cfg_path, weights_path = folder / "config.json", folder / "model.safetensors"
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: not a speculators checkpoint folder (SAVE_PATH/<epoch>)")
    config = json.loads(cfg_path.read_text(encoding="utf-8"))
    with safe_open(str(weights_path), framework="pt") as fh:
        weights = {k: fh.get_tensor(k) for k in fh.keys()}
    return config, weights


def zlab_config(spec: dict, target_config, where: str):
    """The draftsmith (z-lab) drafter config of a speculators checkpoint config ``spec`` for ``target_config``.

    Raises:
        ConversionError: see the module docstring (field named, with ``where``).
    """
    from draftsmith.drafter_config import build_drafter_config, drafter_rope_parameters
    from draftsmith.target import text_config

    kind = spec.get("speculators_model_type")
    if kind not in ("dflash", "dflash2"):
        raise ConversionError(f"{where}: speculators_model_type {kind!r} is neither 'dflash' nor 'dflash2'")
    if spec.get("sample_from_anchor"):
        raise ConversionError(f"{where}: sample_from_anchor is true (the anchor slot drafts a token): the z-lab "
                              "format has the anchor as the bonus token only")
    tl = spec.get("transformer_layer_config") or {}
    tcfg = text_config(target_config)
    L = int(tcfg.num_hidden_layers)
    aux = [int(j) for j in spec.get("aux_hidden_state_layer_ids") or []]
    if not aux:
        raise ConversionError(f"{where}: aux_hidden_state_layer_ids is empty")
    bad = [j for j in aux if not 1 <= j <= L]
    if bad:
        raise ConversionError(f"{where}: aux_hidden_state_layer_ids {aux} hold {bad}, outside 1..{L} (speculators "
                              f"id j = HF hidden_states[j] of a {L}-layer target; 0, the embedding output, has no "
                              "z-lab id)")
    if int(spec.get("draft_vocab_size", tl.get("vocab_size"))) != int(tl.get("vocab_size")):
        raise ConversionError(f"{where}: draft_vocab_size {spec.get('draft_vocab_size')} != vocab_size "
                              f"{tl.get('vocab_size')}: a reduced draft vocabulary has no z-lab form")
    layer_types = list(tl.get("layer_types") or ["full_attention"] * int(tl["num_hidden_layers"]))
    sliding = "sliding_attention" in layer_types
    non_causal = bool(spec.get("sliding_window_non_causal")) and sliding
    rope = dict(tl.get("rope_parameters") or {})
    theta = rope.get("rope_theta", tl.get("rope_theta"))
    extra = {}
    if kind == "dflash2":
        extra = {k: int(spec[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    config = build_drafter_config(
        target_config, num_layers=int(tl["num_hidden_layers"]), block_size=int(spec["block_size"]),
        target_layer_ids=zlab_layer_ids(aux), mask_token_id=int(spec["mask_token_id"]),
        vocab_size=int(tl["vocab_size"]), layer_types=layer_types,
        sliding_window=int(tl["sliding_window"]) if sliding else None, is_causal=False if non_causal else None,
        intermediate_size=int(tl["intermediate_size"]), num_attention_heads=int(tl["num_attention_heads"]),
        num_key_value_heads=int(tl["num_key_value_heads"]), head_dim=int(tl.get("head_dim") or 0) or None,
        rope_theta=float(theta) if theta is not None else None, architecture=kind, **extra)
    want_rope = drafter_rope_parameters(target_config, float(theta) if theta is not None else None)
    got = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")}
    if got and got != want_rope:
        raise ConversionError(f"{where}: transformer_layer_config.rope_parameters {rope} differs from the target's "
                              f"RoPE the z-lab drafter would use ({want_rope})")
    built = config.to_dict()
    for field in MATCHED_FIELDS:
        if field in tl and tl[field] is not None and built.get(field) != tl[field]:
            if not (isinstance(tl[field], float) and abs(float(built.get(field)) - tl[field]) <= 1e-12):
                raise ConversionError(f"{where}: transformer_layer_config.{field} is {tl[field]!r}, the z-lab config "
                                      f"for {getattr(target_config, '_name_or_path', 'the target')} has "
                                      f"{built.get(field)!r}")
    return config


def draft_weights(weights: dict[str, torch.Tensor], model, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's draft tensors, held to ``model``'s (draftsmith's) tensor set and shapes exactly.

    Raises:
        ConversionError: a vocabulary map, an unknown or a missing tensor, a shape that differs (named), or an
            ``fc`` whose input width is not one H-wide slice per tap.
    """
    maps = [k for k in VOCAB_MAPS if k in weights]
    if maps:
        raise ConversionError(f"{where}: holds {maps}: a reduced draft vocabulary has no z-lab form")
    body = {k: v for k, v in weights.items() if k not in VERIFIER_OWNED}
    want = model.trainable_state_dict()
    extra, missing = sorted(set(body) - set(want)), sorted(set(want) - set(body))
    if extra or missing:
        raise ConversionError(f"{where}: tensors not in the z-lab drafter {extra[:6]}; z-lab tensors missing "
                              f"{missing[:6]}")
    H, taps = int(model.config.hidden_size), len(model.target_layer_ids)
    if tuple(body["fc.weight"].shape) != (H, taps * H):
        raise ConversionError(f"{where}: fc.weight is {tuple(body['fc.weight'].shape)}, expected ({H}, {taps} taps x "
                              f"{H}): every tap must keep its slice")
    for k, v in want.items():
        if tuple(body[k].shape) != tuple(v.shape):
            raise ConversionError(f"{where}: {k} is {tuple(body[k].shape)}, the z-lab drafter's is {tuple(v.shape)}")
    return body


def convert(checkpoint: str | os.PathLike, target_dir: str | os.PathLike, out: str | os.PathLike, *,
            dtype: str = "bfloat16", check_official: bool = True) -> dict:
    """Convert ``checkpoint`` (a speculators ``SAVE_PATH/<epoch>`` folder) into the z-lab folder ``out``.

    Returns:
        A summary (also ``out/conversion.json``): the architecture, speculators and z-lab tap ids, mask token,
        block size, layer types, causality, tensors, draftsmith's export summary, and, with the official package,
        the max abs difference between its draft logits and draftsmith's on random inputs (0 expected).

    Raises:
        ConversionError / FileNotFoundError: see :func:`zlab_config`, :func:`draft_weights`, :func:`read_checkpoint`;
        draftsmith.export.ExportError: the folder does not fit the target.
    """
    from transformers import AutoConfig

    from draftsmith.export import ExportSettings, export_drafter
    from draftsmith.modeling_dflash2 import model_class_for

    checkpoint, out = Path(checkpoint), Path(out)
    spec, weights = read_checkpoint(checkpoint)
    where = str(checkpoint / "config.json")
    config = zlab_config(spec, AutoConfig.from_pretrained(target_dir), where)
    model_class = model_class_for(config.architectures)
    model = model_class(config)
    body = draft_weights(weights, model, str(checkpoint / "model.safetensors"))
    model.load_state_dict({k: v.to(torch.float32) for k, v in body.items()}, strict=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent if out.parent.exists() else None) as tmp:
        model.save_pretrained(Path(tmp) / "trained")
        exported = export_drafter(Path(tmp) / "trained", target_dir, out,
                                  ExportSettings.from_config(drafter={"export_dtype": dtype}))
    written = {k: v for k, v in model_class.from_pretrained(out).trainable_state_dict().items()}
    diff = max(float((written[k].float() - body[k].to(getattr(torch, dtype)).float()).abs().max()) for k in body)
    if diff != 0.0:
        raise ConversionError(f"{out}: written weights differ from {checkpoint}'s by {diff}")
    summary = {
        "checkpoint": str(checkpoint), "target": str(target_dir), "out": str(out),
        "architecture": config.architectures[0],
        "speculators_aux_hidden_state_layer_ids": spec["aux_hidden_state_layer_ids"],
        "zlab_target_layer_ids": list(config.dflash_config["target_layer_ids"]),
        "mask_token_id": config.dflash_config["mask_token_id"], "block_size": config.dflash_config["block_size"],
        "layer_types": list(config.layer_types), "is_causal": config.is_causal,
        "sliding_window_non_causal": bool(spec.get("sliding_window_non_causal")),
        "sliding_window_note": ("speculators' sliding window counts from the anchor for the whole block, z-lab's per "
                                "slot" if "sliding_attention" in config.layer_types else None),
        "tensors": len(body), "readback_max_abs_diff": diff, "export": exported,
    }
    if check_official:
        summary["official_dflash"] = official_check(out, model_class)
    (out / "conversion.json").write_text(json.dumps(json_ready(summary), indent=1) + "\n")
    log.info("converted %s -> %s: taps speculators %s -> z-lab %s, %s", checkpoint, out,
             spec["aux_hidden_state_layer_ids"], summary["zlab_target_layer_ids"], summary.get("official_dflash"))
    return summary


def official_check(folder: str | os.PathLike, model_class) -> dict:
    """Load ``folder`` with the official ``dflash`` package (when importable) and with draftsmith, and compare their
    drafter outputs on one random block (float32). ``{"loaded": False, "reason": ...}`` without the package."""
    try:
        from dflash import model as official
    except ImportError as exc:
        return {"loaded": False, "reason": f"dflash not importable: {exc}"}
    two = model_class.__name__ == "DFlash2DraftModel"
    ref_class = official.DFlash2DraftModel if two else official.DFlashDraftModel
    ref = ref_class.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    H, B = int(ours.config.hidden_size), int(ours.block_size)
    g = torch.Generator().manual_seed(0)
    ctx_len = 3 * B
    noise = torch.randn(1, B, H, generator=g)
    ctx = torch.randn(1, ctx_len, len(ours.target_layer_ids) * H, generator=g)
    pos = torch.arange(ctx_len + B)[None]
    with torch.no_grad():
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        b = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    return {"loaded": True, "class": f"dflash.model.{ref_class.__name__}",
            "target_layer_ids": list(ref.target_layer_ids), "mask_token_id": ref.mask_token_id,
            "block_size": ref.block_size, "max_abs_diff_vs_draftsmith": float((a - b).abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path, help="speculators SAVE_PATH/<epoch> folder")
    ap.add_argument("--target", required=True, type=Path, help="the target folder the drafter was trained for")
    ap.add_argument("--out", required=True, type=Path, help="the z-lab folder to write")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    summary = convert(args.checkpoint, args.target, args.out, dtype=args.dtype)
    print(json.dumps(json_ready({k: v for k, v in summary.items() if k != "export"})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
