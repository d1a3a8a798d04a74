"""The DFlash drafter model: interop with the official z-lab package, inference-exact training, no leaks.

The official ``dflash==0.1.0`` (``pip install --no-deps``, test extra) is the reference: its
``DFlashDraftModel.from_pretrained`` must load our folder and give the same hidden states; its ``dflash_generate``
must return the target's own greedy tokens with our drafter. Training semantics are tested against the
inference forward itself (a training block == the decode step that would draft it), and by perturbation
(features at / after the anchor, or in another packed document, never change a block's logits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from draftsmith.drafter_config import (
    build_drafter_config,
    default_loss_gamma,
    resolve_mask_token_id,
)
from draftsmith.drafter_loss import dpace_weights, head_cross_entropy, slot_weights
from draftsmith.flops import attended_pairs, step_flops, training_flops
from draftsmith.modeling import (
    DFlashDraftModel,
    PackedBatch,
    block_targets,
    dflash_block_mask,
    dflash_mask_mod,
    sample_anchors,
)
from draftsmith.target import load_target_embeddings_and_head
from draftsmith.target_layers import default_target_layer_ids
from draftsmith.train import loss_weight
from tiny import tiny_config, tiny_target

MASK = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", initializer_range=0.1)


def make_drafter(target, *, layer_types=None, sliding_window=None, is_causal=None, block_size=4, layer_ids=(1, 2),
                 seed=0, num_layers=2):
    """A random drafter for ``target`` with perturbed norm weights (so every weight matters in comparisons)."""
    cfg = build_drafter_config(target.config, num_layers=num_layers, block_size=block_size,
                               target_layer_ids=list(layer_ids), mask_token_id=MASK, layer_types=layer_types,
                               sliding_window=sliding_window, is_causal=is_causal)
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


VARIANTS = {
    "full": {},
    "sliding+full": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
    "sliding-noncausal": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 6,
                          "is_causal": False},
}


# ------------------------------------------------------------------------------------------------------------
# configuration helpers
# ------------------------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "rope_theta": 5e6, "factor": 8.0, "original_max_position_embeddings": 4096}
ROPE_TARGETS = {
    # Gemma 3 style: RoPE nested per layer type (transformers 5), full attention YaRN, sliding attention plain 1e4
    "gemma3-nested-yarn": lambda: Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
        rope_parameters={"full_attention": dict(YARN), "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 1e4}}),
    "qwen3-yarn": lambda: tiny_config("qwen3", max_position_embeddings=32768, rope_parameters=dict(YARN)),
    # legacy top-level rope_theta + rope_scaling with the old "type" spelling (Llama 3.1)
    "llama-legacy-llama3": lambda: tiny_config("llama", max_position_embeddings=131072, rope_theta=5e5, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
}


def target_full_attention_rope(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the target's full-attention layers, by transformers' classes."""
    if isinstance(config, Gemma3TextConfig):
        rotary = Gemma3RotaryEmbedding(config)
        return rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling
    rotary = (LlamaRotaryEmbedding if isinstance(config, LlamaConfig) else Qwen3RotaryEmbedding)(config)
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize("kind", list(ROPE_TARGETS))
def test_drafter_takes_the_target_full_attention_rope_through_export(official, kind, tmp_path):
    target_config = ROPE_TARGETS[kind]()
    inv_freq, scaling = target_full_attention_rope(target_config)
    assert scaling != 1.0 or kind.startswith("llama")  # YaRN scales attention; llama3 only the frequencies
    cfg = build_drafter_config(target_config, num_layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=MASK)
    drafter = DFlashDraftModel(cfg)
    assert torch.equal(drafter.rotary_emb.inv_freq, inv_freq) and drafter.rotary_emb.attention_scaling == scaling
    drafter.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    theta = 5e5 if kind.startswith("llama") else 5e6
    assert written["rope_theta"] == theta and written["rope_parameters"]["rope_theta"] == theta
    assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] != "default"
    assert written["rope_scaling"]["factor"] == 8.0
    # our loader, the official dflash package, and an older reader's view (legacy keys only) all compute it again
    loaded = [DFlashDraftModel.from_pretrained(tmp_path), official.DFlashDraftModel.from_pretrained(str(tmp_path))]
    legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    loaded.append(DFlashDraftModel.from_pretrained(tmp_path))
    for model in loaded:
        assert torch.equal(model.rotary_emb.inv_freq, inv_freq) and model.rotary_emb.attention_scaling == scaling
    pos = torch.tensor([[0, 4095, 20000]])
    x = torch.zeros(1, 3, 16)
    assert all(torch.equal(m.rotary_emb(x, pos)[0], drafter.rotary_emb(x, pos)[0]) for m in loaded)


