"""Settings checked against the target when the workflow is planned (draftsmith/target_checks.py, the schema's
"did you mean" and cross-key rules in draftsmith/config.py): each wrong setting stops ``snakemake -n`` naming the key,
the allowed range and what to do, before any job runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from draftsmith.config import config_errors, cross_key_errors
from draftsmith.target_checks import (
    TargetSettingsError,
    block_size_warnings,
    check_target_in_job,
    check_target_settings,
    missing_tokenizer_files,
    read_target_shape,
    target_setting_errors,
)
from workflow import copy_workflow, planned_jobs, snakemake

REPO = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((REPO / "schemas" / "config.schema.yaml").read_text())
# SmolLM2-135M-Instruct's config.json (the embedded default's target): 30 layers, 49152 tokens, 8192 positions
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
           "vocab_size": 49152, "max_position_embeddings": 8192, "hidden_size": 576}
# a Qwen3.5-27B-style checkpoint: the decoder's keys only under text_config
QWEN35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "vocab_size": 248320,
                          "max_position_embeddings": 262144, "hidden_size": 5120},
          "vision_config": {"depth": 27, "hidden_size": 1152}}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def target_folder(dest: Path, config: dict = SMOLLM2, *, tokenizer: bool = True) -> Path:
    """A target folder as the planner sees it: config.json, an (empty) weights file, and tokenizer files."""
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (dest / "tokenizer.json").write_text("{}")
        (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                "chat_template": TEMPLATE}))
    return dest


def drafter(**keys) -> dict:
    """A config with the schema's drafter defaults and the given drafter keys (tokenize.max_length 2048)."""
    base = {"num_layers": 1, "block_size": 16, "target_layer_ids": None, "num_target_features": None,
            "mask_token_id": None}
    return {"drafter": {**base, **keys}, "tokenize": {"max_length": 2048}}


# ------------------------------------------------------------------------------------------------
# the checks, one setting at a time


def test_the_cpu_default_fits_its_target_without_a_word(tmp_path):
    folder = target_folder(tmp_path / "t")
    config = drafter(num_layers=2, num_target_features=3, block_size=4)
    config["tokenize"]["max_length"] = 512
    assert check_target_settings(config, folder) == []


def test_a_target_layer_id_outside_the_target_is_refused_with_the_range_and_the_formulas_ids(tmp_path):
    folder = target_folder(tmp_path / "t")
    (err,) = target_setting_errors(drafter(target_layer_ids=[1, 15, 40]), folder)
    assert err.startswith("drafter.target_layer_ids: [40] outside 0..29, the 30 decoder layers of "
                          f"{folder / 'config.json'}")
    assert "num_target_features: 3 (the official formula's [1, 14, 27])" in err
    assert target_setting_errors(drafter(target_layer_ids=[0, 15, 29]), folder) == []
    with pytest.raises(TargetSettingsError, match=r"drafter\.target_layer_ids: \[40\] outside 0\.\.29"):
        check_target_settings(drafter(target_layer_ids=[1, 15, 40]), folder)


def test_a_hybrid_targets_layers_and_vocabulary_are_read_from_its_text_config(tmp_path):
    folder = target_folder(tmp_path / "qwen", QWEN35)
    shape = read_target_shape(folder)
    assert (shape.num_hidden_layers, shape.vocab_size, shape.max_position_embeddings) == (64, 248320, 262144)
    assert target_setting_errors(drafter(target_layer_ids=[1, 32, 63], mask_token_id=248319), folder) == []
    errors = target_setting_errors(drafter(target_layer_ids=[1, 64], mask_token_id=248320), folder)
    assert [e.split(":")[0] for e in errors] == ["drafter.target_layer_ids", "drafter.mask_token_id"]
    assert "[64] outside 0..63" in errors[0] and "outside the vocabulary 0..248319" in errors[1]


def test_more_formula_taps_than_the_target_can_spread_are_refused_naming_the_key(tmp_path):
    """The official formula spreads n taps over layers 1..L-3: 3 taps of a 4-layer target would repeat layer 1."""
    folder = target_folder(tmp_path / "t", {**SMOLLM2, "num_hidden_layers": 4})
    (err,) = target_setting_errors(drafter(num_target_features=3), folder)
    assert err.startswith("drafter.num_target_features: the official formula cannot spread 3 taps over the 4 "
                          "decoder layers")
    assert "use at most 1 taps, or list drafter.target_layer_ids" in err
    (err,) = target_setting_errors(drafter(num_layers=3), folder)  # num_layers decides the taps by default
    assert err.startswith("drafter.num_layers (the taps by default): the official formula cannot spread 3 taps")
    assert target_setting_errors(drafter(num_target_features=1), folder) == []


