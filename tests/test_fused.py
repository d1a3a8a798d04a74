"""fused: compiled norms / MLPs and fla's conv1d give the eager target's features.

The compile path runs on the CPU (inductor's C++ backend, needs a C compiler); the flash-linear-attention
conv1d path needs CUDA and is skipped without it.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import pytest
import torch

from draftsmith import fused
from draftsmith.target import decoder_layers, fla_available
from extraction import LAYER_IDS, LENGTHS, alone, run_shard, setup_run, stored_samples
from tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="torch.compile on the CPU needs a C compiler")


def hidden_states(model, x, mask=None):
    with torch.inference_mode():
        return model(x, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states


@needs_cc
@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "qwen3_next"])
def test_compiled_norms_and_mlps_give_the_eager_hidden_states(kind):
    """Every hidden state of padded batches of changing shapes equals eager within 1e-5 (float32); the
    compiled forwards are shared per class and removed on exit."""
    model = tiny_target(kind)
    torch.manual_seed(0)
    shapes = [(3, 37), (2, 51), (5, 13)]
    inputs = []
    for b, s in shapes:
        x = torch.randint(3, 500, (b, s))
        mask = torch.ones_like(x)
        mask[-1, s // 2:] = 0
        inputs.append((x, mask))
    ref = [hidden_states(model, x, m) for x, m in inputs]
    with fused.fused_target(model) as report:
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert report["enabled"] and report["compiled"][type(norms[0]).__name__] == len(norms)
        assert sum(report["compiled"].values()) >= 3 * len(decoder_layers(model))
        assert report["conv1d"] == []  # CPU: transformers' own conv1d stays
        assert norms[0].forward.__func__ is norms[1].forward.__func__  # one compiled function per class
        got = [hidden_states(model, x, m) for x, m in inputs]
    assert all("forward" not in m.__dict__ for m in model.modules())
    for (b, s), r, g in zip(shapes, ref, got):
        for layer, (a, c) in enumerate(zip(r, g)):
            diff = (a - c).abs().max().item()
            assert diff <= 1e-5, f"{kind} batch {b}x{s} hidden_states[{layer}]: max abs diff {diff}"


@needs_cc
def test_fused_extraction_equals_each_sample_alone(tmp_path):
    """extract.fuse: true on a hybrid target: stored features == the sample alone (eager), target tokens
    exact -- the golden contract of the extract stage holds with fusion."""
    from transformers import AutoModelForCausalLM

    model = tiny_target("qwen3_5")
    model.save_pretrained(tmp_path / "target")
    ids, plan = setup_run(tmp_path, tmp_path / "target")
    ref = {r: alone(model, ids[r]) for r in range(len(LENGTHS))}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    stats = {}
    man = run_shard(tmp_path, tmp_path / "target", model=loaded, fuse=True, run_stats=stats)
    # 2 per layer, the final norm, the q / k norms of the attention layer
    assert stats["fused"]["compiled"]["Qwen3_5RMSNorm"] == 2 * 4 + 1 + 2
    assert all("forward" not in m.__dict__ for m in loaded.modules())
    rows = 0
    for row, hidden, t in stored_samples(tmp_path / "features" / "shard-0", man):
        feats, argmax = ref[row]
        diff = (hidden - feats).abs().max().item()
        assert diff <= 1e-4, f"row {row}: max abs diff {diff}"
        assert torch.equal(t["target_token"], argmax), f"row {row}: target_token"
        rows += 1
    assert rows == len(LENGTHS) and man["layer_ids"] == LAYER_IDS


def test_a_compiler_failure_falls_back_to_eager(monkeypatch):
    """If inductor fails (no compiler, a bug), the extraction forward still runs, with eager results."""
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    torch._dynamo.reset()  # forget graphs compiled by earlier tests
    model = tiny_target("llama")
    x = torch.randint(3, 500, (2, 19))
    ref = hidden_states(model, x)
    with fused.fused_target(model):
        got = hidden_states(model, x)
    assert torch._dynamo.config.suppress_errors is False  # restored
    for a, c in zip(ref, got):
        assert torch.equal(a, c)


def test_fuse_setting():
    assert fused.resolve_fuse("auto", "cpu") is False
    assert fused.resolve_fuse("auto", "cuda") is True
    assert fused.resolve_fuse(False, "cuda") is False and fused.resolve_fuse(True, "cpu") is True
    with pytest.raises(ValueError, match="extract.fuse"):
        fused.resolve_fuse("yes", "cpu")
    with fused.fused_target(tiny_target("llama"), enabled=False) as report:
        assert report == {"enabled": False, "compiled": {}, "conv1d": []}


def test_fuse_is_validated_by_the_schema():
    import yaml

    from draftsmith.config import ConfigError, check_config

    schema = str(REPO / "schemas" / "config.schema.yaml")
    good = yaml.safe_load((REPO / "config.yaml").read_text())
    check_config(good, schema)
    assert good["extract"]["fuse"] == "auto"  # the documented default is filled in
    bad = yaml.safe_load((REPO / "config.yaml").read_text())
    bad["extract"]["fuse"] = "sometimes"
    with pytest.raises(ConfigError, match="extract.fuse"):
        check_config(bad, schema)


needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(),
                               reason="needs CUDA and flash-linear-attention")


@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_conv1d_equals_the_transformers_fallback(dtype):
    """fla's Triton conv1d on transformers' [B, D, T] transposed view == transformers' torch fallback."""
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    reference = mod.causal_conv1d_fn.__wrapped__  # the torch function behind the hub-kernel wrapper
    torch.manual_seed(0)
    for b, t, d in [(1, 1, 64), (3, 77, 320), (2, 1000, 1536)]:
        x = torch.randn(b, t, d, device="cuda", dtype=dtype).transpose(1, 2)  # as GatedDeltaNet passes it
        w = torch.randn(d, 4, device="cuda", dtype=dtype) / 2
        want = reference(x, w, None, activation="silu")
        got = fused.fla_conv1d_fn(x, w, None, activation="silu")
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        diff = (got.float() - want.float()).abs().max().item()
        assert diff <= tol * max(1.0, want.float().abs().max().item()), (b, t, d, diff)