def test_partially_rotary_target_keeps_theta_and_its_frequencies(caplog):
    target_config = tiny_config("qwen3_5", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                           "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]})
    inv_freq = Qwen3_5TextRotaryEmbedding(target_config).inv_freq  # 2 frequencies over the 4 rotary dims
    with caplog.at_level("WARNING", logger="draftsmith.drafter_config"):
        cfg = build_drafter_config(target_config, num_layers=1, block_size=4, target_layer_ids=[3],
                                   mask_token_id=MASK)
    assert "rope_parameters.partial_rotary_factor = 0.25" in caplog.text
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    drafter_freq = DFlashDraftModel(cfg).rotary_emb.inv_freq  # the whole head of 16: 8 frequencies
    assert drafter_freq.shape == (8,) and torch.allclose(drafter_freq[::4], inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope, key", [
    ({"full_attention": None, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters.full_attention"),
    ({"rope_type": "proportional", "rope_theta": 1e4}, "rope_parameters.rope_type"),
    ({"rope_type": "default", "rope_theta": 1e4, "rope_fancy": 2.0}, "rope_parameters.rope_fancy"),
])
def test_a_rope_the_drafter_cannot_represent_is_refused_naming_the_key(rope, key):
    target_config = tiny_config("qwen3")
    target_config.layer_types = ["sliding_attention", "full_attention"] * 2
    target_config.rope_parameters = rope
    with pytest.raises(ValueError, match=key):
        build_drafter_config(target_config, num_layers=1, block_size=4, target_layer_ids=[3], mask_token_id=MASK)

def test_default_target_layer_ids_official_formula(official):
    # the published 27B-class drafter: 64 target layers, 5 taps
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(5, 2) == [1, 2]
    with pytest.raises(ValueError, match="explicitly"):
        default_target_layer_ids(4, 3)  # ids would collide
    for L in (8, 28, 36, 48, 64):
        for n in (1, 2, 3, 5):
            if L - 4 >= n - 1:
                assert default_target_layer_ids(L, n) == official.build_target_layer_ids(L, n)


class _Tok:
    def __init__(self, n, mask=None, pad=None, eos=None):
        self.n, self.mask_token_id, self.pad_token_id, self.eos_token_id, self.unk_token_id = n, mask, pad, eos, None

    def __len__(self):
        return self.n


def test_mask_token_resolution_order():
    assert resolve_mask_token_id(7, _Tok(100, mask=5), 128) == (7, "config")
    assert resolve_mask_token_id(None, _Tok(100, mask=5), 128)[0] == 5
    assert resolve_mask_token_id(None, _Tok(100), 128)[0] == 100  # first unused embedding row
    assert resolve_mask_token_id(None, _Tok(128, pad=9, eos=2), 128)[0] == 9
    assert resolve_mask_token_id(None, _Tok(128, eos=[2, 4]), 128)[0] == 2
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        resolve_mask_token_id(128, None, 128)
    with pytest.raises(ValueError, match="set drafter.mask_token_id"):
        resolve_mask_token_id(None, _Tok(128), 128)


def test_loss_gamma_default():
    assert default_loss_gamma(16) == 7.0 and default_loss_gamma(8) == 3.5
    w = slot_weights(16, 7.0)
    assert w[0] == 1.0 and w[-1] == pytest.approx(torch.exp(torch.tensor(-14 / 7)).item())


@pytest.mark.parametrize("layout", ["untied", "tied", "qwen3_5_keys", "sharded"])
def test_load_target_embeddings_and_head_by_key(tmp_path, layout):
    torch.manual_seed(0)
    embed, head = torch.randn(50, 8), torch.randn(50, 8)
    other = {"model.layers.0.mlp.up_proj.weight": torch.randn(4, 8)}
    cfg = {"tie_word_embeddings": layout == "tied"}
    if layout == "untied":
        save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head, **other},
                  str(tmp_path / "model.safetensors"))
    elif layout == "tied":
        save_file({"model.embed_tokens.weight": embed, **other}, str(tmp_path / "model.safetensors"))
        head = embed
    elif layout == "qwen3_5_keys":  # Qwen3_5ForConditionalGeneration names
        save_file({"model.language_model.embed_tokens.weight": embed, "lm_head.weight": head,
                   "model.visual.blocks.0.attn.qkv.weight": torch.randn(3, 3), **other},
                  str(tmp_path / "model.safetensors"))
    else:
        save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model-00001-of-00002.safetensors"))
        save_file({"lm_head.weight": head, **other}, str(tmp_path / "model-00002-of-00002.safetensors"))
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.layers.0.mlp.up_proj.weight": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    e, h = load_target_embeddings_and_head(tmp_path)
    assert torch.equal(e, embed) and torch.equal(h, head)


def test_load_embeddings_of_a_saved_hf_target_equal_its_modules(tmp_path):
    for tied in (False, True):
        t = tiny_target("qwen3", tie_word_embeddings=tied)
        t.save_pretrained(tmp_path / str(tied))
        e, h = load_target_embeddings_and_head(tmp_path / str(tied))
        assert torch.equal(e, t.get_input_embeddings().weight.detach())
        assert torch.equal(h, t.lm_head.weight.detach())


