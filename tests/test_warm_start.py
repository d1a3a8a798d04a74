"""drafter.init_from (issue 44): train from a DFlash / DFlash2 drafter folder.

A folder draftsmith exported, or one the official ``dflash`` package saved, starts a run whose weights at step 0 are
the folder's exactly; every contradiction (the user's keys against the folder, the folder against its own tensors,
the folder against the target) is refused when the workflow is planned, naming the key and both values; extraction
taps the folder's layers; resume and a rerun of a finished run behave as without a start; the start joins the run
fingerprint; evaluate decodes with the start drafter too and reports τ and tokens/s before -> after, paired by prompt.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from draftsmith.config import check_config
from draftsmith.drafter_config import build_drafter_config, drafter_config_dict
from draftsmith.export import ExportSettings, export_drafter
from draftsmith.modeling_dflash2 import model_class_for
from draftsmith.stages import rule_params
from draftsmith.train import TrainSettings, train
from draftsmith.train.distributed import setup_device
from draftsmith.train.plan import plan_data
from draftsmith.train.trainer import Trainer
from draftsmith.warm_start import (
    EMBED_KEYS,
    InitFromError,
    expected_tensors,
    overlay_keys,
    read_start,
    resolve_init_from,
    start_target_errors,
    tensor_errors,
)
from test_evaluate import _stage_kwargs, make_drafter, stage_inputs  # noqa: F401  (stage_inputs: a fixture)
from test_train import make_samples, write_features
from test_train_phases import stream_setup  # noqa: F401  (a fixture)
from tiny import tiny_target, tiny_tokenizer
from workflow import copy_workflow, planned_jobs, snakemake

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "schemas" / "config.schema.yaml")
MASK = 3  # not among the tiny target's eos (2) / pad (0)
TAPS = [1, 2]
TRAIN = {"tokens_per_batch": 128, "num_anchors": 16, "lr": 3e-3, "warmup_ratio": 0.1, "eval_fraction": 0.0,
         "save_every": 1000, "eval_every": 1000, "log_every": 5, "grad_clip": 1.0, "labels": "target", "prefetch": 2}
DFLASH2 = {"conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 target folder (with a ChatML tokenizer: eos 2, pad 0) and features of 8 target-generated samples
    at layers [1, 2]."""
    root = tmp_path_factory.mktemp("warm")
    target = tiny_target("qwen3", initializer_range=0.1)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    index = write_features(root / "features", target, TAPS, make_samples(target, 8, 8, 40, seed=1))
    return {"target": target, "target_dir": root / "target", "index": index, "root": root}


def exported(setup, dest: Path, architecture: str = "dflash", seed: int = 5, **shape) -> Path:
    """A drafter for the tiny target, random weights (seed), exported in bfloat16 to ``dest`` (the z-lab format)."""
    extra = DFLASH2 if architecture == "dflash2" else {}
    cfg = build_drafter_config(setup["target"].config, num_layers=shape.pop("num_layers", 2),
                               block_size=shape.pop("block_size", 4), target_layer_ids=shape.pop("ids", TAPS),
                               mask_token_id=shape.pop("mask", MASK), architecture=architecture, **extra, **shape)
    torch.manual_seed(seed)
    model = model_class_for(cfg.architectures)(cfg)
    with torch.no_grad():  # every tensor away from its initialisation (norms at 1, convolutions at the identity)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(dest.parent / f"{dest.name}-trained")
    export_drafter(dest.parent / f"{dest.name}-trained", setup["target_dir"], dest,
                   ExportSettings.from_config(drafter={"export_dtype": "bfloat16"}))
    return dest


def config_with(init_from, **drafter) -> dict:
    """The workflow's config.yaml, with drafter keys set, checked as the Snakefile checks it (defaults filled)."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["drafter"].update({"init_from": None if init_from is None else str(init_from), **drafter})
    return config


def trainer_for(setup, out: Path, drafter: dict, **train_cfg) -> Trainer:
    """A Trainer (one process, the CPU) of the tiny features with ``drafter`` settings: the drafter at step 0."""
    settings = TrainSettings.from_config(train={**TRAIN, "max_steps": 4, **train_cfg}, drafter=drafter)
    data = plan_data(setup["index"], settings.train, 1)
    device, ranks = setup_device(1)
    return Trainer(data, setup["target_dir"], out, settings, device, ranks)


def header_only_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A safetensors file whose header lists ``shapes`` and holds no data: what planning reads (headers only)."""
    offset, header = 0, {}
    for name, shape in shapes.items():
        size = 2 * int(torch.tensor(shape).prod().item()) if shape else 2
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


