"""Check the speculators -> z-lab conversion numerically: speculators' own drafter module (loaded by speculators from
its checkpoint) and draftsmith's drafter loaded from the converted z-lab folder must compute the same block hidden
states from the same target features. Run with the speculators virtualenv's Python, the worktree on PYTHONPATH (for
draftsmith and bench/peers); a CPU is enough:

    PYTHONPATH=$PWD /tmp/venv-speculators/bin/python bench/peers/check_speculators_equivalence.py \
        --checkpoint /tmp/peers-tiny/speculators-out/0 --target /tmp/peers-tiny/target

speculators' side runs its modules by hand, as its training forward does for one block with no mask (every layer
then sees all context and the whole block, which is also what the z-lab forward does without a mask):
``hidden_norm(fc(features))`` -> its decoder layers (``target_hidden`` the normed context, positions 0..C+B-1) ->
``norm``. draftsmith's side is ``DFlashDraftModel.forward`` (or DFlash2's). Prints the max abs difference (float32)
and exits 1 above ``--atol``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def speculators_hidden(model, features: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """speculators' drafter on one block: ``features [1, C, n*H]``, ``noise [1, B, H]`` -> ``[1, B, H]``."""
    ctx = model.hidden_norm(model.fc(features))
    pos = torch.arange(features.shape[1] + noise.shape[1])[None]
    emb = model.rotary_emb(ctx, pos)
    x = noise
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                  position_embeddings=emb)
    return model.norm(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--atol", type=float, default=1e-4)
    args = ap.parse_args(argv)

    from convert_speculators import convert
    from speculators.model import SpeculatorModel

    from draftsmith.modeling_dflash2 import model_class_for

    kind = json.loads((args.checkpoint / "config.json").read_text())["speculators_model_type"]
    __import__(f"speculators.models.{kind}")
    spec = SpeculatorModel.registry[kind].from_pretrained(str(args.checkpoint)).float().eval()
    spec.config.transformer_layer_config._attn_implementation = "sdpa"
    for layer in spec.layers:
        layer.self_attn.config._attn_implementation = "sdpa"
    with tempfile.TemporaryDirectory() as tmp:
        summary = convert(args.checkpoint, args.target, Path(tmp) / "zlab", dtype="float32")
        cfg = json.loads((Path(tmp) / "zlab" / "config.json").read_text())
        ours = model_class_for(cfg["architectures"]).from_pretrained(Path(tmp) / "zlab", dtype=torch.float32).eval()
    H, B, n = int(ours.config.hidden_size), int(ours.block_size), len(ours.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for ctx_len in (1, 2 * B + 3):
        features = torch.randn(1, ctx_len, n * H, generator=g)
        noise = torch.randn(1, B, H, generator=g)
        with torch.no_grad():
            a = speculators_hidden(spec, features, noise)
            b = ours(position_ids=torch.arange(ctx_len + B)[None], noise_embedding=noise, target_hidden=features)
        b = b[0] if isinstance(b, tuple) else b
        worst = max(worst, float((a - b).abs().max()))
    result = {"kind": kind, "zlab_target_layer_ids": summary["zlab_target_layer_ids"],
              "speculators_ids": summary["speculators_aux_hidden_state_layer_ids"], "max_abs_diff": worst,
              "official_dflash": summary.get("official_dflash")}
    print(json.dumps(result))
    return 0 if worst <= args.atol else 1


if __name__ == "__main__":
    sys.exit(main())