def test_load_embeddings_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_target_embeddings_and_head(tmp_path)
    save_file({"foo.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="no input embedding"):
        load_target_embeddings_and_head(tmp_path)


# ------------------------------------------------------------------------------------------------------------
# interop with the official z-lab package
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_official_package_loads_our_folder_and_matches(official, target, tmp_path, variant):
    ours = make_drafter(target, **VARIANTS[variant])
    ours.save_pretrained(tmp_path)
    ref = official.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    assert ref.target_layer_ids == ours.target_layer_ids and ref.mask_token_id == MASK and ref.block_size == 4
    assert [layer.self_attn.is_causal for layer in ref.layers] == [layer.self_attn.is_causal for layer in ours.layers]
    assert ([layer.self_attn.sliding_window for layer in ref.layers]
            == [layer.self_attn.sliding_window for layer in ours.layers])
    torch.manual_seed(1)
    noise = torch.randn(2, 4, 64)
    ctx = torch.randn(2, 9, 128)
    pos = torch.arange(13).expand(2, -1)
    with torch.no_grad():
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        b = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
        head = target.lm_head
        assert torch.allclose(ours.compute_logits(a, head), ref.compute_logits(b, head), atol=1e-5)
        # decode with a KV cache over two steps, as dflash_generate does
        caches = [official._make_cache(m.config) for m in (ours, ref)]
        outs = []
        for model, cache in zip((ours, ref), caches):
            h1 = model(position_ids=pos[:, :13], noise_embedding=noise, target_hidden=ctx, past_key_values=cache,
                       use_cache=True)
            official._crop_to(cache, 9)
            h2 = model(position_ids=torch.arange(9, 15).expand(2, -1), noise_embedding=noise,
                       target_hidden=ctx[:, :2], past_key_values=cache, use_cache=True)
            outs.append((h1, h2))
        assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6)


def test_our_loader_roundtrip_and_refusals(target, tmp_path):
    ours = make_drafter(target, **VARIANTS["sliding+full"])
    ours.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": MASK, "block_size": 4}
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 5
    assert cfg["use_sliding_window"] is True and "is_causal" in cfg and cfg["num_target_layers"] == 4
    back = DFlashDraftModel.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    del cfg["dflash_config"]["mask_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_token_id is missing"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_official_generate_with_our_drafter_is_lossless(official, target, tmp_path, monkeypatch):
    monkeypatch.setattr(official, "_cuda_time", time.perf_counter)  # timing only; it assumes CUDA
    make_drafter(target, block_size=5).save_pretrained(tmp_path)
    drafter = official.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    prompt = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    out = official.dflash_generate(drafter, target, prompt, 30, None, return_stats=True)
    ids = prompt
    with torch.no_grad():
        for _ in range(30):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.output_ids.tolist() == ids.tolist()
    assert sum(out.acceptance_lengths) == 29  # every committed token accounted for (first one from prefill)


# ------------------------------------------------------------------------------------------------------------
# training semantics
# ------------------------------------------------------------------------------------------------------------

def packed_batch(seed=0, lengths=(11, 15, 9), anchors=None, target_tokens=False):
    """A packed row of three documents with random features and all positions supervised."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(5, 500, (1, S), generator=g)
    if anchors is None:
        anchors = [2, 9, 12, 20, 24, 27, 33]
    anchors = torch.tensor([anchors])
    tt = torch.randint(5, 500, (1, S), generator=g) if target_tokens else None
    return PackedBatch(torch.randn(1, S, 128, generator=g), ids, torch.ones(1, S, dtype=torch.bool), docs, pos,
                       anchors, torch.ones_like(anchors, dtype=torch.bool), tt)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_block_equals_the_inference_decode_step(target, variant):
    """Each training block's hidden states == the drafter's inference forward on [doc context < a, block]."""
    model = make_drafter(target, **VARIANTS[variant])
    E = target.get_input_embeddings().weight.detach()
    batch = packed_batch()
    with torch.no_grad():
        h = model.block_hidden(batch, E, backend="sdpa")[0]
        for j, a in enumerate(batch.anchors[0].tolist()):
            doc = batch.doc_ids[0, a]
            start = int((batch.doc_ids[0] == doc).nonzero()[0])
            p = a - start
            noise = F.embedding(torch.tensor([[batch.input_ids[0, a].item()] + [MASK] * 3]), E)
            ref = model(position_ids=torch.arange(p + 4)[None], noise_embedding=noise,
                        target_hidden=batch.features[:, start:a])
            assert torch.allclose(h[j], ref[0], atol=2e-6), (variant, j, (h[j] - ref[0]).abs().max())


@pytest.mark.parametrize("variant", ["full", "sliding+full"])
def test_no_leak_from_positions_at_or_after_the_anchor_or_other_documents(target, variant):
    model = make_drafter(target, **VARIANTS[variant])
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    base = packed_batch()
    j, a = 3, 20  # block anchored at row 20 (document 1 = rows 11..25)

    def logits(batch):
        with torch.no_grad():
            return model.compute_logits(model.block_hidden(batch, E, backend="sdpa")[0, j], Hd)

    ref = logits(base)
    for what in ("features_at_and_after_anchor", "other_documents", "other_document_tokens"):
        b = packed_batch()
        if what == "features_at_and_after_anchor":
            b.features[0, a:26] = torch.randn(26 - a, 128) * 10
        elif what == "other_documents":
            b.features[0, :11] = torch.randn(11, 128) * 10
            b.features[0, 26:] = torch.randn(9, 128) * 10
        else:
            b.input_ids[0, :11] = 7
            b.input_ids[0, 26:] = 7
        assert torch.equal(logits(b), ref), what
    # control: the feature just before the anchor is context, so changing it must change the logits
    b = packed_batch()
    b.features[0, a - 1] += 1.0
    assert not torch.allclose(logits(b), ref)


def test_sliding_layers_see_exactly_the_window(target):
    """W = 5: slot k of the block at a sees context p >= a + k - 4; older context must not matter."""
    model = make_drafter(target, layer_types=["sliding_attention"], sliding_window=5, num_layers=1)
    E = target.get_input_embeddings().weight.detach()
    a = 20  # document 1 starts at 11: positions 11..19 are context
    base = packed_batch()
    with torch.no_grad():
        ref = model.block_hidden(base, E, backend="sdpa")[0, 3]
        b = packed_batch()
        b.features[0, 11:a - 4] = torch.randn(a - 4 - 11, 128) * 10  # older than a - 4: outside every slot's window
        assert torch.equal(model.block_hidden(b, E, backend="sdpa")[0, 3], ref)
        b = packed_batch()
        b.features[0, a - 2] += 1.0  # visible to slots 0..2 (a + k - 4 <= a - 2), not slot 3
        h = model.block_hidden(b, E, backend="sdpa")[0, 3]
        assert not torch.allclose(h[0], ref[0]) and torch.equal(h[3], ref[3])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flex_attention_and_dense_sdpa_give_the_same_loss(target, variant):
    """flex_attention BlockMask (CUDA path; its eager CPU forward here) == dense SDPA mask (CPU path)."""
    model = make_drafter(target, **VARIANTS[variant])
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch(target_tokens=True)
    with torch.no_grad():
        dense = model.training_forward(batch, E, Hd, gamma=3.5, use_target_tokens=True, backend="sdpa")
        flex = model.training_forward(batch, E, Hd, gamma=3.5, use_target_tokens=True, backend="flex")
    assert torch.allclose(dense.loss, flex.loss, atol=1e-5, rtol=1e-5), (dense.loss, flex.loss)
    assert torch.equal(dense.count, flex.count) and torch.equal(dense.correct, flex.correct)


def test_labels_validity_and_weighted_loss(target):
    model = make_drafter(target)
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch(target_tokens=True, anchors=[2, 9, 24])
    batch.loss_mask[0, 5] = False
    labels, valid = block_targets(batch, 4, use_target_tokens=False)
    assert labels[0, 0].tolist() == batch.input_ids[0, 3:6].tolist()  # slot k -> token a + k
    assert valid[0, 0].tolist() == [True, True, False]  # loss_mask[5] = 0
    assert valid[0, 1].tolist() == [True, False, False]  # rows 11, 12 are document 1
    assert valid[0, 2].tolist() == [True, False, False]  # document 1 ends at row 25
    t_labels, _ = block_targets(batch, 4, use_target_tokens=True)
    assert t_labels[0, 0].tolist() == batch.target_token[0, 2:5].tolist()  # target's next-token at a + k - 1
    with torch.no_grad():
        out = model.training_forward(batch, E, Hd, gamma=2.0, backend="sdpa")
        h = model.block_hidden(batch, E, backend="sdpa")[0, :, 1:]
        logits = model.compute_logits(h, Hd)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[0].reshape(-1), reduction="none").view(3, 3)
        w = valid[0].float() * torch.exp(-torch.arange(3.0) / 2.0)
        assert out.loss.item() == pytest.approx(((ce * w).sum() / w.sum()).item(), rel=1e-5)
        # what the trainer normalises by the whole optimizer step: sum(CE * w), and sum(w) known before the forward
        assert out.weighted_ce.item() == pytest.approx((ce * w).sum().item(), rel=1e-5)
        assert out.weight_sum.item() == pytest.approx(w.sum().item(), rel=1e-6)
        assert loss_weight(batch, 4, 2.0) == pytest.approx(w.sum().item(), rel=1e-6)
    assert out.count.tolist() == [3, 1, 0] and out.full_blocks.item() == 0


def test_supervised_slot_statistics_equal_the_boolean_mask_forms():
    """The training forward's index-based gathers and per-slot sums (one ``nonzero``, no other host sync) give what
    the boolean masks and ``bincount`` gave: the same supervised rows in the same order, per-slot CE, hits and
    counts, and the accepted prefix of fully supervised blocks."""
    from draftsmith.modeling import accepted_prefix, per_slot_sum, supervised_slots

    g = torch.Generator().manual_seed(5)
    for R, A, S in ((2, 7, 5), (1, 3, 1), (3, 4, 15)):
        valid = torch.rand(R, A, S, generator=g) < 0.8
        valid[0, 0] = True  # a fully supervised block at least
        values = torch.randn(R, A, S, 6, generator=g)
        index, slot = supervised_slots(valid)
        flat = valid.view(-1)
        assert torch.equal(values.reshape(-1, 6).index_select(0, index), values.reshape(-1, 6)[flat])
        assert torch.equal(slot, torch.arange(S).expand_as(valid).reshape(-1)[flat])
        ce = torch.rand(index.numel(), generator=g)
        hit = torch.rand(index.numel(), generator=g) < 0.6
        ce_sum, correct, count = (per_slot_sum(slot, S, v) for v in (ce, hit, torch.ones_like(slot)))
        assert torch.allclose(ce_sum, torch.zeros(S).index_add_(0, slot, ce))
        assert torch.equal(correct, torch.zeros(S, dtype=torch.long).index_add_(0, slot, hit.long()))
        assert torch.equal(count, torch.bincount(slot, minlength=S))
        grid = torch.zeros(valid.numel(), dtype=torch.bool)
        grid[flat] = hit
        full = valid.all(-1)
        prefix = grid.view(valid.shape).long().cumprod(-1).sum(-1)
        accept, blocks = accepted_prefix(valid, index, hit)
        assert accept.item() == prefix[full].sum().item() and blocks.item() == full.sum().item() >= 1


def _dpace_reference(q: list[float], valid: list[bool], alpha: float) -> list[float]:
    """D-PACE's Eq. 7-8 (arXiv 2605.18810) written out: w_j = sum_{m >= j} prod_{i <= m} q~_i, q~ = 1 where no
    label."""
    smooth = [(1 - alpha) * qi + alpha if v else 1.0 for qi, v in zip(q, valid)]
    out = []
    for j in range(len(q)):
        if not valid[j]:
            out.append(0.0)
            continue
        out.append(sum(math.prod(smooth[:m + 1]) for m in range(j, len(q)) if valid[m]))
    return out


def test_dpace_weights_follow_the_paper():
    """The vectorised weights equal Eq. 7-8 written out, per block, with unlabelled slots weighing 0 and leaving
    the product alone; a sure drafter (q = 1) weighs slot j by the valid slots from j on; nothing is differentiable;
    alpha outside (0, 1] is refused."""
    g = torch.Generator().manual_seed(3)
    q = torch.rand(2, 5, 7, generator=g, requires_grad=True)
    valid = torch.rand(2, 5, 7, generator=g) > 0.25
    w = dpace_weights(q, valid, 0.5)
    assert not w.requires_grad and w.dtype == torch.float32
    for r in range(2):
        for a in range(5):
            want = _dpace_reference(q[r, a].tolist(), valid[r, a].tolist(), 0.5)
            assert w[r, a].tolist() == pytest.approx(want, rel=1e-5)
    assert dpace_weights(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), 0.3).tolist() == [[4, 3, 2, 1]]
    # an unsure first slot gates the later ones (they weigh less than behind a sure one); unsure later slots leave
    # the weight on the first; alpha = 1 ignores the confidence
    full = torch.ones(1, 3, dtype=torch.bool)
    sure = dpace_weights(torch.tensor([[0.9, 0.9, 0.9]]), full, 0.5)[0]
    first_unsure = dpace_weights(torch.tensor([[0.1, 0.9, 0.9]]), full, 0.5)[0]
    later_unsure = dpace_weights(torch.tensor([[0.9, 0.1, 0.1]]), full, 0.5)[0]
    assert (first_unsure[1:] < sure[1:]).all()
    assert later_unsure[0] / later_unsure[1] > sure[0] / sure[1]
    assert torch.equal(dpace_weights(q, valid, 1.0), valid.float().flip(-1).cumsum(-1).flip(-1) * valid)
    for alpha in (0.0, 1.5):
        with pytest.raises(ValueError, match="alpha must be in"):
            dpace_weights(q, valid, alpha)


def test_dpace_loss_is_the_weighted_cross_entropy_over_the_supervised_count(target):
    """training_forward with D-PACE: ``sum(CE * w) / n`` over the n supervised slots, w from the drafter's own
    confidence exp(-CE) of the full logits, detached (the gradient is that of the CE weighted by constants); the
    trainer's normaliser (loss_weight with dpace) is the same n, known before the forward."""
    model = make_drafter(target).train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch(target_tokens=True, anchors=[2, 9, 24])
    batch.loss_mask[0, 5] = False
    labels, valid = block_targets(batch, 4, use_target_tokens=True)
    out = model.training_forward(batch, E, Hd, gamma=2.0, dpace_alpha=0.5, use_target_tokens=True, backend="sdpa")
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad])
    h = model.block_hidden(batch, E, backend="sdpa")[0, :, 1:]
    logits = model.compute_logits(h, Hd)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[0].reshape(-1),
                         reduction="none").view(3, 3)
    q = torch.exp(-ce.detach())
    w = torch.tensor([_dpace_reference(q[a].tolist(), valid[0, a].tolist(), 0.5) for a in range(3)])
    n = valid.sum().item()
    ref = (ce * w * valid[0]).sum() / n
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert out.weight_sum.item() == n == loss_weight(batch, 4, 2.0, dpace=True)
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_sample_anchors_per_document():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    docs = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1])
    a = sample_anchors(mask, docs, 100)
    assert a.tolist() == [1, 2, 6, 7, 8]  # 3: mask[4]=0; 5: next is another document; 9: next is padding
    g = torch.Generator().manual_seed(0)
    a2 = sample_anchors(mask, docs, 1, g)
    assert len(a2) == 2 and a2[0] in (1, 2) and a2[1] in (6, 7, 8)
    assert torch.equal(a2, sample_anchors(mask, docs, 1, torch.Generator().manual_seed(0)))