# ------------------------------------------------------------------------------------------------
# the folder's tensor set, computed from its config without torch


@pytest.mark.parametrize("architecture, shape", [
    ("dflash", {}),
    ("dflash", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 96}),
    ("dflash2", {}),
])
def test_the_expected_tensor_set_is_the_models_own(setup, architecture, shape):
    """expected_tensors (pure Python, read at planning) names exactly the drafter's own tensors with their shapes,
    DFlash and DFlash2, grouped-query and sliding layers; the embedding's names are draftsmith.target's."""
    from draftsmith.target import EMBED_KEYS as TARGET_EMBED_KEYS

    extra = DFLASH2 if architecture == "dflash2" else {}
    cfg = build_drafter_config(setup["target"].config, num_layers=2, block_size=4, target_layer_ids=TAPS,
                               mask_token_id=MASK, architecture=architecture, **extra, **shape)
    with torch.device("meta"):
        model = model_class_for(cfg.architectures)(cfg)
    assert expected_tensors(drafter_config_dict(cfg)) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    biased = dict(drafter_config_dict(cfg), attention_bias=True)
    assert "layers.1.self_attn.o_proj.bias" in expected_tensors(biased)
    assert EMBED_KEYS == TARGET_EMBED_KEYS


# ------------------------------------------------------------------------------------------------
# export -> init_from: the weights at step 0


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_an_exported_drafter_starts_a_run_with_its_exact_weights(setup, tmp_path, architecture, caplog):
    """Export (bfloat16) -> drafter.init_from: planning takes the folder's shape (block size, layers, taps as the
    formula's null + count when they are the formula's), and the trainer's drafter at step 0 holds the exported
    values exactly (bf16 cast to float32 is exact), then trains from them."""
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    final = exported(setup, tmp_path / "final", architecture)
    config = config_with(final)
    notes = check_config(config, SCHEMA, None, workdir=tmp_path)
    drafter = config["drafter"]
    assert (drafter["architecture"], drafter["num_layers"], drafter["block_size"]) == (architecture, 2, 4)
    assert drafter["target_layer_ids"] == TAPS and drafter["num_target_features"] == 2  # not the 4-layer formula's
    assert drafter["mask_token_id"] is None  # stays as given: null = the folder's
    assert notes and "block_size 4 (default 4)" not in notes[0] and "num_layers 2 (default 2)" not in notes[0]
    run = trainer_for(setup, tmp_path / "out", dict(drafter))
    assert run.config.ARCHITECTURE == read_start(final).config["architectures"][0]
    assert run.config.mask_token_id == MASK and run.config.block_size == 4
    want = load_file(str(final / "model.safetensors"))
    got = run.model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert value.dtype == torch.bfloat16 and got[name].dtype == torch.float32
        assert torch.equal(got[name], value.float()), name
    assert f"drafter starts from {final}" in caplog.text
    # training from it moves the weights, and the run fingerprint names the start
    state = train(setup["index"], setup["target_dir"], tmp_path / "out", TrainSettings.from_config(
        train={**TRAIN, "max_steps": 3}, drafter=dict(drafter)), threads=1)
    trained = load_file(str(tmp_path / "out" / "trained" / "model.safetensors"))
    assert any(not torch.equal(trained[k], want[k].float()) for k in want)
    assert state["fingerprint"] == run_fingerprint_of(setup, tmp_path / "out2", dict(drafter))


def run_fingerprint_of(setup, out: Path, drafter: dict) -> str:
    from draftsmith.train import run_fingerprint

    run = trainer_for(setup, out, drafter, max_steps=3)
    return run_fingerprint(drafter_config_dict(run.config), run.cfg, run.data.index.meta, 1, start=run.start_digest)


