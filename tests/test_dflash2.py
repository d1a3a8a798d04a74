"""DFlash2 drafters: the configuration class, the modules against the official z-lab ``dflash.model``
(``DFlash2DraftModel``, dflash==0.1.0) as the reference, export, training and decoding."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from draftsmith.drafter_config import (
    DFlash2Config,
    DFlashConfig,
    build_drafter_config,
    drafter_config_dict,
    drafter_config_from_dict,
)
from draftsmith.modeling import DFlashDraftModel, PackedBatch, block_targets
from draftsmith.modeling_dflash2 import DFlash2DraftModel
from tiny import tiny_config, tiny_target

MASK = 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------------------

def test_dflash2_config_extends_dflash_config_and_round_trips():
    cfg = build_drafter_config(tiny_config("qwen3"), num_layers=2, block_size=8, target_layer_ids=[1, 2],
                               mask_token_id=MASK, architecture="dflash2", conv_group_size=16, selector_rank=8,
                               selector_top_k=4)
    assert isinstance(cfg, DFlash2Config) and isinstance(cfg, DFlashConfig)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id, cfg.num_target_layers) == (8, [1, 2], MASK, 4)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 8, 4)
    d = drafter_config_dict(cfg)
    assert d["architectures"] == ["DFlash2DraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": MASK, "block_size": 8,
                                  "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                  "selector_top_k": 4}
    assert "selector_rank" not in d and "block_size" not in d  # the z-lab layout: inside dflash_config only
    back = drafter_config_from_dict(d)
    assert type(back) is DFlash2Config and drafter_config_dict(back) == d
    plain = drafter_config_dict(build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4,
                                                     target_layer_ids=[1], mask_token_id=MASK))
    assert plain["architectures"] == ["DFlashDraftModel"] and type(drafter_config_from_dict(plain)) is DFlashConfig
    assert set(plain["dflash_config"]) == {"target_layer_ids", "mask_token_id", "block_size"}


def test_dflash2_config_refuses_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="drafter.conv_group_size 48 does not divide hidden_size 64"):
        build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                             mask_token_id=MASK, architecture="dflash2", conv_group_size=48)
    with pytest.raises(ValueError, match="drafter.selector_top_k 600 must be in 1..512"):
        build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                             mask_token_id=MASK, architecture="dflash2", conv_group_size=16, selector_top_k=600)
    with pytest.raises(ValueError, match="drafter.architecture 'dflash3'"):
        build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                             mask_token_id=MASK, architecture="dflash3")


def test_drafter_settings_default_to_dflash():
    from draftsmith.train.settings import TrainSettings

    s = TrainSettings.from_config({})
    assert s.drafter.architecture == "dflash"
    assert (s.drafter.conv_kernel_size, s.drafter.conv_group_size) == (2, 64)
    assert (s.drafter.selector_rank, s.drafter.selector_top_k) == (256, 16)


# ------------------------------------------------------------------------------------------------------------
# modeling: the official DFlash2DraftModel as the reference
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", initializer_range=0.1)


def make_drafter2(target, *, block_size=4, seed=0, num_layers=2, top_k=5):
    """A random DFlash2 drafter for ``target`` whose convolutions and selector are far from their (identity /
    near-zero) initialisation, so that every new weight matters in comparisons."""
    cfg = build_drafter_config(target.config, num_layers=num_layers, block_size=block_size, target_layer_ids=[1, 2],
                               mask_token_id=MASK, architecture="dflash2", conv_group_size=16, selector_rank=8,
                               selector_top_k=top_k)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif "_conv." in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "codebook" in name:
                p.copy_(torch.randn_like(p))
            elif "hidden_projection" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return model


def _block(target, anchors, width):
    E = target.get_input_embeddings().weight.detach()
    ids = torch.tensor([[a] + [MASK] * (width - 1) for a in anchors])
    return F.embedding(ids, E)


def test_official_dflash2_loads_our_folder_and_proposes_the_same_tokens(official, target, tmp_path):
    ours = make_drafter2(target)
    ours.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 5
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= names
    ref = official.DFlash2DraftModel.from_pretrained(str(tmp_path)).eval()
    ref_state = ref.state_dict()
    for k, v in ours.state_dict().items():  # every weight loaded (the codebooks under nn.Embedding's name)
        assert torch.equal(ref_state.get(k, ref_state.get(k + ".weight")), v), k
    anchors = [17, 230, 401]
    noise = _block(target, anchors, 4)
    ctx = torch.randn(3, 9, 128, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(13).expand(3, -1)
    anchor_ids = torch.tensor(anchors)
    with torch.no_grad():
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)[:, 1:]
        b = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)[:, 1:]
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
        greedy = ours.propose(a, anchor_ids, target.lm_head, 0.0)
        ref_greedy = ref.propose(b, anchor_ids, target.lm_head, 0.0)
        assert greedy[0].tolist() == ref_greedy[0].tolist() and greedy[2] is None
        assert torch.equal(greedy[1], ref_greedy[1])
        # the selector matters here: its path is not the per-position argmax of the logits
        assert greedy[0].tolist() != ours.compute_logits(a, target.lm_head).argmax(-1).tolist()
        for seed in range(3):
            torch.manual_seed(seed)
            sampled = ours.propose(a, anchor_ids, target.lm_head, 0.8)
            torch.manual_seed(seed)
            ref_sampled = ref.propose(b, anchor_ids, target.lm_head, 0.8)
            assert sampled[0].tolist() == ref_sampled[0].tolist(), seed
            assert torch.allclose(sampled[2], ref_sampled[2], atol=1e-6)


def test_official_dflash2_generate_with_our_drafter_is_lossless(official, target, tmp_path, monkeypatch):
    monkeypatch.setattr(official, "_cuda_time", time.perf_counter)  # timing only; it assumes CUDA
    make_drafter2(target, block_size=5).save_pretrained(tmp_path)
    drafter = official.DFlash2DraftModel.from_pretrained(str(tmp_path)).eval()
    prompt = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    out = official.dflash_generate(drafter, target, prompt, 30, None, return_stats=True)
    ids = prompt
    with torch.no_grad():
        for _ in range(30):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.output_ids.tolist() == ids.tolist()
    assert sum(out.acceptance_lengths) == 29


def test_our_dflash2_loader_round_trips_and_refuses_the_other_architecture(target, tmp_path):
    ours = make_drafter2(target)
    ours.save_pretrained(tmp_path / "two")
    back = DFlash2DraftModel.from_pretrained(tmp_path / "two")
    assert type(back.config) is DFlash2Config
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with pytest.raises(ValueError, match=r"DFlash2DraftModel.*not a DFlashDraftModel"):
        DFlashDraftModel.from_pretrained(tmp_path / "two")


def test_new_modules_start_as_identity_so_dflash2_starts_as_its_dflash_backbone(target):
    cfg = build_drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2],
                               mask_token_id=MASK, architecture="dflash2", conv_group_size=16)
    two = DFlash2DraftModel(cfg).eval()
    one = DFlashDraftModel(build_drafter_config(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 2],
                                                mask_token_id=MASK)).eval()
    one.load_state_dict({k: v for k, v in two.state_dict().items() if k in one.state_dict()})
    noise = _block(target, [40, 41], 4)
    ctx = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10).expand(2, -1)
    with torch.no_grad():
        assert torch.equal(two(position_ids=pos, noise_embedding=noise, target_hidden=ctx),
                           one(position_ids=pos, noise_embedding=noise, target_hidden=ctx))


def packed_batch(seed=0, lengths=(11, 15, 9), anchors=(2, 9, 12, 20, 24, 27, 33)):
    """A packed row of three documents with random features and all positions supervised."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(5, 500, (1, S), generator=g)
    anchors = torch.tensor([list(anchors)])
    return PackedBatch(torch.randn(1, S, 128, generator=g), ids, torch.ones(1, S, dtype=torch.bool), docs, pos,
                       anchors, torch.ones_like(anchors, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_training_blocks_equal_the_decode_step(target, backend):
    """Each training block's hidden states (convolutions inside the block only) == the decode forward on
    [doc context < a, block]."""
    model = make_drafter2(target)
    E = target.get_input_embeddings().weight.detach()
    batch = packed_batch()
    with torch.no_grad():
        h = model.block_hidden(batch, E, backend=backend)[0]
        for j, a in enumerate(batch.anchors[0].tolist()):
            doc = batch.doc_ids[0, a]
            start = int((batch.doc_ids[0] == doc).nonzero()[0])
            noise = _block(target, [batch.input_ids[0, a].item()], 4)
            ref = model(position_ids=torch.arange(a - start + 4)[None], noise_embedding=noise,
                        target_hidden=batch.features[:, start:a])
            assert torch.allclose(h[j], ref[0], atol=2e-5, rtol=0), (j, (h[j] - ref[0]).abs().max())


# ------------------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------------------

def test_export_writes_dflash2_that_the_official_class_loads_and_drafts_alike(official, target, tmp_path):
    """A DFlash2 drafter built by draftsmith, exported (float32) and loaded with the official DFlash2DraftModel:
    both propose the same draft tokens on the same context, greedy and sampled."""
    from draftsmith.export import ExportSettings, export_drafter

    target.save_pretrained(tmp_path / "target")
    make_drafter2(target, block_size=6).save_pretrained(tmp_path / "trained")
    summary = export_drafter(tmp_path / "trained", tmp_path / "target", tmp_path / "final",
                             ExportSettings.from_config(drafter={"export_dtype": "float32"}))
    assert summary["architecture"] == "DFlash2DraftModel" and summary["readback_max_abs_diff"] == 0.0
    cfg = json.loads((tmp_path / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": MASK, "block_size": 6,
                                    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                    "selector_top_k": 5}
    ours = DFlash2DraftModel.from_pretrained(tmp_path / "trained", dtype=torch.float32)
    ref = official.DFlash2DraftModel.from_pretrained(str(tmp_path / "final"), dtype=torch.float32).eval()
    assert ref.block_size == 6 and ref.candidate_selector.top_k == 5
    prompt = torch.randint(5, 500, (1, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        ctx = torch.cat([out.hidden_states[i + 1] for i in (1, 2)], -1)
        anchor = out.logits[:, -1].argmax(-1)
        noise = _block(target, anchor.tolist(), 6)
        pos = torch.arange(21)[None]
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)[:, 1:]
        b = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx)[:, 1:]
        assert (ours.propose(a, anchor, target.lm_head, 0.0)[0].tolist()
                == ref.propose(b, anchor, target.lm_head, 0.0)[0].tolist())
        torch.manual_seed(7)
        mine = ours.propose(a, anchor, target.lm_head, 1.0)[0]
        torch.manual_seed(7)
        assert mine.tolist() == ref.propose(b, anchor, target.lm_head, 1.0)[0].tolist()


# ------------------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------------------

def _grads(model, out):
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_selector_loss_trains_the_selector_only_and_the_backbone_sees_the_dflash_loss(target):
    """Stop-gradient: the backbone's and convolutions' gradients are those of DFlash's loss whatever the selector
    weight; the selector's come from its own loss only."""
    model = make_drafter2(target)
    model.train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch()
    model.selector_loss_weight = 0.0
    out0 = model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa")
    g0 = _grads(model, out0)
    model.selector_loss_weight = 1.0
    out1 = model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa")
    g1 = _grads(model, out1)
    assert float(out1.loss.detach()) == pytest.approx(float(out0.loss.detach()) + float(out1.selector_loss), rel=1e-6)
    selector = [n for n in g1 if n.startswith("candidate_selector.")]
    assert len(selector) == 3
    for n in g1:
        if n in selector:
            assert g0[n] is None or not g0[n].any(), n
            assert g1[n] is not None and g1[n].abs().sum() > 0, n
        else:
            assert torch.equal(g0[n], g1[n]), n
    assert any("_conv.kernel_projection" in n and g1[n].abs().sum() > 0 for n in g1)  # the convolutions learn


def test_selector_gradient_reaches_the_backbone_as_autograd_through_the_full_head(target, monkeypatch):
    """``selector_stop_gradient = False`` (speculators' DFlash2): the same loss value, the selector's own gradients
    unchanged, the backbone's now moved by the selector loss too, and equal to autograd through the candidates'
    logits recomputed from ``W[ids]`` (what :func:`candidate_logits` stands for without gathering ``[N, k, H]``)."""
    import draftsmith.modeling_dflash2 as m2

    model = make_drafter2(target)
    model.train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch()
    out_sg = model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa")
    g_sg = _grads(model, out_sg)
    model.selector_stop_gradient = False
    out = model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa")
    g = _grads(model, out)
    assert torch.equal(out.loss.detach(), out_sg.loss.detach())

    def autograd_candidates(h, values, ids, head, *, multiplier=1.0, softcap=None):
        z = (h[:, None, :].float() * head.float()[ids]).sum(-1) * multiplier
        assert torch.allclose(z.detach(), values, rtol=1e-5, atol=1e-5)
        return z

    monkeypatch.setattr(m2, "candidate_logits", autograd_candidates)
    g_ref = _grads(model, model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa"))
    backbone = [n for n in g if not n.startswith("candidate_selector.")]
    for n in g:
        assert float((g[n] - g_ref[n]).abs().max()) <= 1e-4 * float(g_ref[n].abs().max()) + 1e-7, n
        if n.startswith("candidate_selector."):
            assert torch.allclose(g[n], g_sg[n], rtol=1e-5, atol=1e-7), n
    moved = [n for n in backbone if not torch.allclose(g[n], g_sg[n], rtol=1e-3, atol=1e-6)]
    assert len(moved) > len(backbone) // 2, moved


def test_selector_loss_with_every_token_a_candidate_and_no_pair_term_is_the_cross_entropy(target):
    """top_k = V (nothing injected) and zero codebooks: S = the logits, so the selector's CE per slot is DFlash's
    CE, its accuracy the argmax accuracy, and every label is recalled."""
    model = make_drafter2(target, top_k=512)
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.zero_()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    with torch.no_grad():
        out = model.training_forward(packed_batch(), E, Hd, gamma=3.5, backend="sdpa")
    assert torch.allclose(out.selector_ce_sum, out.ce_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.selector_correct, out.correct) and torch.equal(out.candidate_recall, out.count)
    # a small top-k misses labels: they are injected into the loss (finite), not counted as recalled
    small = make_drafter2(target, top_k=2)
    with torch.no_grad():
        out2 = small.training_forward(packed_batch(), E, Hd, gamma=3.5, backend="sdpa")
    assert (out2.candidate_recall < out2.count).any() and torch.isfinite(out2.selector_loss)
    assert (out2.selector_correct <= out2.candidate_recall).all()


# ------------------------------------------------------------------------------------------------------------
# decoding (draftsmith.evaluate)
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_greedy_dflash2_decoding_is_lossless_and_steps_as_the_official_loop(official, kind, tmp_path, monkeypatch):
    """evaluate's speculative loop with a DFlash2 drafter: the target's own greedy tokens (a hybrid Gated
    DeltaNet target included); on Qwen3 the same per-step acceptance lengths as the official ``dflash_generate``
    with the official DFlash2DraftModel loaded from our folder."""
    from draftsmith.evaluate import DFlashProposer, speculative_generate, target_generate

    monkeypatch.setattr(official, "_cuda_time", time.perf_counter)
    tgt = tiny_target(kind, initializer_range=0.1)
    drafter = make_drafter2(tgt, block_size=5)
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    ref = target_generate(tgt, ids, max_new_tokens=30)
    ours = speculative_generate(tgt, DFlashProposer(drafter, tgt), ids, max_new_tokens=30)
    assert ours.tokens == ref.tokens and sum(ours.committed) + 1 == len(ours.tokens)
    assert max(ours.proposed) == 4  # B - 1 drafts a step (fewer only near the token budget)
    if kind == "qwen3":
        drafter.save_pretrained(tmp_path)
        theirs = official.dflash_generate(official.DFlash2DraftModel.from_pretrained(str(tmp_path)).eval(), tgt, ids,
                                          30, None, return_stats=True)
        assert ours.committed == theirs.acceptance_lengths


def test_sampled_dflash2_drafts_the_selector_path_with_its_candidate_distribution(target):
    """Sampling: the proposer's drafts are the selector's sampled path (the evaluation's generator), and its draft
    distribution is the selector's over the top-k candidates, zero elsewhere (what rejection sampling needs)."""
    from draftsmith.evaluate import DFlashProposer
    from draftsmith.evaluate.sampling import SamplingConfig

    drafter = make_drafter2(target)
    proposer = DFlashProposer(drafter, target)
    ids = torch.randint(5, 500, (20,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    ctx = torch.cat([out.hidden_states[i + 1] for i in (1, 2)], -1)[:, :19]
    proposer.reset(ids[None], ctx)
    with torch.no_grad():
        drafts, probs = proposer.propose(ids, 19, 3, SamplingConfig(0.7), torch.Generator().manual_seed(11))
        hidden = drafter(position_ids=torch.arange(23)[None], noise_embedding=_block(target, [int(ids[19])], 4),
                         target_hidden=ctx)[:, 1:]
        path, candidates, q = drafter.propose(hidden, ids[19:20], target.lm_head, 0.7,
                                              torch.Generator().manual_seed(11))
    assert drafts.tolist() == path[0].tolist()
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and ((probs > 0).sum(-1) <= 5).all()
    assert torch.equal(probs.gather(-1, candidates[0]), q[0])
    assert (probs.gather(-1, drafts[:, None]) > 0).all()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_static_dflash2_drafter_drafts_what_the_dynamic_cache_drafts(target, temperature):
    """The static drafter (fixed K/V buffers; CUDA graphs on a GPU) with a DFlash2 drafter: at every step, whatever
    number of positions was committed in between, the same selector path and, sampling, the same candidate
    distribution as the dynamic cache, over a prompt longer than two blocks, full and shorter blocks."""
    from draftsmith.evaluate import DFlashProposer
    from draftsmith.evaluate.sampling import SamplingConfig
    from draftsmith.evaluate.static import StaticDrafter, StaticTarget

    drafter = make_drafter2(target, block_size=5)
    assert StaticDrafter.supported(drafter) == (True, "")
    ids = torch.randint(5, 500, (1, 13), generator=torch.Generator().manual_seed(4))
    full = torch.cat([ids[0], torch.randint(5, 500, (30,), generator=torch.Generator().manual_seed(5))])
    _, feats = StaticTarget(target, full.numel() + 1, layer_ids=[1, 2], cuda_graphs=False).prefill(full[None])
    dyn, sta = DFlashProposer(drafter, target), DFlashProposer(drafter, target)
    assert sta.use_static(64, cuda_graphs=False)
    start = ids.shape[1]
    for proposer in (dyn, sta):
        proposer.reset(ids, feats[:, :start])
    sampling = SamplingConfig(temperature)
    for committed, drafts in ((1, 4), (3, 4), (5, 4), (2, 2), (4, 3), (1, 4)):
        got = {}
        for name, proposer in (("dynamic", dyn), ("static", sta)):
            with torch.inference_mode():
                got[name] = proposer.propose(full, start, drafts, sampling, torch.Generator().manual_seed(start))
        assert torch.equal(got["dynamic"][0], got["static"][0]), (temperature, start)
        assert got["static"][0].shape == (drafts,)
        if temperature:
            torch.testing.assert_close(got["static"][1], got["dynamic"][1], rtol=0, atol=1e-5)
        else:
            assert got["static"][1] is None and got["dynamic"][1] is None
        start += committed
        for proposer in (dyn, sta):
            proposer.commit(feats[:, start - committed:start])


def test_static_greedy_path_is_the_selectors_path_of_the_step(target):
    """StaticDrafter.greedy_path (the path drafted inside the step, as its CUDA graph captures it) equals the
    candidate selector run on the same step's hidden states and logits; a DFlash drafter has no path to draft."""
    from draftsmith.evaluate.static import StaticDrafter

    drafter = make_drafter2(target, block_size=5)
    embed, head = target.get_input_embeddings().weight.detach(), target.lm_head
    static = StaticDrafter(drafter, embed, head, 64, cuda_graphs=False)
    context = torch.randn(1, 7, 2 * drafter.config.hidden_size, generator=torch.Generator().manual_seed(3))
    anchor = torch.tensor([42])
    for width in (5, 3):
        hidden, logits = (t.clone() for t in static.step(context, anchor, 7, width))
        want = drafter.candidate_selector.select(hidden, logits[None], anchor, 0.0)[0]
        path = static.greedy_path(context, anchor, 7, width)
        assert path.shape == (1, width - 1) and torch.equal(path, want)
    with pytest.raises(ValueError, match="no candidate selector"):
        cfg = build_drafter_config(target.config, num_layers=1, block_size=5, target_layer_ids=[1, 2],
                                   mask_token_id=MASK)
        StaticDrafter(DFlashDraftModel(cfg).eval(), embed, head, 64, cuda_graphs=False).greedy_path(
            context, anchor, 7, 5)


def test_static_dflash2_decoding_is_lossless_and_steps_as_the_dynamic_path():
    """End to end on the static target: greedy DFlash2 decoding with the static drafter commits the same tokens in
    the same steps as with the dynamic-cache drafter, and equals target-only decoding."""
    from draftsmith.evaluate import DFlashProposer, speculative_generate, target_generate
    from draftsmith.evaluate.static import StaticTarget

    tgt = tiny_target("qwen3", initializer_range=0.1)
    static = StaticTarget(tgt, 16 + 30 + 5 + 1, layer_ids=[1, 2], cuda_graphs=False, verify_width=5)
    for seed in (1, 2):
        ids = torch.randint(5, 500, (1, 16), generator=torch.Generator().manual_seed(seed))
        ref = target_generate(tgt, ids, max_new_tokens=30)
        dyn = speculative_generate(tgt, DFlashProposer(make_drafter2(tgt, block_size=5, seed=seed), tgt), ids,
                                   max_new_tokens=30, static=static)
        fast = DFlashProposer(make_drafter2(tgt, block_size=5, seed=seed), tgt)
        assert fast.use_static(static.max_length, cuda_graphs=False)
        sta = speculative_generate(tgt, fast, ids, max_new_tokens=30, static=static)
        assert sta.tokens == dyn.tokens == ref.tokens
        assert (sta.committed, sta.accepted, sta.proposed) == (dyn.committed, dyn.accepted, dyn.proposed)


def test_dflash2_training_flops_match_the_flop_counter(target):
    """training_flops (the trainer's MFU) counts a DFlash2 step's matmuls as torch's FlopCounterMode does: the
    backbone's, the convolutions' kernel projections and the selector's hidden projection (mm) and its bilinear
    scores of the top-k (bmm; the attention's is SDPA, counted apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    from draftsmith.flops import training_flops

    model = make_drafter2(target).train()
    E, Hd = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    batch = packed_batch()
    _, valid = block_targets(batch, 4, False)
    want = training_flops(model.config, ctx_tokens=batch.input_ids.shape[1], block_tokens=batch.anchors.shape[1] * 4,
                          head_tokens=int(valid.sum()), attended_pairs=0)
    with FlopCounterMode(display=False) as counter:
        out = model.training_forward(batch, E, Hd, gamma=3.5, backend="sdpa")
        out.loss.backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    mm = sum(v for k, v in counts.items() if k.endswith(".mm") or k.endswith(".addmm"))
    bmm = sum(v for k, v in counts.items() if k.endswith(".bmm"))
    assert want["selector"] > 0
    assert want["total"] == mm + bmm, counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_dflash2_drafter_with_cuda_graphs_decodes_as_the_dynamic_path():
    """On a GPU (float32, so no near ties): DFlash2 decoding with the static drafter's steps replayed as CUDA graphs
    (the selector's greedy path inside them) commits the same tokens in the same steps as the dynamic-cache
    drafter, equal to target-only decoding, and no width fell back to eager drafting."""
    from draftsmith.evaluate import DFlashProposer, speculative_generate, target_generate
    from draftsmith.evaluate.static import StaticTarget

    tgt = tiny_target("qwen3", initializer_range=0.1).cuda()
    static = StaticTarget(tgt, 16 + 30 + 5 + 1, layer_ids=[1, 2], cuda_graphs=True, verify_width=5)
    for seed in (1, 2):
        ids = torch.randint(5, 500, (1, 16), generator=torch.Generator().manual_seed(seed)).cuda()
        ref = target_generate(tgt, ids, max_new_tokens=30)
        drafter = make_drafter2(tgt, block_size=5, seed=seed).cuda()
        dyn = speculative_generate(tgt, DFlashProposer(drafter, tgt), ids, max_new_tokens=30, static=static)
        fast = DFlashProposer(drafter, tgt)
        assert fast.use_static(static.max_length, cuda_graphs=True)
        sta = speculative_generate(tgt, fast, ids, max_new_tokens=30, static=static)
        assert sta.tokens == dyn.tokens == ref.tokens
        assert (sta.committed, sta.accepted, sta.proposed) == (dyn.committed, dyn.accepted, dyn.proposed)
        assert fast.static.graph_failures == {} and fast.static._graphs, fast.static.graph_failures
        assert any(path for _, path in fast.static._graphs)  # the selector's path was drafted in a graph