def test_training_flops_match_the_flop_counter(target):
    """training_flops (used for MFU) == torch's FlopCounterMode on a real training step (matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make_drafter(target).train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch(target_tokens=True)
    _, valid = block_targets(batch, 4, True)
    want = training_flops(model.config, ctx_tokens=batch.input_ids.shape[1],
                          block_tokens=batch.anchors.shape[1] * 4, head_tokens=int(valid.sum()), attended_pairs=0)
    with FlopCounterMode(display=False) as counter:
        out = model.training_forward(batch, E, Hd, gamma=3.5, use_target_tokens=True, backend="sdpa")
        out.loss.backward()
    mm = sum(v for k, v in counter.get_flop_counts()["Global"].items() if "mm" in str(k) and "bmm" not in str(k))
    assert want["total"] == mm


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 6)])
def test_attended_pairs_count_the_dense_mask(target, layer_types, window):
    """The attention term of MFU counts exactly the (query, key) pairs the DFlash mask lets through, per layer:
    the interval count equals the dense mask's sum (sliding and full layers, padding blocks included)."""
    from draftsmith.modeling import dense_mask

    model = make_drafter(target, layer_types=layer_types, sliding_window=window)
    batch = packed_batch(anchors=[2, 9, 12, 20, 24, 27, 33], target_tokens=True)
    batch.anchor_valid[0, -1] = False  # a padding block sees only itself
    anchor_doc = torch.where(batch.anchor_valid, torch.gather(batch.doc_ids, 1, batch.anchors),
                             torch.full_like(batch.anchors, -2))
    S, QA = batch.input_ids.shape[1], batch.anchors.shape[1] * model.block_size
    want = 0
    for layer in model.layers:
        c, w = layer.self_attn.mask_key
        mod = dflash_mask_mod(batch.doc_ids, batch.anchors, anchor_doc, model.block_size, is_causal=c,
                              sliding_window=w)
        mask = dense_mask(mod, 1, QA, S + QA, torch.device("cpu"))
        want += int(mask.sum())
    assert attended_pairs(model, batch) == want
    _, valid = block_targets(batch, model.block_size, True)
    assert step_flops(model, batch, True) == training_flops(
        model.config, ctx_tokens=S, block_tokens=QA, head_tokens=int(valid.sum()), attended_pairs=want)["total"]