def test_a_drafter_the_official_package_saved_starts_a_run(official, setup, tmp_path, caplog):
    """The official dflash classes' save_pretrained (Qwen3Config + dflash_config, float32) is a start: DFlash as it
    is, DFlash2 with the two codebooks it saves as nn.Embedding (``.weight``) read as the release names."""
    from transformers import Qwen3Config

    caplog.set_level(logging.INFO, logger="draftsmith.train")
    tcfg = setup["target"].config
    for name, cls, extra in (("dflash", official.DFlashDraftModel, {}),
                             ("dflash2", official.DFlash2DraftModel, {"conv_kernel_size": 2, **DFLASH2})):
        cfg = Qwen3Config(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=128,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rope_theta=tcfg.rope_parameters["rope_theta"], max_position_embeddings=2048)
        cfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": MASK, "block_size": 4, **extra}
        cfg.num_target_layers = tcfg.num_hidden_layers
        torch.manual_seed(0)
        model = cls(cfg)
        if name == "dflash2":
            for layer in model.layers:  # the official class leaves base_kernel uninitialised (torch.empty)
                torch.nn.init.normal_(layer.attention_conv.base_kernel)
                torch.nn.init.normal_(layer.mlp_conv.base_kernel)
        folder = tmp_path / f"official-{name}"
        model.save_pretrained(folder)
        start = read_start(folder)
        assert tensor_errors(start) == [] and start.architecture == name
        config = config_with(folder)
        check_config(config, SCHEMA, None, workdir=tmp_path)
        assert config["drafter"]["num_layers"] == 1 and config["drafter"]["architecture"] == name
        run = trainer_for(setup, tmp_path / f"out-{name}", dict(config["drafter"]))
        saved = load_file(str(folder / "model.safetensors"))
        got = run.model.state_dict()
        for key, value in saved.items():
            ours = key.removesuffix(".weight") if "codebook" in key else key
            assert torch.equal(got[ours], value), key
    assert "read candidate_selector.predecessor_codebook.weight as candidate_selector.predecessor_codebook" in (
        caplog.text)


# ------------------------------------------------------------------------------------------------
# what is refused, naming the keys and both values


def test_each_key_that_contradicts_the_folder_is_refused_naming_both_values(setup, tmp_path):
    """A drafter key an overlay sets to another value than the folder's is refused (every one in one message,
    naming the key, the file that sets it, its value and the folder's); a key the overlay leaves out or sets to null,
    or sets to the folder's value, is not; config.yaml's values are defaults, even when named with --configfile."""
    final = exported(setup, tmp_path / "final", layer_types=["sliding_attention", "full_attention"],
                     sliding_window=8)
    overlay = tmp_path / "my.yaml"
    overlay.write_text(yaml.safe_dump({"drafter": {
        "init_from": str(final), "target_layer_ids": [0, 3], "block_size": 16, "mask_token_id": 7,
        "layer_types": ["full_attention", "full_attention"], "architecture": "dflash2", "num_layers": 2,
        "sliding_window": None}}))
    given = overlay_keys([REPO / "config.yaml", overlay], {"drafter": {"num_attention_heads": 8}}, REPO / "config.yaml")
    assert "num_target_features" not in given["drafter"]  # config.yaml's 3 taps: a default
    with pytest.raises(InitFromError) as err:
        resolve_init_from(config_with(final), given, workdir=tmp_path)
    text = str(err.value)
    for line in [f"drafter.target_layer_ids: [0, 3] in {overlay}, but the start drafter taps [1, 2]",
                 f"drafter.block_size: 16 in {overlay}, but the start drafter has 4 ({final}/config.json "
                 "dflash_config.block_size)",
                 f"drafter.mask_token_id: 7 in {overlay}, but the start drafter was trained with mask token {MASK}",
                 f"drafter.layer_types: ['full_attention', 'full_attention'] in {overlay}, but the start drafter has "
                 "['sliding_attention', 'full_attention']",
                 f"drafter.architecture: 'dflash2' in {overlay}, but {final}/config.json is a DFlashDraftModel",
                 "drafter.num_attention_heads: 8 in --config, but the start drafter has 4"]:
        assert line in text, text
    assert "drafter.num_layers" not in text and "sliding_window" not in text  # the folder's value; null
    # the folder's own values, or a confirmation of its mask token: accepted
    overlay.write_text(yaml.safe_dump({"drafter": {"init_from": str(final), "block_size": 4, "mask_token_id": MASK,
                                                   "target_layer_ids": TAPS}}))
    config = config_with(final)
    resolve_init_from(config, overlay_keys([overlay], None), workdir=tmp_path)
    assert config["drafter"]["sliding_window"] == 8 and config["drafter"]["target_layer_ids"] == TAPS