def test_num_target_features_inconsistent_with_the_listed_layers_is_refused():
    (err,) = cross_key_errors(drafter(target_layer_ids=[1, 14, 27], num_target_features=2))
    assert err.startswith("drafter.num_target_features is 2 but drafter.target_layer_ids lists 3 layers [1, 14, 27]")
    assert "set num_target_features to 3 or null" in err
    assert cross_key_errors(drafter(target_layer_ids=[1, 14, 27], num_target_features=3)) == []
    assert cross_key_errors(drafter(target_layer_ids=[1, 14, 27])) == []
    (err,) = cross_key_errors(drafter(target_layer_ids=[1, 14, 14]))
    assert "drafter.target_layer_ids [1, 14, 14] has duplicates" in err


def test_a_mask_token_outside_the_vocabulary_is_refused(tmp_path):
    folder = target_folder(tmp_path / "t")
    (err,) = target_setting_errors(drafter(mask_token_id=49152), folder)
    assert err.startswith(f"drafter.mask_token_id: 49152 is outside the vocabulary 0..49151 of "
                          f"{folder / 'config.json'}")
    assert target_setting_errors(drafter(mask_token_id=49151), folder) == []


def test_soft_labels_of_a_target_that_caps_its_logits_are_refused_before_any_gpu_hour(tmp_path):
    """DFlash2's default stores the target's top 32 (extract.store_target_topk): for a target that transforms
    lm_head's output (Gemma 2's final_logit_softcapping) lm_head's top-k is not its distribution, so planning refuses
    naming both keys to set; at 0 (DFlash's default) the same target plans."""
    gemma2 = {**SMOLLM2, "model_type": "gemma2", "final_logit_softcapping": 30.0}
    folder = target_folder(tmp_path / "gemma2", gemma2)
    soft = {**drafter(architecture="dflash2"), "extract": {"store_target_topk": 32}}
    errors = target_setting_errors(soft, folder)
    assert len(errors) == 1 and errors[0].startswith("extract.store_target_topk: 32 (the default for "
                                                      "drafter.architecture dflash2")
    assert "final_logit_softcapping = 30.0" in errors[0] and "train.labels: target" in errors[0]
    assert target_setting_errors({**soft, "extract": {"store_target_topk": 0}}, folder) == []
    assert target_setting_errors(soft, target_folder(tmp_path / "smollm2")) == []  # logits = lm_head's output


def test_block_size_is_refused_above_64_or_the_rows_and_warned_above_the_published_16():
    (err,) = config_errors({"drafter": {"block_size": 4096}}, SCHEMA)
    assert err.startswith("drafter.block_size: 4096 is greater than the maximum of 64 (Block size B")
    assert "Published DFlash drafters use 8-16" in err
    assert config_errors({"drafter": {"block_size": 64}}, SCHEMA) == []
    (warning,) = block_size_warnings(drafter(block_size=32))
    assert warning.startswith("drafter.block_size: 32 is above the 8-16 of published DFlash drafters")
    assert block_size_warnings(drafter(block_size=16)) == [] and block_size_warnings(drafter(block_size=4)) == []
    config = drafter(block_size=16)
    config["tokenize"]["max_length"] = 8
    (err,) = cross_key_errors(config)
    assert err.startswith("drafter.block_size 16 is above tokenize.max_length 8: block slots 8..15")
    config = drafter(block_size=8)
    config["evaluate"] = {"block_size": 16}
    (err,) = cross_key_errors(config)
    assert err.startswith("evaluate.block_size 16 is above drafter.block_size 8: the drafter was never trained on "
                          "block slots 8..15")
    config["evaluate"]["block_size"] = 4  # a narrower verify width is the drafter's first slots: allowed
    assert cross_key_errors(config) == []


def test_a_target_folder_without_tokenizer_files_is_refused_with_what_is_missing(tmp_path):
    folder = target_folder(tmp_path / "bare", tokenizer=False)
    assert missing_tokenizer_files(folder) == [
        "a vocabulary: tokenizer.json, tokenizer.model or vocab.json + merges.txt",
        "tokenizer_config.json (the special tokens)",
        "a chat template: chat_template.jinja, chat_template.json, or chat_template in tokenizer_config.json"]
    (err,) = target_setting_errors(drafter(), folder)
    assert err.startswith(f"target.model: {folder} has no tokenizer the stages can load; it lacks a vocabulary")
    # a slow BPE tokenizer (vocab.json + merges.txt) whose template is a file: complete
    (folder / "vocab.json").write_text("{}")
    assert missing_tokenizer_files(folder)[0].startswith("a vocabulary")  # vocab.json alone is no vocabulary
    (folder / "merges.txt").write_text("")
    (folder / "tokenizer_config.json").write_text("{}")
    assert missing_tokenizer_files(folder) == [
        "a chat template: chat_template.jinja, chat_template.json, or chat_template in tokenizer_config.json"]
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert missing_tokenizer_files(folder) == []