def _random_packing(S, docs, pad_blocks, seed, num_anchors=20):
    """A packed row set of ``docs`` documents (random boundaries, some tail padding) with per-document anchors."""
    g = torch.Generator().manual_seed(seed)
    R = 2
    doc_ids = torch.full((R, S), -1)
    rows = []
    for r in range(R):
        cuts = sorted(torch.randint(1, S - 5, (docs - 1,), generator=g).tolist())
        bounds = [0] + cuts + [S - int(torch.randint(0, 40, (1,), generator=g))]
        for d in range(docs):
            doc_ids[r, bounds[d]:bounds[d + 1]] = d
        rows.append(sample_anchors(torch.rand(S, generator=g) < 0.7, doc_ids[r], num_anchors, g))
    A = max(len(a) for a in rows) + pad_blocks
    anchors = torch.zeros(R, A, dtype=torch.long)
    valid = torch.zeros(R, A, dtype=torch.bool)
    for r, a in enumerate(rows):
        anchors[r, :len(a)], valid[r, :len(a)] = a, True
    return doc_ids, anchors, torch.where(valid, torch.gather(doc_ids, 1, anchors), torch.full_like(anchors, -2))


@pytest.mark.parametrize("S,docs,B,causal,window,tile", [
    (200, 1, 4, False, None, 128), (384, 3, 16, False, None, 128), (1000, 7, 16, True, None, 64),
    (1000, 3, 4, False, 5, 128), (384, 7, 16, True, 200, 64), (1000, 1, 16, False, 200, 128),
    (200, 3, 4, True, 5, 64), (1000, 7, 4, False, None, 64)])