@needs_fla
def test_fused_bf16_is_as_accurate_as_eager_bf16():
    """bf16 on the GPU: the fused forward's hidden states and greedy tokens are as close to a float32
    eager reference as eager bf16's are (the fused path changes rounding, not accuracy)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    n = 8
    cfg = Qwen3_5TextConfig(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=n,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
                            linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_conv_kernel_dim=4, pad_token_id=0, tie_word_embeddings=False,
                            layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                                         for i in range(n)])
    torch.manual_seed(0)
    with torch.device("cuda"):
        m32 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
        m16 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    m16.load_state_dict(m32.state_dict())
    x = torch.randint(3, cfg.vocab_size, (2, 1024), device="cuda")
    mask = torch.ones_like(x)
    mask[1, 600:] = 0
    real = mask.bool()

    def run(model):
        with torch.inference_mode():
            out = model(x, attention_mask=mask, output_hidden_states=True, use_cache=False)
        return [h.float()[real] for h in out.hidden_states], out.logits.argmax(-1)[real]

    ref, ref_tok = run(m32)
    eager, eager_tok = run(m16)
    with fused.fused_target(m16) as report:
        assert report["conv1d"] and report["compiled"]
        got, got_tok = run(m16)

    def rel(a, b):
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()

    err_eager = [rel(h, r) for h, r in zip(eager, ref)]
    err_fused = [rel(h, r) for h, r in zip(got, ref)]
    agree_eager = (eager_tok == ref_tok).float().mean().item()
    agree_fused = (got_tok == ref_tok).float().mean().item()
    print(f"relative RMS error vs float32 per hidden state: eager bf16 {[f'{e:.2e}' for e in err_eager]}, "
          f"fused bf16 {[f'{e:.2e}' for e in err_fused]}; greedy tokens equal to float32's: eager "
          f"{agree_eager:.4f}, fused {agree_fused:.4f}; fused vs eager {(got_tok == eager_tok).float().mean():.4f}")
    for i, (e, f) in enumerate(zip(err_eager, err_fused)):
        assert f <= 1.25 * e + 1e-4, f"hidden_states[{i}]: fused error {f:.3e} vs eager {e:.3e}"
    assert agree_fused >= agree_eager - 0.02