@pytest.mark.parametrize("bad, message", [
    ({"trian": {"lr": 1e-3}}, "trian: unknown key ('trian' was unexpected); did you mean train?"),
    ({"train": {"lerning_rate": 1e-3}}, "train.lerning_rate: unknown key ('lerning_rate' was unexpected); "
                                        "did you mean train.lr?"),
    ({"train": {"learning_rate": 1e-3}}, "train.learning_rate: unknown key ('learning_rate' was unexpected); "
                                         "did you mean train.lr?"),
    ({"drafter": {"blok_size": 8}}, "drafter.blok_size: unknown key ('blok_size' was unexpected); "
                                    "did you mean drafter.block_size?"),
    ({"train": {"block_size": 8}}, "did you mean drafter.block_size?"),  # a key of another section
    ({"data": {"sources": [{"name": "chat", "path": "x.jsonl", "adapter": "sharegpt", "max_sample": 3}]}},
     "data.sources.0 (chat).max_sample: unknown key ('max_sample' was unexpected); did you mean max_samples?"),
    ({"evaluate": {"sets": {"mt": {"source": "mtbench", "max_prompt": 3}}}},
     "evaluate.sets.mt.max_prompt: unknown key ('max_prompt' was unexpected); did you mean "
     "evaluate.sets.mt.max_prompts?"),
    ({"train": {"xyzzy": 1}}, "train.xyzzy: unknown key ('xyzzy' was unexpected); the keys in train are: gpus, "),
])
def test_a_misspelled_key_is_refused_with_the_key_it_was_meant_to_be(bad, message):
    errors = config_errors(bad, SCHEMA)
    assert any(message in e for e in errors), errors


def test_a_target_materialised_after_planning_is_checked_by_the_first_job_that_reads_it(tmp_path, caplog):
    """disk_plan / tokenize run check_target_in_job first: the refusal goes to the job's log and ends the job."""
    folder = target_folder(tmp_path / "t")
    log = logging.getLogger("draftsmith.test")
    with caplog.at_level(logging.INFO, logger="draftsmith.test"), pytest.raises(SystemExit) as stop:
        check_target_in_job(drafter(mask_token_id=60000), folder, log)
    assert stop.value.code == 1
    assert "drafter.mask_token_id: 60000 is outside the vocabulary 0..49151" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.test"):
        check_target_in_job(drafter(block_size=32), folder, log)
    assert "!!! drafter.block_size: 32 is above the 8-16 of published DFlash drafters" in caplog.text


def test_the_first_jobs_that_read_the_target_check_it():
    for script in ("disk_plan.py", "tokenize.py"):
        assert "check_target_in_job(snakemake.config, snakemake.input.target, log)" in (
            REPO / "scripts" / script).read_text(), script


# ------------------------------------------------------------------------------------------------
# snakemake -n stops at planning


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the workflow and a local target folder shaped like SmolLM2 (the default's sources, embedded)."""
    root = tmp_path_factory.mktemp("plancheck")
    return copy_workflow(root / "workflow"), target_folder(root / "target")


def _dry_run(work: Path, config: dict, dest: Path):
    (dest / "overlay.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(work, "-n", "--configfile", str(dest / "overlay.yaml"), timeout=300)
    return proc, proc.stdout + proc.stderr


def test_the_default_settings_against_a_local_target_plan_the_whole_workflow(planned, tmp_path):
    work, target = planned
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["target"]["model"] = str(target)
    proc, out = _dry_run(work, config, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    assert planned_jobs(out)["train"] == 1 and "!!!" not in out


@pytest.mark.parametrize("overlay, messages", [
    # schema: a misspelled key and a block size beyond any use, together
    ({"train": {"lerning_rate": 1e-3}, "drafter": {"block_size": 4096}},
     ["train.lerning_rate: unknown key ('lerning_rate' was unexpected); did you mean train.lr?",
      "drafter.block_size: 4096 is greater than the maximum of 64"]),
    # cross-key: num_target_features against the listed layers
    ({"drafter": {"target_layer_ids": [1, 14, 27, 29], "num_target_features": 3}},
     ["drafter.num_target_features is 3 but drafter.target_layer_ids lists 4 layers"]),
    # the target: a layer id, the mask token and the tokenizer files, all at once
    ({"drafter": {"target_layer_ids": [1, 14, 30], "mask_token_id": 49152}, "no_tokenizer": True},
     ["drafter.target_layer_ids: [30] outside 0..29", "drafter.mask_token_id: 49152 is outside the vocabulary 0..49151",
      "has no tokenizer the stages can load; it lacks a vocabulary: tokenizer.json"]),
])
def test_each_wrong_setting_stops_the_dry_run_at_planning(planned, tmp_path, overlay, messages):
    work, target = planned
    overlay = dict(overlay)
    if overlay.pop("no_tokenizer", False):
        target = target_folder(tmp_path / "bare", tokenizer=False)
    config = yaml.safe_load((work / "config.yaml").read_text())
    for section, keys in {**overlay, "target": {"model": str(target)}}.items():
        config[section] = {**config.get(section, {}), **keys}
    proc, out = _dry_run(work, config, tmp_path)
    assert proc.returncode != 0, out[-3000:]
    assert "Building DAG" not in out and planned_jobs(out) == {}
    for message in messages:
        assert message in out, out[-3000:]