def test_a_folder_whose_tensors_are_not_its_configs_is_refused_naming_them(setup, tmp_path):
    """An extra tensor (an attention sink), a missing one and a misshapen one are each named; so are an incomplete
    config (no mask token), another drafter kind, a missing weights file, and a start inside this project's
    results/ (train would depend on its own output)."""
    final = exported(setup, tmp_path / "final")
    weights = load_file(str(final / "model.safetensors"))
    weights["layers.0.self_attn.sinks"] = torch.zeros(4, dtype=torch.bfloat16)
    del weights["norm.weight"]
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()  # one tap sliced out
    save_file(weights, str(final / "model.safetensors"))
    with pytest.raises(InitFromError) as err:
        resolve_init_from(config_with(final), None, workdir=tmp_path)
    text = str(err.value)
    assert "1 tensor(s) its config.json implies are missing: norm.weight" in text
    assert "1 tensor(s) a DFlashDraftModel of this config does not have (attention sinks, an MTP head, another " \
           "architecture?): layers.0.self_attn.sinks" in text
    assert "fc.weight [64, 64] (expected [64, 128])" in text

    cfg = json.loads((final / "config.json").read_text())
    for edit, says in [(lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id is not stated"),
                       (lambda c: c.update(architectures=["Eagle3DraftModel"]), "neither DFlashDraftModel nor")]:
        broken = json.loads(json.dumps(cfg))
        edit(broken)
        (final / "config.json").write_text(json.dumps(broken))
        with pytest.raises(InitFromError, match=says):
            read_start(final)
    (final / "model.safetensors").unlink()
    with pytest.raises(InitFromError, match="has no model.safetensors"):
        read_start(final)
    inside = tmp_path / "results" / "drafter" / "final"
    shutil.copytree(exported(setup, tmp_path / "again"), inside)
    with pytest.raises(InitFromError, match="lies inside this project's results/.*cp -r"):
        resolve_init_from(config_with("results/drafter/final"), None, workdir=tmp_path)


def test_a_target_the_start_was_not_made_for_is_refused_naming_what_differs(setup, tmp_path):
    """The start against the target folder (target_checks at planning): layer count (the taps), width, vocabulary,
    and a mask token the target emits, which an explicit drafter.mask_token_id of the same id confirms."""
    final = exported(setup, tmp_path / "final", ids=[1, 3])
    config = config_with(final)
    fits = start_target_errors(config, setup["target_dir"], num_layers=4, hidden_size=64, vocab_size=512)
    assert fits == []
    errors = start_target_errors(config, setup["target_dir"], num_layers=3, hidden_size=32, vocab_size=600)
    text = "\n".join(errors)
    assert "trained for a target of 4 decoder layers, tapping [1, 3]" in text and "has 3 (ids 0..2)" in text
    assert "hidden_size is 64" in text and "the target's 32" in text
    # the embedding's rows (safetensors header) win over config.json's vocab_size
    assert "vocab_size is 512" not in text
    target2 = tmp_path / "target-vocab"
    tiny_target("qwen3", vocab_size=600).save_pretrained(target2)
    assert any("the target has 600 embedding rows" in e for e in start_target_errors(
        config, target2, num_layers=4, hidden_size=64, vocab_size=600))
    eos = exported(setup, tmp_path / "eos", mask=2)
    errors = start_target_errors(config_with(eos), setup["target_dir"], num_layers=4, hidden_size=64, vocab_size=512)
    assert len(errors) == 1 and "mask token 2" in errors[0] and "a token the target emits" in errors[0]
    assert "confirm it: drafter.mask_token_id: 2" in errors[0]
    assert start_target_errors(config_with(eos, mask_token_id=2), setup["target_dir"], num_layers=4, hidden_size=64,
                               vocab_size=512) == []


def test_training_refuses_a_start_that_contradicts_its_settings_or_features(setup, tmp_path):
    """Called directly (no planning), the trainer checks again: a non-default setting against the folder, features
    extracted at other layers, the mask token among the target's stop tokens without a confirmation."""
    final = exported(setup, tmp_path / "final", ids=[0, 3])
    with pytest.raises(ValueError) as err:
        trainer_for(setup, tmp_path / "out", {"init_from": str(final), "block_size": 8})
    assert "drafter.block_size: 8 in the train settings, but the start drafter has 4" in str(err.value)
    assert "the features were extracted at layers [1, 2], but the start drafter" in str(err.value)
    eos = exported(setup, tmp_path / "eos", mask=2)
    with pytest.raises(ValueError, match=r"mask_token_id 2 is one of the target's stop tokens \[2\]"):
        trainer_for(setup, tmp_path / "out", {"init_from": str(eos)})
    assert trainer_for(setup, tmp_path / "out", {"init_from": str(eos), "mask_token_id": 2}).config.mask_token_id == 2


# ------------------------------------------------------------------------------------------------
# what reruns: extraction follows the taps, the fingerprint the start


def test_extraction_params_are_the_start_taps(setup, tmp_path):
    """extract_plan's params are the effective taps: a start whose taps are the formula's keeps a run without a start
    from extracting again; a start with other taps changes them (so Snakemake extracts again)."""
    from draftsmith.target_layers import default_target_layer_ids

    plain = config_with(None, num_target_features=1, num_layers=2)
    check_config(plain, SCHEMA, None)
    same = exported(setup, tmp_path / "same", ids=default_target_layer_ids(4, 1))  # [2]
    other = exported(setup, tmp_path / "other", ids=[1])
    configs = {}
    for name, folder in (("same", same), ("other", other)):
        configs[name] = config_with(folder)
        check_config(configs[name], SCHEMA, None, workdir=tmp_path)
    assert rule_params(configs["same"], "extract_plan") == rule_params(plain, "extract_plan")
    assert rule_params(configs["other"], "extract_plan")["drafter"]["target_layer_ids"] == [1]
    assert rule_params(configs["same"], "train")["drafter"]["init_from"] == str(same)


def test_resume_and_a_rerun_of_a_finished_run_behave_as_without_a_start(setup, tmp_path):
    """With a start: a run stopped at step 2 resumes there and ends with the uninterrupted run's weights; a finished
    run whose trained/ is gone (--forcerun) starts again from the start's weights, to the same weights; the start is
    in the fingerprint (another start's weights: another checkpoint folder), and without a start it is not."""
    final = exported(setup, tmp_path / "final")
    drafter = {"init_from": str(final)}
    cfg = TrainSettings.from_config(train={**TRAIN, "max_steps": 4, "save_every": 2}, drafter=drafter)
    index, target = setup["index"], setup["target_dir"]
    a, b = tmp_path / "a", tmp_path / "b"
    first = train(index, target, a, cfg, threads=1)
    assert train(index, target, b, cfg, threads=1, stop_after_steps=2)["stopped_at"] == 2
    resumed = train(index, target, b, cfg, threads=1)
    assert resumed["resumed_from_step"] == 2
    wa, wb = (load_file(str(p / "trained" / "model.safetensors")) for p in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    shutil.rmtree(a / "trained")
    again = train(index, target, a, cfg, threads=1)
    assert again["resumed_from_step"] == 0 and again["fingerprint"] == first["fingerprint"]
    w2 = load_file(str(a / "trained" / "model.safetensors"))
    assert all(torch.equal(wa[k], w2[k]) for k in wa)
    # the same shape with other weights: another run; no start: another run
    other = exported(setup, tmp_path / "other", seed=6)
    assert train(index, target, a, TrainSettings.from_config(train={**TRAIN, "max_steps": 4, "save_every": 2},
                                                             drafter={"init_from": str(other)}),
                 threads=1)["fingerprint"] != first["fingerprint"]
    plain = train(index, target, tmp_path / "c", TrainSettings.from_config(
        train={**TRAIN, "max_steps": 4}, drafter={"num_layers": 2, "block_size": 4, "mask_token_id": MASK,
                                                   "target_layer_ids": TAPS}), threads=1)
    assert plain["fingerprint"] != first["fingerprint"]
    assert len(list((a / "checkpoints").glob("run-*"))) == 2


def test_stream_phases_start_from_the_folder_as_the_offline_run_does(stream_setup, tmp_path):  # noqa: F811
    """Stream mode: the phases of a run with a start (phase 0 from the folder's weights, the next ones from their
    predecessor's checkpoint) and its end give the offline run's weights from the same start, bit for bit."""
    from transformers import AutoConfig

    from draftsmith.train import TrainPhaseSettings, train_final
    from test_train_phases import DRAFTER, LAYERS, run_phases, stream_plan
    from test_train_phases import MASK as PHASE_MASK
    from test_train_phases import TRAIN as PHASE_TRAIN

    target_config = AutoConfig.from_pretrained(stream_setup["target_dir"])
    cfg = build_drafter_config(target_config, num_layers=1, block_size=4, target_layer_ids=LAYERS,
                               mask_token_id=PHASE_MASK)
    torch.manual_seed(11)
    model = model_class_for(cfg.architectures)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "start")
    drafter = {**DRAFTER, "init_from": str(tmp_path / "start")}
    train_cfg = dict(PHASE_TRAIN, epochs=2, save_every=2)
    settings = TrainPhaseSettings.from_config(train=train_cfg, drafter=drafter,
                                              stream={"slices": 2, "reuse": 1, "heldout_samples": 1024})
    rows = list(range(stream_setup["num_rows"]))
    offline = train(stream_setup["index_of"](rows, "offline"), stream_setup["target_dir"], tmp_path / "offline",
                    TrainSettings.from_config(train=train_cfg, drafter=drafter), threads=1)
    out = tmp_path / "stream"
    markers = run_phases(stream_setup, settings, out)
    assert offline["resumed_from_step"] == 0 and len({m["fingerprint"] for m in markers}) == 1
    _, held = stream_plan(stream_setup, settings)
    heldout = stream_setup["index_of"](held, "heldout") if held else None
    train_final(out / "phases" / f"phase-{len(markers) - 1}.json", heldout, stream_setup["tokenized"],
                stream_setup["target_dir"], out, TrainSettings.from_config(train=train_cfg, drafter=drafter), threads=1)
    wa, wb = (load_file(str(p / "trained" / "model.safetensors")) for p in (tmp_path / "offline", out))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------------------
# planning: snakemake -n


def planner_start(dest: Path, *, hidden: int = 576, layers: int = 2, taps=(1, 14, 27), mask: int = 3,
                  block: int = 16, vocab: int = 49152, extra: dict | None = None) -> Path:
    """A drafter folder for the SmolLM2-shaped planner target (test_target_checks): config.json and a safetensors
    file that is only a header (planning reads headers only)."""
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "intermediate_size": 1536, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 1e5,
           "num_target_layers": 30, "layer_types": ["full_attention"] * layers, "is_causal": False,
           "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": mask, "block_size": block}}
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(cfg))
    header_only_safetensors(dest / "model.safetensors", {**expected_tensors(cfg), **(extra or {})})
    return dest