def test_block_mask_from_the_block_structure_equals_create_block_mask(S, docs, B, causal, window, tile):
    """The BlockMask built by interval arithmetic (no queries x keys grid) has exactly the partial and full
    blocks that create_block_mask finds by evaluating mask_mod everywhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_ids, anchors, anchor_doc = _random_packing(S, docs, pad_blocks=S % 5, seed=S + docs + B)
    R, A = anchors.shape
    ours = dflash_block_mask(doc_ids, anchors, anchor_doc, B, is_causal=causal, sliding_window=window, tile=tile)
    mod = dflash_mask_mod(doc_ids, anchors, anchor_doc, B, is_causal=causal, sliding_window=window)
    ref = create_block_mask(mod, R, None, A * B, S + A * B, device="cpu", BLOCK_SIZE=tile, _compile=False)

    def blocks(bm):
        return [[[sorted(idx[r, 0, q, :num[r, 0, q]].tolist()) for q in range(num.shape[2])] for r in range(R)]
                for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices))]

    partial, full = blocks(ours)
    assert (partial, full) == tuple(blocks(ref))
    if (window is None or window >= 2 * tile) and S // docs >= 3 * tile:  # long documents: full blocks exist
        assert sum(map(len, sum(full, []))) > 0


@pytest.mark.parametrize("multiplier,softcap", [(1.0, None), (0.5, None), (1.0, 30.0), (2.0, 5.0)])
def test_chunked_head_cross_entropy_equals_full_logits(multiplier, softcap):
    """Per-row CE, argmax and the gradient w.r.t. the hidden states equal F.cross_entropy over the full
    logits (float32, summation-order differences only), whatever the chunk size; no gradient reaches the head."""
    torch.manual_seed(0)
    N, H, V = 300, 32, 1000
    hidden = torch.randn(N, H, requires_grad=True)
    head = torch.randn(V, H)
    labels, w = torch.randint(0, V, (N,)), torch.rand(N)
    z = F.linear(hidden, head) * multiplier
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    ref = F.cross_entropy(z, labels, reduction="none")
    (ref * w).sum().backward()
    ref_grad, hidden.grad = hidden.grad.clone(), None
    for chunk_rows in (1, 37, N):
        ce, pred = head_cross_entropy(hidden, head, labels, multiplier=multiplier, softcap=softcap,
                                      chunk_bytes=4 * V * chunk_rows)
        (ce * w).sum().backward()
        assert torch.allclose(ce, ref, rtol=1e-6, atol=1e-5)
        assert torch.equal(pred, z.argmax(-1))
        assert torch.allclose(hidden.grad, ref_grad, rtol=1e-5, atol=2e-5)
        hidden.grad = None
    with torch.no_grad():
        assert torch.allclose(head_cross_entropy(hidden, head, labels, multiplier=multiplier, softcap=softcap)[0],
                              ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("multiplier,softcap,top_k", [(1.0, None, 0), (0.5, None, 4), (2.0, 5.0, 0), (1.0, 30.0, 8)])
def test_logit_statistics_equal_the_eager_chunks(multiplier, softcap, top_k):
    """``logit_statistics`` (what ``train.compile`` compiles for the loss's chunks on a GPU; eager here) gives the
    eager chunks' CE, argmax, top-k candidates and, through the head, the same hidden-state gradient."""
    from draftsmith.drafter_loss import head_cross_entropy_topk, logit_statistics

    torch.manual_seed(1)
    N, H, V = 257, 24, 700
    hidden = torch.randn(N, H, requires_grad=True)
    head = torch.randn(V, H)
    labels, w = torch.randint(0, V, (N,)), torch.rand(N)
    ce, pred, val, idx = head_cross_entropy_topk(hidden, head, labels, top_k, multiplier=multiplier, softcap=softcap,
                                                 chunk_bytes=4 * V * 13)
    (ce * w).sum().backward()
    for need_grad in (True, False):
        c, p, g, v, i, _ = logit_statistics(F.linear(hidden.detach(), head), labels, multiplier, softcap, need_grad,
                                         top_k)
        assert torch.allclose(c, ce.detach(), rtol=1e-6, atol=1e-5) and torch.equal(p, pred)
        if need_grad:
            assert torch.allclose((w[:, None] * g) @ head, hidden.grad, rtol=1e-5, atol=2e-5)
        else:
            assert g is None
        if top_k:  # the same candidates and values per row (topk(sorted=False) may order them differently)
            assert torch.equal(i.sort(-1).values, idx.sort(-1).values)
            assert torch.allclose(v.sort(-1).values, val.sort(-1).values, rtol=1e-6, atol=1e-5)
        else:
            assert v is None and i is None
    # off a GPU fused=True is the eager chunks (the compiled function is CUDA's)
    ce2, pred2 = head_cross_entropy(hidden, head, labels, multiplier=multiplier, softcap=softcap, fused=True,
                                    chunk_bytes=4 * V * 13)
    assert torch.equal(ce2, head_cross_entropy(hidden, head, labels, multiplier=multiplier, softcap=softcap,
                                               chunk_bytes=4 * V * 13)[0])


def _soft_labels(N: int, V: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, k]`` distinct random ids per row and a random distribution over them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    return ids, torch.softmax(torch.randn(N, k, generator=g) * 2, -1)


@pytest.mark.parametrize("multiplier,softcap,top_k,k", [(1.0, None, 0, 5), (0.5, None, 4, 5), (2.0, 5.0, 0, 5),
                                                      (1.0, 30.0, 8, 5), (1.0, None, 4, 100), (2.0, 5.0, 0, 100)])
def test_soft_cross_entropy_equals_the_kl_through_the_full_logits(multiplier, softcap, top_k, k):
    """Soft labels (``train.labels: target_topk``): the chunked loss per row is ``-sum_j p_j log softmax(z)_{id_j}``
    over the full logits, its hidden-state gradient is the KL's (autograd through the full logits), the label's CE
    and argmax come beside it as the hard path's, the top-k candidates are the same; whatever the chunk size, and
    ``logit_statistics`` (the fused path, eager here) gives the same values and gradient, with k up to the unrolled
    comparisons' limit and above it (scattered)."""
    from draftsmith.drafter_loss import (
        SOFT_UNROLL_MAX_K,
        head_cross_entropy_topk,
        head_soft_cross_entropy,
        logit_statistics,
    )

    assert (k > SOFT_UNROLL_MAX_K) == (k == 100)
    torch.manual_seed(5)
    N, H, V = 211, 24, 600
    hidden = torch.randn(N, H, requires_grad=True)
    head = torch.randn(V, H)
    labels, w = torch.randint(0, V, (N,)), torch.rand(N)
    sid, sp = _soft_labels(N, V, k, seed=6)
    z = F.linear(hidden, head) * multiplier
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    target = torch.zeros(N, V).scatter_(1, sid, sp)
    ref = -(target * F.log_softmax(z, -1)).sum(-1)
    kl = F.kl_div(F.log_softmax(z, -1), target, reduction="none").sum(-1)
    assert torch.allclose(ref - kl, -(sp * sp.log()).sum(-1), atol=1e-4)  # = KL + the target's entropy
    (ref * w).sum().backward()
    ref_grad, hidden.grad = hidden.grad.clone(), None
    _, _, hard_val, hard_idx = head_cross_entropy_topk(hidden, head, labels, top_k, multiplier=multiplier,
                                                       softcap=softcap)
    for chunk_rows in (1, 37, N):
        soft_ce, label_ce, pred, val, idx = head_soft_cross_entropy(
            hidden, head, labels, sid, sp, top_k=top_k, multiplier=multiplier, softcap=softcap,
            chunk_bytes=4 * V * chunk_rows)
        (soft_ce * w).sum().backward()
        assert torch.allclose(soft_ce, ref, rtol=1e-6, atol=1e-5)
        assert torch.allclose(label_ce, F.cross_entropy(z, labels, reduction="none"), rtol=1e-6, atol=1e-5)
        assert not label_ce.requires_grad and torch.equal(pred, z.argmax(-1))
        assert torch.allclose(hidden.grad, ref_grad, rtol=1e-5, atol=2e-5)
        assert torch.equal(idx.sort(-1).values, hard_idx.sort(-1).values) and val.shape == hard_val.shape
        hidden.grad = None
    for need_grad in (True, False):
        c, p, g, _, _, lc = logit_statistics(F.linear(hidden.detach(), head), labels, multiplier, softcap, need_grad,
                                             top_k, sid, sp)
        assert torch.allclose(c, ref.detach(), rtol=1e-6, atol=1e-5) and torch.equal(p, pred)
        assert torch.allclose(lc, label_ce, rtol=1e-6, atol=1e-5)
        if need_grad:
            assert torch.allclose((w[:, None] * g) @ head, ref_grad, rtol=1e-5, atol=2e-5)
    with pytest.raises(ValueError, match="must both be"):
        head_soft_cross_entropy(hidden, head, labels, sid, sp[:, :2])


def test_a_one_hot_soft_label_is_the_hard_label():
    """The target's top-k with all its mass on the greedy token trains exactly as the hard label (loss, gradient)."""
    from draftsmith.drafter_loss import head_soft_cross_entropy, topk_soft_labels

    torch.manual_seed(7)
    N, H, V = 64, 16, 200
    hidden = torch.randn(N, H, requires_grad=True)
    head, labels = torch.randn(V, H), torch.randint(0, V, (N,))
    others = (labels[:, None] + torch.arange(1, 4)) % V
    ids = torch.cat([labels[:, None], others], 1)
    probs = topk_soft_labels(torch.tensor([0.0, -200.0, -200.0, -200.0]).expand(N, 4))
    soft_ce, label_ce, _, _, _ = head_soft_cross_entropy(hidden, head, labels, ids, probs, chunk_bytes=4 * V * 10)
    soft_ce.sum().backward()
    soft_grad, hidden.grad = hidden.grad.clone(), None
    ce, _ = head_cross_entropy(hidden, head, labels, chunk_bytes=4 * V * 10)
    ce.sum().backward()
    assert torch.allclose(soft_ce, ce, atol=1e-6) and torch.allclose(label_ce, ce.detach(), atol=1e-6)
    assert torch.allclose(soft_grad, hidden.grad, atol=1e-6)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_training_on_the_targets_topk_is_the_kl_to_the_slots_renormalised_distribution(target, variant):
    """``train.labels: target_topk``: slot k of the block anchored at a learns the target's top-k distribution
    stored at a + k - 1, renormalised; the loss is the slot-weighted CE against it over the full logits, while
    D-PACE's confidence, the per-slot CE and the hits stay the greedy token's (DFlash2: its selector too)."""
    from draftsmith.modeling import supervised_slots, supervised_soft_labels

    if variant == "dflash2":
        from draftsmith.modeling_dflash2 import DFlash2DraftModel

        cfg = build_drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2],
                                   mask_token_id=MASK, architecture="dflash2", conv_group_size=16, selector_rank=8,
                                   selector_top_k=4)
        torch.manual_seed(0)
        model = DFlash2DraftModel(cfg).eval()
        with torch.no_grad():  # a selector far from its near-zero start, so its loss is not ~log k everywhere
            for name, p in model.named_parameters():
                if "codebook" in name or "hidden_projection" in name:
                    p.copy_(0.5 * torch.randn_like(p))
    else:
        model = make_drafter(target)
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    hard = packed_batch(target_tokens=True, anchors=[2, 9, 24])
    R, S = hard.input_ids.shape
    V, k = Hd.shape[0], 3
    g = torch.Generator().manual_seed(8)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(S)])[None]
    ids[..., 0] = hard.target_token  # the greedy token first, as extraction stores it
    logprobs = torch.log_softmax(torch.randn(R, S, k, generator=g), -1) - 0.1  # ~10% of the mass past the top k
    soft = dataclasses.replace(hard, target_topk_ids=ids, target_topk_logprobs=logprobs)
    B = model.block_size
    labels, valid = block_targets(hard, B, use_target_tokens=True)
    index, _ = supervised_slots(valid)
    got_ids, got_p = supervised_soft_labels(soft, B, index)
    assert torch.equal(got_ids[:, 0], labels.view(-1)[index])  # position a + k - 1, as the hard target label
    assert torch.allclose(got_p.sum(-1), torch.ones(len(index)))
    assert supervised_soft_labels(hard, B, index) is None
    for dpace in (None, 0.5):
        with torch.no_grad():
            out_hard = model.training_forward(hard, E, Hd, gamma=2.0, dpace_alpha=dpace, use_target_tokens=True,
                                              backend="sdpa")
            out = model.training_forward(soft, E, Hd, gamma=2.0, dpace_alpha=dpace, use_target_tokens=True,
                                         backend="sdpa")
            h = model.block_hidden(soft, E, backend="sdpa")[0, :, 1:]
            logp = F.log_softmax(model.compute_logits(h, Hd).float(), -1).reshape(-1, V).index_select(0, index)
            soft_ce = -(logp.gather(1, got_ids) * got_p).sum(-1)
            label_ce = -logp.gather(1, labels.view(-1)[index][:, None])[:, 0]
            slot = index % (B - 1)
            if dpace is None:
                w = torch.exp(-slot.float() / 2.0)
                norm = w.sum()
            else:
                conf = torch.zeros(valid.numel()).index_copy_(0, index, torch.exp(-label_ce))
                w = dpace_weights(conf.view(valid.shape), valid, dpace).view(-1)[index]
                norm = valid.sum().float()
        assert out.weight_sum.item() == pytest.approx(norm.item(), rel=1e-6)
        assert out.ce_sum.sum().item() == pytest.approx(label_ce.sum().item(), rel=1e-5)  # the label's CE
        assert torch.equal(out.correct, out_hard.correct) and torch.equal(out.count, out_hard.count)
        main = (soft_ce * w).sum()
        if variant == "dflash":
            assert out.weighted_ce.item() == pytest.approx(main.item(), rel=1e-5)
            assert out.loss.item() == pytest.approx((main / norm).item(), rel=1e-5)
            assert out.loss.item() != pytest.approx(out_hard.loss.item(), rel=1e-3)
        else:  # the selector's loss is the hard-label run's
            sel = out_hard.weighted_ce - (label_ce * w).sum()
            assert out.weighted_ce.item() == pytest.approx((main + sel).item(), rel=1e-5)
            assert out.selector_loss.item() == pytest.approx(out_hard.selector_loss.item(), rel=1e-6)


