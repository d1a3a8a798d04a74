"""DFlash2 drafters: the configuration class, the modules against the official z-lab ``dflash.model``
(``DFlash2DraftModel``, dflash==0.1.0) as the reference, export, training and decoding."""

from __future__ import annotations

import pytest
import torch

from draftsmith.drafter_config import (
    DFlash2Config,
    DFlashConfig,
    build_drafter_config,
    drafter_config_dict,
    drafter_config_from_dict,
)
from tiny import tiny_config

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