def test_snakemake_plans_with_a_start_and_refuses_a_contradiction_before_anything_runs(tmp_path):
    from test_target_checks import target_folder

    work = copy_workflow(tmp_path / "workflow")
    target = target_folder(tmp_path / "target")
    start = planner_start(tmp_path / "start")
    base = {"target": {"model": str(target)}}

    def dry(overlay: dict):
        path = tmp_path / "overlay.yaml"
        path.write_text(yaml.safe_dump({**base, **overlay}))
        proc = snakemake(work, "-n", "--configfile", str(path), timeout=300)
        return proc, proc.stdout + proc.stderr

    proc, out = dry({"drafter": {"init_from": str(start)}})
    assert proc.returncode == 0, out[-3000:]
    assert planned_jobs(out)["train"] == 1
    assert f"drafter.init_from {start}: the drafter's shape is the folder's: block_size 16 (default 4)" in out
    proc, out = dry({"drafter": {"init_from": str(start), "block_size": 8, "target_layer_ids": [1, 15, 29]}})
    assert proc.returncode != 0 and planned_jobs(out) == {}
    assert f"drafter.block_size: 8 in {tmp_path / 'overlay.yaml'}, but the start drafter has 16" in out
    assert "drafter.target_layer_ids: [1, 15, 29]" in out and "taps [1, 14, 27]" in out
    wide = planner_start(tmp_path / "wide", hidden=640, extra={"layers.0.self_attn.sinks": (9,)})
    proc, out = dry({"drafter": {"init_from": str(wide)}})
    assert proc.returncode != 0 and "layers.0.self_attn.sinks" in out
    other = planner_start(tmp_path / "other-target", hidden=640, vocab=50000)
    proc, out = dry({"drafter": {"init_from": str(other)}})
    assert proc.returncode != 0 and planned_jobs(out) == {}, out[-3000:]
    assert "hidden_size is 640" in out and "the target's 576" in out
    assert "vocab_size is 50000" in out and "the target has 49152 vocab_size" in out


