"""disk: the drafter's parameter count behind the reserve (against the model itself), the reserve, and what fits
(the smallest stream.slices, float8 storage) -- draftsmith/disk.py."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from transformers import Qwen3_5Config

from draftsmith import disk
from draftsmith.drafter_config import build_drafter_config
from draftsmith.modeling import DFlashDraftModel
from draftsmith.modeling_dflash2 import DFlash2DraftModel
from tiny import tiny_config

# (target kind, target overrides, drafter keys, tapped layers)
CASES = {
    "dense llama, the target's sizes": ("llama", {}, {"num_layers": 1}, [2]),
    "qwen3_5 hybrid, the target's sizes": ("qwen3_5", {}, {"num_layers": 2}, [0, 1, 3]),
    "explicit heads, head dim and MLP width": (
        "llama", {"num_key_value_heads": 4},
        {"num_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 12,
         "intermediate_size": 96}, [0, 1, 2, 3]),
    "qwen3 target with its own head dim, KV heads from the target": (
        "qwen3", {}, {"num_layers": 2, "num_attention_heads": 2, "intermediate_size": 40}, [1, 3]),
    "DFlash2: convolutions and the candidate selector": (
        "qwen3", {}, {"num_layers": 2, "architecture": "dflash2", "conv_kernel_size": 3, "conv_group_size": 16,
                      "selector_rank": 8}, [1, 3]),
    "DFlash2 on a hybrid target, default kernel": (
        "qwen3_5", {}, {"num_layers": 1, "architecture": "dflash2", "conv_group_size": 8, "selector_rank": 4}, [0, 3]),
}


def _model_parameters(target_config, keys: dict, taps: list[int]) -> int:
    config = build_drafter_config(target_config, block_size=16, target_layer_ids=taps, mask_token_id=0, **keys)
    model_class = DFlash2DraftModel if keys.get("architecture") == "dflash2" else DFlashDraftModel
    return sum(p.numel() for p in model_class(config).parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_equals_the_models(case, tmp_path):
    kind, overrides, keys, taps = CASES[case]
    target_config = tiny_config(kind, **overrides)
    size = disk.DrafterSize(num_taps=len(taps), **keys)
    want = _model_parameters(target_config, keys, taps)
    assert disk.drafter_parameters(target_config, size) == want
    target_config.save_pretrained(tmp_path)  # config.json keeps only what differs from the class defaults
    assert disk.drafter_parameters(tmp_path, size) == want
    assert disk.drafter_parameters(tmp_path / "config.json", size) == want


def test_parameter_count_of_a_multimodal_target_reads_its_text_config(tmp_path):
    text = tiny_config("qwen3_5").to_dict()
    Qwen3_5Config(text_config=text).save_pretrained(tmp_path)
    size = disk.DrafterSize(num_layers=2, num_taps=3)
    assert disk.drafter_parameters(tmp_path, size) == _model_parameters(tiny_config("qwen3_5"), {"num_layers": 2},
                                                                        [0, 1, 3])


def test_reserve_counts_checkpoints_trained_and_final_or_takes_reserve_gb(tmp_path):
    target_config = tiny_config("llama")
    size = disk.DrafterSize(num_layers=2, num_taps=3, export_dtype="bfloat16")
    p = disk.drafter_parameters(target_config, size)
    checkpoint = 12 * p + disk.CHECKPOINT_EXTRA_BYTES
    assert disk.reserve_bytes(target_config, size, keep_checkpoints=2) == (
        4 * checkpoint + 4 * p + 2 * p + disk.RESERVE_SLACK_BYTES)
    f32 = disk.DrafterSize(num_layers=2, num_taps=3, export_dtype="float32")
    assert (disk.reserve_bytes(target_config, f32, keep_checkpoints=3)
            - disk.reserve_bytes(target_config, size, keep_checkpoints=2)) == checkpoint + 2 * p
    assert disk.reserve_bytes("not read when reserve_gb is given", size, keep_checkpoints=2, reserve_gb=1.5) == 1.5e9
    with pytest.raises(ValueError, match="export_dtype 'int8'"):
        disk.reserve_bytes(target_config, disk.DrafterSize(1, 1, export_dtype="int8"), keep_checkpoints=1)


def test_sizes_from_a_stages_drafter_settings():
    from draftsmith.extract import ExtractPlanSettings

    drafter = ExtractPlanSettings.from_config({"drafter": {"num_layers": 5, "num_attention_heads": 32,
                                                           "export_dtype": "float16"}}).drafter
    assert disk.DrafterSize.from_settings(drafter, 5) == disk.DrafterSize(
        num_layers=5, num_taps=5, num_attention_heads=32, export_dtype="float16")


def test_bytes_per_token_of_a_27b_hybrid_target():
    assert disk.bytes_per_token(5, 5120, "bfloat16", True) == 51_209
    assert disk.bytes_per_token(5, 5120, "float8_e4m3fn", True) == 25_629
    with pytest.raises(ValueError, match="extract.storage_dtype 'float16' not in"):
        disk.bytes_per_token(5, 5120, "float16", True)


def test_the_target_topk_adds_six_bytes_a_token_per_k():
    """extract.store_target_topk = k stores an int32 id and a float16 log-prob per token and k: 6k bytes a token, in
    every projection (the features, fp8's advice, a plan's shards); k = 0 projects what it did before."""
    assert disk.bytes_per_token(5, 5120, "bfloat16", True, target_topk=8) == 51_209 + 48
    assert disk.bytes_per_token(5, 5120, "float8_e4m3fn", True, target_topk=1) == 25_629 + 6
    assert disk.bytes_per_token(5, 5120, "bfloat16", True, target_topk=0) == 51_209
    assert (disk.projected_bytes(1000, 10, 5, 5120, "bfloat16", True, 2, target_topk=16)
            == disk.projected_bytes(1000, 10, 5, 5120, "bfloat16", True, 2) + 1000 * 96)
    fit, plain = _fit(target_topk=16, free_bytes=10**12), _fit(free_bytes=10**12)
    assert fit.bytes_per_token == plain.bytes_per_token + 96
    assert fit.fp8_bytes_per_token == plain.fp8_bytes_per_token + 96
    assert fit.feature_bytes == plain.feature_bytes + 96 * 1_000_000
    assert fit.fp8_feature_bytes == plain.fp8_feature_bytes + 96 * 1_000_000


def _fit(**kw):
    base = dict(num_tokens=1_000_000, num_samples=5_000, num_layers=5, hidden_size=5120, storage_dtype="bfloat16",
                target_token=True, reserve_bytes=3 * 10**9, headroom=1.05)
    return disk.disk_fit(**{**base, **kw})


def test_smallest_slices_is_the_smallest_count_whose_slices_fit():
    features = disk.projected_bytes(1_000_000, 5_000, 5, 5120, "bfloat16", True)
    for free in (4 * 10**9, 9 * 10**9, 20 * 10**9, 60 * 10**9):
        for on_disk in (1, 2, 3):
            fit = _fit(free_bytes=free, slices_on_disk=on_disk)
            fits = [s for s in range(1, 5_001)
                    if math.ceil(-(-features // s) * min(on_disk, s) * 1.05) + 3 * 10**9 <= free]
            assert fit.min_slices == (fits[0] if fits else None), (free, on_disk)
            if fit.min_slices:
                assert _fit(free_bytes=free, slices_on_disk=on_disk, slices=fit.min_slices).fits
                assert fit.min_slices == 1 or not _fit(free_bytes=free, slices_on_disk=on_disk,
                                                       slices=fit.min_slices - 1).fits


def test_message_names_the_smallest_slices_and_fp8():
    fit = _fit(free_bytes=20 * 10**9, where="/scratch/results")
    assert not fit.fits and fit.slices == 1 and fit.min_slices == 4 and fit.fp8_min_slices == 2
    msg = fit.message()
    assert "51209 bytes a token in bfloat16" in msg and "under /scratch/results: does not fit" in msg
    assert "does not fit. The smallest stream.slices that fits is 4 with stream.slices_on_disk 1." in msg
    assert "With extract.storage_dtype: float8_e4m3fn (25629 bytes a token" in msg
    assert msg.endswith("the smallest stream.slices that fits is 2 with stream.slices_on_disk 1.")
    with pytest.raises(disk.DiskSpaceError, match="does not fit"):
        fit.check()
    sliced = _fit(free_bytes=20 * 10**9, slices=4)
    assert sliced.fits and sliced.check() is sliced and "1 of stream.slices 4 on disk at once" in sliced.message()
    assert "(offline)" in _fit(free_bytes=80 * 10**9, storage_dtype="float8_e4m3fn").message()
    assert "The reserve alone exceeds the free disk" in _fit(free_bytes=2 * 10**9).message()
    kept = _fit(free_bytes=20 * 10**9, slices=4, kept_bytes=5 * 10**9)
    assert not kept.fits and kept.min_slices == 5 and "5.000 GB of kept features" in kept.message()


def test_importing_disk_imports_neither_torch_nor_transformers():
    code = "import sys, draftsmith.disk; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
