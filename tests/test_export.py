"""export: results/drafter/final/ in the z-lab format, loadable by the official package; refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from draftsmith.drafter_config import build_drafter_config
from draftsmith.export import ExportError, ExportSettings, export_drafter
from draftsmith.modeling import DFlashDraftModel
from tiny import tiny_target

MASK = 3
DEFAULTS = ExportSettings.from_config()  # the schema's drafter.export_dtype (bfloat16)
ZLAB_WEIGHTS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}


@pytest.fixture()
def trained(tmp_path):
    """A target folder and a 'trained' drafter folder for it (random weights)."""
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    cfg = build_drafter_config(target.config, num_layers=2, block_size=8, target_layer_ids=[0, 3],
                               mask_token_id=MASK, layer_types=["sliding_attention", "full_attention"],
                               sliding_window=16)
    torch.manual_seed(0)
    DFlashDraftModel(cfg).save_pretrained(tmp_path / "trained")
    return tmp_path


def test_export_writes_the_zlab_format_and_the_official_package_loads_it(official, trained):
    summary = export_drafter(trained / "trained", trained / "target", trained / "final",
                             ExportSettings.from_config(drafter={"export_dtype": "bfloat16"}))
    assert summary["readback_max_abs_diff"] == 0.0 and summary["dtype"] == "bfloat16"
    cfg = json.loads((trained / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 3], "mask_token_id": MASK, "block_size": 8}
    assert cfg["num_target_layers"] == 4 and cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 16 and cfg["use_sliding_window"] is True
    assert "is_causal" in cfg and cfg["hidden_size"] == 64 and cfg["vocab_size"] == 512
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] > 0
    weights = load_file(str(trained / "final" / "model.safetensors"))
    assert set(weights) == ZLAB_WEIGHTS  # z-lab names; no embedding, no LM head
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    src = load_file(str(trained / "trained" / "model.safetensors"))
    assert all(torch.equal(weights[k], src[k].to(torch.bfloat16)) for k in weights)

    ref = official.DFlashDraftModel.from_pretrained(str(trained / "final"), dtype=torch.float32).eval()
    ours = DFlashDraftModel.from_pretrained(trained / "final", dtype=torch.float32)
    torch.manual_seed(0)
    noise, ctx, pos = torch.randn(1, 8, 64), torch.randn(1, 20, 128), torch.arange(28)[None]
    with torch.no_grad():
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        b = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
    assert torch.allclose(a, b, atol=1e-6)
    assert ref.target_layer_ids == [0, 3] and ref.mask_token_id == MASK and ref.block_size == 8


def test_export_keeps_the_target_yarn_rope_in_both_config_forms(official, tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 5e6, "factor": 8.0, "original_max_position_embeddings": 4096}
    target = tiny_target("qwen3", max_position_embeddings=32768, rope_parameters=yarn)
    target.save_pretrained(tmp_path / "target")
    expected = Qwen3RotaryEmbedding(target.config)
    cfg = build_drafter_config(target.config, num_layers=2, block_size=8, target_layer_ids=[0, 3], mask_token_id=MASK)
    DFlashDraftModel(cfg).save_pretrained(tmp_path / "trained")
    summary = export_drafter(tmp_path / "trained", tmp_path / "target", tmp_path / "final", DEFAULTS)
    assert summary["rope_parameters"] == yarn
    written = json.loads((tmp_path / "final" / "config.json").read_text())
    assert written["rope_parameters"] == yarn and written["rope_theta"] == 5e6  # transformers 5 and older readers
    assert written["rope_scaling"] == {k: v for k, v in yarn.items() if k != "rope_theta"}
    for model in (DFlashDraftModel.from_pretrained(tmp_path / "final"),
                  official.DFlashDraftModel.from_pretrained(str(tmp_path / "final"))):
        assert torch.equal(model.rotary_emb.inv_freq, expected.inv_freq)
        assert model.rotary_emb.attention_scaling == expected.attention_scaling != 1.0


@pytest.mark.parametrize("field", ["target_layer_ids", "mask_token_id"])
def test_export_refuses_without_explicit_ids(trained, field):
    path = trained / "trained" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["dflash_config"][field]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=f"config.json: dflash_config.{field} is not set explicitly"):
        export_drafter(trained / "trained", trained / "target", trained / "final", DEFAULTS)
    assert not (trained / "final" / "model.safetensors").exists()


def test_export_refuses_a_drafter_that_does_not_fit_the_target(trained):
    other = tiny_target("llama", hidden_size=32)
    other.save_pretrained(trained / "other")
    with pytest.raises(ExportError, match="hidden_size 64 != target hidden_size 32"):
        export_drafter(trained / "trained", trained / "other", trained / "final", DEFAULTS)
    path = trained / "trained" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 4]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"target_layer_ids \[0, 4\] outside 0..3"):
        export_drafter(trained / "trained", trained / "target", trained / "final", DEFAULTS)


def test_export_refuses_non_finite_weights(trained):
    path = trained / "trained" / "model.safetensors"
    w = load_file(str(path))
    w["layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(w, str(path))
    with pytest.raises(ExportError, match="non-finite values in \\['layers.1.mlp.up_proj.weight'\\]"):
        export_drafter(trained / "trained", trained / "target", trained / "final", DEFAULTS)