# ------------------------------------------------------------------------------------------------
# evaluate: before -> after


def _result(committed: list[int], seconds: float = 1.0):
    from draftsmith.evaluate.decode import GenerationResult

    tokens = list(range(sum(committed)))
    return GenerationResult(tokens=tokens, num_prompt_tokens=5, seconds=seconds, prefill_seconds=0.1,
                            committed=committed, proposed=[3] * len(committed),
                            accepted=[c - 1 for c in committed])


def test_the_report_pairs_the_start_and_names_a_set_whose_tau_drops():
    """report.json's start section: τ and tokens/s before (the start drafter) and after on the same prompts, the
    paired ratios with bootstrap intervals (evaluate.compare's pairing), τ change and drop; report.md names the set
    whose τ dropped, with its size."""
    from draftsmith.evaluate.report import _start_table, start_drops, start_metrics

    n = 6
    results = {"target_only": [_result([], 2.0) for _ in range(n)],
               "dflash": [_result([2, 2, 2, 2]) for _ in range(n)],
               "dflash_start": [_result([4, 4]) for _ in range(n)]}
    start = start_metrics(results, 4)
    assert start["before"]["tau"] == 4.0 and start["tau_change"] == -2.0 and start["tau_dropped"]
    assert start["paired"]["matched"] == n and start["paired"]["tau"]["ratio"] == pytest.approx(0.5)
    assert start["paired"]["tau"]["ratio_low"] == pytest.approx(0.5)  # every prompt the same ratio
    section = {"prompts": n, "dflash": {"tau": 2.0, "tokens_per_s": 8.0}, "start": start}
    report = {"sets": {"mmath": section}, "overall": None}
    assert start_drops(report) == [("mmath", 4.0, 2.0)]
    md = "\n".join(_start_table(report, "DFlash"))
    assert "τ dropped on mmath (4.00 -> 2.00, -2.00)" in md and "-2.00 **dropped**" in md
    assert "0.500x [0.500, 0.500]" in md