@pytest.mark.parametrize("multiplier,softcap,dtype", [(1.0, None, torch.float32), (0.5, 3.0, torch.float32),
                                                     (1.0, None, torch.bfloat16)])
def test_candidate_logits_backpropagate_as_the_logits_through_the_head(multiplier, softcap, dtype):
    """``candidate_logits`` returns the top-k values the chunked head pass computed and gives the hidden states the
    gradient autograd gives through ``softcap(multiplier * h . W[ids])``, the injected gold token included."""
    from draftsmith.drafter_loss import candidate_logits, head_cross_entropy_topk

    torch.manual_seed(3)
    N, H, V, k = 97, 16, 300, 6
    head = torch.randn(V, H).to(dtype)
    hidden = torch.randn(N, H).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (N,))
    with torch.no_grad():
        _, _, val, ids = head_cross_entropy_topk(hidden, head, labels, k, multiplier=multiplier, softcap=softcap)
    ids = ids.clone()
    ids[:, 0] = labels  # an injected gold token: not among the top-k in most rows
    with torch.no_grad():
        val = val.clone()
        z = (hidden.float() @ head.float().T) * multiplier
        z = torch.tanh(z / softcap) * softcap if softcap else z
        val[:, 0] = z.gather(1, labels[:, None])[:, 0]
    g = torch.randn(N, k)
    out = candidate_logits(hidden, val, ids, head, multiplier=multiplier, softcap=softcap)
    assert torch.equal(out.detach(), val)
    (out * g).sum().backward()
    got = hidden.grad.float().clone()
    hidden.grad = None
    ref = (hidden.float()[:, None, :] * head.float()[ids]).sum(-1) * multiplier
    ref = torch.tanh(ref / softcap) * softcap if softcap else ref
    exact = dtype == torch.float32  # bf16: the head pass rounds its logits to bf16 before the float32 statistics
    assert torch.allclose(ref.detach(), val, rtol=1e-4 if exact else 1e-2, atol=1e-4 if exact else 5e-2)
    (ref * g).sum().backward()
    tol = 1e-5 if exact else 2e-2
    assert float((got - hidden.grad.float()).abs().max() / hidden.grad.float().abs().max()) < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_candidate_logits_on_the_gpu_backpropagate_as_the_logits_through_a_bf16_head(softcap):
    """``candidate_logits`` on CUDA (``embedding_bag`` over a bf16 head, as ``train.selector_stop_gradient:
    false`` runs it) on the fused head pass's top-k: the gradient autograd gives through ``W[ids]`` in float32,
    to bf16's precision."""
    from draftsmith.drafter_loss import candidate_logits, head_cross_entropy_topk

    torch.manual_seed(4)
    N, H, V, k = 3001, 64, 5003, 16
    head = (torch.randn(V, H) * H ** -0.5).cuda().bfloat16()
    hidden = (torch.randn(N, H) * 2).cuda().bfloat16().requires_grad_(True)
    labels = torch.randint(0, V, (N,)).cuda()
    with torch.no_grad():
        _, _, val, ids = head_cross_entropy_topk(hidden, head, labels, k, softcap=softcap, fused=True)
    g = torch.randn(N, k, device="cuda")
    (candidate_logits(hidden, val, ids, head, softcap=softcap) * g).sum().backward()
    got = hidden.grad.float().clone()
    hidden.grad = None
    ref = (hidden.float()[:, None, :] * head.float()[ids]).sum(-1)
    ref = torch.tanh(ref / softcap) * softcap if softcap else ref
    (ref * g).sum().backward()
    assert float((got - hidden.grad.float()).abs().max() / hidden.grad.float().abs().max()) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("multiplier,softcap,top_k", [(1.0, None, 0), (0.5, 30.0, 8)])