@pytest.mark.slow
def test_evaluate_decodes_the_start_drafter_too_and_reports_before_and_after(stage_inputs, tmp_path, caplog):  # noqa: F811
    """With drafter.init_from, every prompt is decoded once more with the start drafter (lossless too); each set and
    the all row have the start section, whose paired figures reconcile with the set's own; report.md has the before
    -> after table; the log names each set whose τ dropped, or says none did."""
    from transformers import AutoModelForCausalLM

    from draftsmith.evaluate import EvaluateSettings, run_evaluate

    caplog.set_level(logging.INFO, logger="draftsmith.evaluate")
    start = tmp_path / "start"
    make_drafter(AutoModelForCausalLM.from_pretrained(stage_inputs["target"]), seed=9).save_pretrained(start)
    kwargs = _stage_kwargs(stage_inputs, tmp_path / "out")
    kwargs["settings"] = EvaluateSettings.from_config(evaluate=kwargs["settings"].evaluate.to_dict(),
                                                      target={"dtype": "float32"}, drafter={"init_from": str(start)})
    report = run_evaluate(**kwargs)
    assert report["run"]["start_drafter"] == str(start) and report["run"]["start_sha256"]
    for name, s in [*report["sets"].items(), ("all", report["overall"])]:
        st = s["start"]
        assert s["lossless"]["dflash_start"]["lossless"], name
        assert st["paired"]["matched"] == s["prompts"]
        assert st["paired"]["tau"]["new"] == pytest.approx(s["dflash"]["tau"])
        assert st["paired"]["tau"]["base"] == pytest.approx(st["before"]["tau"])
        assert st["tau_dropped"] == (s["dflash"]["tau"] < st["before"]["tau"])
    assert all("dflash_start_committed" in row for row in report["sets"]["heldout"]["per_prompt"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Before -> after: the drafter training started from (drafter.init_from)" in md
    dropped = [n for n, s in report["sets"].items() if s["start"]["tau_dropped"]]
    for name in dropped:
        assert f"τ dropped on set {name}" in caplog.text
    if not dropped:
        assert "τ held or rose on every set" in caplog.text