def test_compiled_fused_head_loss_matches_the_eager_chunks_on_the_gpu(multiplier, softcap, top_k, monkeypatch):
    """On a GPU ``fused=True`` runs the compiled ``logit_statistics`` (whole graph; the row count dynamic: chunks
    of two sizes, a one-row last chunk, another step's count; without gradient as the held-out metrics call it):
    bf16 logits, float32 statistics as the eager chunks compute them; and it did run (no fallback to the eager
    chunks, which would match them trivially)."""
    from draftsmith import drafter_loss
    from draftsmith.drafter_loss import head_cross_entropy_topk

    monkeypatch.setattr(drafter_loss, "FUSED_FAILED", None)

    torch.manual_seed(2)
    H, V = 64, 5003
    head = (torch.randn(V, H) * H ** -0.5).cuda().bfloat16()
    with torch.no_grad():
        x = torch.randn(700, H).cuda().bfloat16()
        y = torch.randint(0, V, (700,)).cuda()
        eager = head_cross_entropy_topk(x, head, y, top_k, multiplier=multiplier, softcap=softcap)
        fused = head_cross_entropy_topk(x, head, y, top_k, multiplier=multiplier, softcap=softcap, fused=True)
        assert torch.allclose(fused[0], eager[0], rtol=1e-5, atol=1e-4)
    for N in (3001, 1025, 1500):
        hidden = (torch.randn(N, H) * 2).cuda().bfloat16().requires_grad_(True)
        labels, w = torch.randint(0, V, (N,)).cuda(), torch.rand(N).cuda()
        got = []
        for fused in (False, True):
            hidden.grad = None
            ce, pred, val, idx = head_cross_entropy_topk(hidden, head, labels, top_k, multiplier=multiplier,
                                                         softcap=softcap, chunk_bytes=4 * V * 1024, fused=fused)
            (ce * w).sum().backward()
            got.append((ce.detach(), pred, val, idx, hidden.grad.float()))
        (ce0, p0, v0, i0, g0), (ce1, p1, v1, i1, g1) = got
        assert torch.allclose(ce1, ce0, rtol=1e-5, atol=1e-4)
        assert (p1 == p0).float().mean() > 0.999
        assert float((g1 - g0).abs().max() / g0.abs().max()) < 1e-2
        if top_k:
            assert torch.allclose(v1.sort(-1).values, v0.sort(-1).values, rtol=1e-5, atol=1e-4)
    assert drafter_loss.FUSED_FAILED is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("softcap,top_k,k", [(None, 0, 16), (30.0, 16, 16), (None, 16, 256), (30.0, 0, 256)])
def test_compiled_fused_soft_label_loss_matches_the_eager_chunks_on_the_gpu(softcap, top_k, k, monkeypatch):
    """Soft labels through the compiled ``logit_statistics`` (k = 16: comparisons per logit, unrolled; k = 256:
    scattered) give the eager chunks' soft CE, label CE and gradient on bf16 logits, the compiled path having run."""
    from draftsmith import drafter_loss
    from draftsmith.drafter_loss import head_soft_cross_entropy

    monkeypatch.setattr(drafter_loss, "FUSED_FAILED", None)

    torch.manual_seed(9)
    H, V, N = 64, 5003, 2100
    head = (torch.randn(V, H) * H ** -0.5).cuda().bfloat16()
    hidden = (torch.randn(N, H) * 2).cuda().bfloat16().requires_grad_(True)
    labels, w = torch.randint(0, V, (N,)).cuda(), torch.rand(N).cuda()
    sid, sp = (t.cuda() for t in _soft_labels(N, V, k, seed=10))
    got = []
    for fused in (False, True):
        hidden.grad = None
        soft_ce, label_ce, pred, _, _ = head_soft_cross_entropy(hidden, head, labels, sid, sp, top_k=top_k,
                                                                softcap=softcap, chunk_bytes=4 * V * 1024,
                                                                fused=fused)
        (soft_ce * w).sum().backward()
        got.append((soft_ce.detach(), label_ce, hidden.grad.float()))
    (s0, l0, g0), (s1, l1, g1) = got
    assert torch.allclose(s1, s0, rtol=1e-5, atol=1e-4) and torch.allclose(l1, l0, rtol=1e-5, atol=1e-4)
    assert float((g1 - g0).abs().max() / g0.abs().max()) < 1e-2
    assert drafter_loss.FUSED_FAILED is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_fused_loss_that_fails_to_compile_falls_back_to_the_eager_chunks(monkeypatch, caplog):
    """A compiler failure in the fused loss does not stop training: the call returns the eager chunks' result, a
    warning says why, and the process keeps the eager path."""
    from draftsmith import drafter_loss

    def broken():
        def stats(*args):
            raise RuntimeError("inductor: no kernel for this")
        return stats

    monkeypatch.setattr(drafter_loss, "_compiled_statistics", broken)
    monkeypatch.setattr(drafter_loss, "FUSED_FAILED", None)
    hidden = torch.randn(300, 32).cuda().bfloat16()
    head = torch.randn(1000, 32).cuda().bfloat16()
    labels = torch.randint(0, 1000, (300,)).cuda()
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        ce, pred = head_cross_entropy(hidden, head, labels, fused=True)
    eager = head_cross_entropy(hidden, head, labels)
    assert torch.equal(ce, eager[0]) and torch.equal(pred, eager[1])
    assert "RuntimeError: inductor: no kernel for this" in drafter_loss.FUSED_FAILED
    assert "uses the eager chunks" in caplog.text


def test_activation_checkpointing_gives_the_same_loss_and_gradients(target):
    model = make_drafter(target, **VARIANTS["sliding+full"]).train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch(target_tokens=True)
    grads = []
    for recompute in (False, True):
        model.activation_checkpointing = recompute
        model.zero_grad(set_to_none=True)
        out = model.training_forward(batch, E, Hd, gamma=3.5, use_target_tokens=True, backend="sdpa")
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for name, g in grads[0][1].items():
        assert torch.allclose(g, grads[1][1][name], rtol=1e-6, atol=1e-7), name
