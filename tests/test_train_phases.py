"""train in stream mode (draftsmith/train/phases.py): phases of the global plan over per-slice feature indexes
train what one offline run trains, resume, refuse what is not theirs; and float8 features decoded in the training
step equal those decoded by the loader.

Features are computed once per sample on a tiny random Qwen3 target and written with draftsmith.features' writer
into one index per slice (and one holding everything for the offline run), so every slicing reads the same values.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from draftsmith.batch_plan import split_samples
from draftsmith.features import LAYER_SEMANTICS, FeatureIndex, index_document, write_chunk, write_index
from draftsmith.target import capture_layers
from draftsmith.tokenized import TOKENIZED_SCHEMA
from draftsmith.train import (
    StreamPlan,
    TrainPhaseSettings,
    TrainSettings,
    heldout_subset,
    make_batch,
    train,
    train_final,
    train_phase,
)
from extraction import rewrite_chunk, rewrite_index_chunk
from tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]
MASK = 3
LAYERS = [1, 2]
TRAIN = {"tokens_per_batch": 64, "num_anchors": 8, "lr": 3e-3, "warmup_ratio": 0.1, "eval_fraction": 0.2,
         "save_every": 1000, "eval_every": 3, "log_every": 2, "grad_clip": 1.0, "labels": "target", "prefetch": 2,
         "gpus": 1, "keep_checkpoints": 1}
DRAFTER = {"num_layers": 1, "block_size": 4, "mask_token_id": MASK, "target_layer_ids": LAYERS}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stream_setup(tmp_path_factory):
    """A tiny target folder, 14 samples of 20..50 tokens (tokenized parquet + their features, computed once) and
    ``index_of(rows, name, storage)``: an index of those rows' features."""
    root = tmp_path_factory.mktemp("stream")
    target = tiny_target("qwen3", initializer_range=0.1)
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(14):
        n = int(torch.randint(20, 51, (1,), generator=g))
        ids = torch.randint(5, 500, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.int8)
        mask[6:] = 1
        with torch.no_grad(), capture_layers(target, LAYERS) as cap:
            logits = target(ids[None]).logits
            feats = cap.features()[0]
        samples.append({"input_ids": ids, "loss_mask": mask, "features": feats, "target_token": logits[0].argmax(-1)})
    table = pa.table({"id": [f"s{r}" for r in range(len(samples))], "source": ["test"] * len(samples),
                      "input_ids": [s["input_ids"].tolist() for s in samples],
                      "loss_mask": [s["loss_mask"].tolist() for s in samples],
                      "num_tokens": [s["input_ids"].numel() for s in samples]}, schema=TOKENIZED_SCHEMA)
    pq.write_table(table, root / "train.parquet")

    def index_of(rows, name: str, storage: str = "bfloat16") -> Path:
        folder = root / storage / name
        if (folder / "index.json").is_file():
            return folder / "index.json"
        chunks = []
        for c0 in range(0, len(rows), 3):  # chunks of 3 samples, in the order given
            part = list(rows[c0:c0 + 3])
            path = f"shard-0/chunk-{c0 // 3:05d}.safetensors"
            (folder / "shard-0").mkdir(parents=True, exist_ok=True)
            cat = lambda key: torch.cat([samples[r][key] for r in part])  # noqa: E731
            lengths = [samples[r]["input_ids"].numel() for r in part]
            digest = write_chunk(folder / path, features=cat("features"), lengths=lengths, sample_index=part,
                                 input_ids=cat("input_ids"), loss_mask=cat("loss_mask"), storage_dtype=storage,
                                 target_token=cat("target_token"), num_layers=len(LAYERS))
            chunks.append({"path": path, "shard": 0, "sha256": digest, "num_samples": len(part),
                           "num_tokens": sum(lengths), "bytes": (folder / path).stat().st_size, "rows": part})
        write_index(folder / "index.json", index_document({
            "chunks": chunks, "num_samples": len(rows), "num_tokens": sum(c["num_tokens"] for c in chunks),
            "layer_ids": LAYERS, "layer_semantics": LAYER_SEMANTICS, "hidden_size": target.config.hidden_size,
            "num_target_layers": target.config.num_hidden_layers, "storage_dtype": storage, "has_target_token": True,
            "target_fingerprint": "test", "tokenizer_fingerprint": "test", "layer_stats": {}}))
        return folder / "index.json"

    return {"root": root, "target_dir": root / "target", "tokenized": root / "train.parquet",
            "num_rows": len(samples), "lengths": [s["input_ids"].numel() for s in samples], "index_of": index_of}


def phase_settings(train_cfg: dict, slices: int, reuse: int, heldout_samples: int = 1024) -> TrainPhaseSettings:
    return TrainPhaseSettings.from_config(train=train_cfg, drafter=DRAFTER,
                                          stream={"slices": slices, "reuse": reuse, "heldout_samples": heldout_samples})


def stream_plan(setup, settings: TrainPhaseSettings) -> tuple[StreamPlan, list[int]]:
    """The global plan and the held-out samples kept, as the trainer computes them."""
    cfg = settings.train
    train_ids, held = split_samples(list(range(setup["num_rows"])), cfg.eval_fraction, cfg.seed)
    plan = StreamPlan(setup["lengths"], train_ids, cfg.tokens_per_batch, seed=cfg.seed, world=1,
                      grad_accum=cfg.grad_accum, epochs=cfg.epochs, max_steps=cfg.max_steps,
                      slices=settings.stream.slices, reuse=settings.stream.reuse)
    return plan, heldout_subset(held, settings.stream.heldout_samples, cfg.seed)


def run_phases(setup, settings, out: Path, phases=None, storage: str = "bfloat16", **kw) -> list[dict]:
    """Train ``phases`` (default all) in order, each on an index of exactly its slice's samples."""
    plan, held = stream_plan(setup, settings)
    heldout = setup["index_of"](held, "heldout", storage) if held else None
    markers = []
    for phase in plan.phases if phases is None else [plan.phases[p] for p in phases]:
        index = setup["index_of"](list(phase.samples), f"{out.name}-slice-{phase.index}", storage)
        previous = out / "phases" / f"phase-{phase.index - 1}.json" if phase.index else None
        markers.append(train_phase(phase.index, index, heldout.parent if heldout else None, setup["tokenized"],
                                   setup["target_dir"], out, settings, previous=previous, threads=1,
                                   expected={"first_step": phase.first_step, "end_step": phase.end_step,
                                             "samples": list(phase.samples)}, **kw))
    return markers


def finish(setup, settings, out: Path, storage: str = "bfloat16") -> dict:
    plan, held = stream_plan(setup, settings)
    heldout = setup["index_of"](held, "heldout", storage) if held else None
    return train_final(out / "phases" / f"phase-{len(plan.phases) - 1}.json", heldout, setup["tokenized"],
                       setup["target_dir"], out, TrainSettings.from_config(train=dict(settings.train.to_dict()),
                                                                            drafter=DRAFTER), threads=1)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "trained" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    assert_same_weights_as(weights(a), b)


def assert_same_weights_as(wa: dict[str, torch.Tensor], b: Path) -> None:
    wb = weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_train_phase_settings_hold_exactly_the_stage_keys():
    """TrainPhaseSettings' fields are rule train_phase's keys in draftsmith.stages (output + runtime)."""
    from draftsmith.stages import STAGE_KEYS

    want = {section: set(kinds.get("output", ())) | set(kinds.get("runtime", ()))
            for section, kinds in STAGE_KEYS["train_phase"].items()}
    assert {section: set(keys) for section, keys in TrainPhaseSettings.keys().items()} == want
    with pytest.raises(ValueError, match="did you mean 'slices'"):
        TrainPhaseSettings.from_config(stream={"slice": 2})


# ------------------------------------------------------------------------------------------------------------
# phases = the offline run
# ------------------------------------------------------------------------------------------------------------

def test_phases_over_slices_train_the_offline_run_bit_for_bit(stream_setup, tmp_path):
    """S = 3 slices used once (R = 1), 2 epochs: 6 phases, each on its own slice's index, then the run's end, give
    the offline run's weights bit for bit (float32 on the CPU) and the same held-out history; the offline index
    lists the samples in another order than the rows (as several extraction shards do)."""
    settings = phase_settings(dict(TRAIN, epochs=2, save_every=2, time_phases=True), slices=3, reuse=1)
    rows = list(range(stream_setup["num_rows"]))
    offline_index = stream_setup["index_of"](rows[1::2] + rows[::2], "offline")
    offline = train(offline_index, stream_setup["target_dir"], tmp_path / "offline",
                    TrainSettings.from_config(train=settings.train.to_dict(), drafter=DRAFTER), threads=1)

    out = tmp_path / "stream"
    markers = run_phases(stream_setup, settings, out)
    plan, held = stream_plan(stream_setup, settings)
    assert len(markers) == 6 and [m["phase"] for m in markers] == list(range(6))
    assert markers[-1]["end_step"] == plan.total_steps == offline["steps"]
    assert len({m["fingerprint"] for m in markers}) == 1  # one run, one checkpoint folder
    for m in markers:
        marker = json.loads((out / "phases" / f"phase-{m['phase']}.json").read_text())
        assert marker == json.loads(json.dumps(m)) and marker["format"] == "draftsmith.train_phase/1"
        assert (out / marker["checkpoint"]["path"] / "state.json").is_file() or m["phase"] < 3  # pruned
        assert marker["last_train"]["step"] == marker["end_step"] and marker["rates"]["tokens_per_s"] > 0
    # pruning (keep_checkpoints 1) kept the boundaries a rerun of the last phase starts from
    (ckpts,) = (out / "checkpoints").glob("run-*")
    kept = sorted(int(p.name[5:]) for p in ckpts.glob("step-*"))
    assert {plan.phases[4].first_step, plan.phases[5].first_step, plan.total_steps} <= set(kept)

    state = finish(stream_setup, settings, out)
    assert_same_weights(tmp_path / "offline", out)
    assert [h["step"] for h in state["history"]] == [h["step"] for h in offline["history"]]
    assert [h["loss"] for h in state["history"]] == [h["loss"] for h in offline["history"]]
    assert state["steps_per_epoch"] == offline["steps_per_epoch"]
    assert state["rows_skipped_at_epoch_ends"] == offline["rows_skipped_at_epoch_ends"]
    assert state["samples"] == offline["samples"] and state["stream"]["phases"] == 6
    saved = json.loads((out / "trained" / "trainer_state.json").read_text())
    assert saved["heldout"]["loss"] == offline["heldout"]["loss"] and saved["fingerprint"] == markers[0]["fingerprint"]
    # train.time_phases (on in both runs): the stream run's trainer_state keeps its last phase's step times
    assert saved["step_phases_ms"] == markers[-1]["step_phases_ms"] and saved["step_phases_ms"]["steps"] >= 1
    assert offline["step_phases_ms"]["steps"] + offline["step_phases_ms"]["skipped"] == offline["steps"]

    # a rerun of the last phase (its end checkpoint gone) resumes from the kept boundary: the same weights again
    for step in kept:
        if step > plan.phases[5].first_step:
            shutil.rmtree(ckpts / f"step-{step:08d}")
    again = run_phases(stream_setup, settings, out, phases=[5])[0]
    assert again["resumed_from_step"] == plan.phases[5].first_step
    finish(stream_setup, settings, out)
    assert_same_weights(tmp_path / "offline", out)


def test_reused_slices_run_and_a_stopped_phase_resumes_to_the_same_weights(stream_setup, tmp_path):
    """R = 2, S = 2 (2 epochs: one pass, each slice trained twice). Phase 0 stopped inside (stop_after_steps),
    then run again, resumes from its checkpoint and ends where the uninterrupted run does: same weights after the
    run's end. A second run of a finished phase trains nothing (its end checkpoint is there)."""
    settings = phase_settings(dict(TRAIN, epochs=2, save_every=1, keep_checkpoints=2, eval_fraction=0.0),
                              slices=2, reuse=2)
    plan, held = stream_plan(stream_setup, settings)
    assert len(plan.phases) == 2 and held == []
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_phases(stream_setup, settings, whole)
    finish(stream_setup, settings, whole)

    middle = plan.phases[0].first_step + plan.phases[0].steps // 2
    stopped = run_phases(stream_setup, settings, cut, phases=[0], stop_after_steps=middle)[0]
    assert stopped == {"stopped_at": middle, "end_step": plan.phases[0].end_step}
    assert not (cut / "phases" / "phase-0.json").exists()
    markers = run_phases(stream_setup, settings, cut)
    assert markers[0]["resumed_from_step"] == middle and markers[1]["resumed_from_step"] == plan.phases[1].first_step
    again = run_phases(stream_setup, settings, cut, phases=[1])[0]
    assert again["resumed_from_step"] == plan.phases[1].end_step and again["last_train"] == markers[1]["last_train"]
    state = finish(stream_setup, settings, cut)
    assert state["heldout"] is None and state["steps"] == plan.total_steps
    assert_same_weights(whole, cut)


def test_a_resumed_phase_checks_its_slice_s_chunks(stream_setup, tmp_path, caplog):
    """Issue 46 item 3, stream mode: a phase stopped inside whose slice chunk is rewritten meanwhile (same size, other
    features) stops on resume, naming the chunk; put back, only that chunk is hashed again and the phase ends."""
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    settings = phase_settings(dict(TRAIN, epochs=2, save_every=1, keep_checkpoints=2, eval_fraction=0.0),
                              slices=2, reuse=2)
    plan, _ = stream_plan(stream_setup, settings)
    out = tmp_path / "checked"
    middle = plan.phases[0].first_step + plan.phases[0].steps // 2
    run_phases(stream_setup, settings, out, phases=[0], stop_after_steps=middle)
    folder = stream_setup["root"] / "bfloat16" / f"{out.name}-slice-0"
    chunk = folder / "shard-0" / "chunk-00001.safetensors"
    original = chunk.read_bytes()
    rewrite_chunk(chunk, lambda t: dict(t, hidden_states=t["hidden_states"] * 2), "bfloat16")
    assert chunk.stat().st_size == len(original)
    with pytest.raises(ValueError, match=rf"chunk 1 file {chunk} has sha256 .*; resuming run .* from step {middle}: "
                                         "its checkpoints are kept"):
        run_phases(stream_setup, settings, out, phases=[0])
    chunk.write_bytes(original)
    caplog.clear()
    marker = run_phases(stream_setup, settings, out, phases=[0])[0]
    assert marker["resumed_from_step"] == middle
    assert f"1 of {len(list(folder.glob('shard-0/chunk-*')))} chunk file(s) hashed" in caplog.text


def test_a_rerun_phase_trains_again_and_a_changed_slice_is_not_resumed(stream_setup, tmp_path, caplog):
    """Issue 33 item 6, stream mode. A finished phase whose marker is gone (Snakemake removes it to rerun the phase:
    --forcerun) trains its steps again from the previous phase's end, not from its own end checkpoint, and the run
    ends with the same weights bit for bit. A phase whose slice holds other values with the same counts (here its
    marker still in place) does not resume the checkpoints trained on the old slice: it trains again, and the run
    ends with other weights."""
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    settings = phase_settings(dict(TRAIN, epochs=2, save_every=1, keep_checkpoints=2, eval_fraction=0.0),
                              slices=2, reuse=2)
    plan, _ = stream_plan(stream_setup, settings)
    first, end = plan.phases[1].first_step, plan.phases[1].end_step
    out = tmp_path / "run"
    run_phases(stream_setup, settings, out)
    finish(stream_setup, settings, out)
    before = weights(out)

    caplog.clear()
    (out / "phases" / "phase-1.json").unlink()
    again = run_phases(stream_setup, settings, out, phases=[1])[0]
    assert again["resumed_from_step"] == first and again["last_train"]["step"] == end
    assert f"previous phase 1 finished at step {end} and its output ../../phases/phase-1.json is gone" in caplog.text
    assert "starting fresh" in caplog.text and "verified the sha256 of the chunk files of" in caplog.text
    finish(stream_setup, settings, out)
    assert_same_weights_as(before, out)

    # slice 1 with another loss mask in its first chunk (same samples, same counts); phase 1's marker in place
    slice1 = stream_setup["index_of"](list(plan.phases[1].samples), f"{out.name}-slice-1")
    rewrite_index_chunk(slice1, 0, lambda t: dict(t, loss_mask=torch.ones_like(t["loss_mask"])))
    caplog.clear()
    changed = run_phases(stream_setup, settings, out, phases=[1])[0]
    assert changed["resumed_from_step"] == first and changed["features_sha256"] != again["features_sha256"]
    assert "descends from another start or slice content" in caplog.text
    finish(stream_setup, settings, out)
    after = weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------------------------

def test_a_phase_refuses_what_is_not_its_own(stream_setup, tmp_path):
    """The world size must be train.gpus'; a phase needs the checkpoint its previous phase ended with; a previous
    marker of another run fingerprint, a plan record that differs and a slice lacking samples are refused."""
    settings = phase_settings(dict(TRAIN, epochs=1, eval_fraction=0.0), slices=3, reuse=1)
    plan, _ = stream_plan(stream_setup, settings)
    out = tmp_path / "run"
    slice_of = lambda p: stream_setup["index_of"](list(plan.phases[p].samples), f"refuse-slice-{p}")  # noqa: E731
    args = (stream_setup["tokenized"], stream_setup["target_dir"], out)

    with pytest.raises(ValueError, match=r"cut for train\.gpus = 2 \(2 process\(es\)\)"):
        train_phase(0, slice_of(0), None, *args, phase_settings(dict(TRAIN, gpus=2), 3, 1), threads=1)
    with pytest.raises(ValueError, match="gives first_step 0, the stream plan's record 5"):
        train_phase(0, slice_of(0), None, *args, settings, expected={"first_step": 5}, threads=1)
    with pytest.raises(ValueError, match="needs .* sample.* this index does not hold"):
        train_phase(1, slice_of(0), None, *args, settings, threads=1)

    run_phases(stream_setup, settings, out, phases=[0])
    end0 = plan.phases[0].end_step
    # phase 2 after phase 0: the only checkpoint is outside its range
    first2, last2 = plan.phases[2].first_step, plan.phases[2].end_step - 1
    with pytest.raises(ValueError, match=rf"trains steps {first2}\.\.{last2} .*\(checkpoints at steps \[{end0}\]\): "
                                         "run phase 1 first"):
        train_phase(2, slice_of(2), None, *args, settings, threads=1)
    # phase 1 with another learning rate: its run is not the one phase 0's marker names
    other = phase_settings(dict(TRAIN, epochs=1, eval_fraction=0.0, lr=1e-3), slices=3, reuse=1)
    with pytest.raises(ValueError, match=r"phase 0 trained run [0-9a-f]{12}, but phase 1's settings and data give "
                                         r"run [0-9a-f]{12}"):
        train_phase(1, slice_of(1), None, *args, other, previous=out / "phases" / "phase-0.json", threads=1)
    # a checkpoint at phase 1's start that is not the one phase 0's marker names
    marker = json.loads((out / "phases" / "phase-0.json").read_text())
    marker["checkpoint"]["state_sha256"] = "0" * 64
    (tmp_path / "forged.json").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="is not the 000000000000 phase 0's marker"):
        train_phase(1, slice_of(1), None, *args, settings, previous=tmp_path / "forged.json", threads=1)


# ------------------------------------------------------------------------------------------------------------
# float8 features: decoded in the step = decoded in the loader
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantised_in_the_step_equals_dequantised_in_the_loader(stream_setup, dtype):
    """On a GPU the loader keeps float8 features with their scales (half the bytes to copy) and the step decodes
    them on the device (PackedBatch.dequantize); on the CPU the loader decodes them. Both give the same batch bit
    for bit (here both on CPU tensors, through the same decoding function)."""
    rows = list(range(stream_setup["num_rows"]))
    index = FeatureIndex(stream_setup["index_of"](rows, "fp8", "float8_e4m3fn"))
    row = [(3, 40), (7, 17), (0, 5)]
    kw = dict(num_anchors=4, seed=11, feature_dtype=dtype, pad_tokens_to=128, pad_anchors_to=8)
    loader = make_batch(index, row, **kw)
    kept = make_batch(index, row, keep_fp8=True, **kw)
    assert kept.features.dtype == torch.float8_e4m3fn and kept.feature_scales.shape == (1, 128, len(LAYERS))
    assert kept.features.nbytes * (2 if dtype == torch.bfloat16 else 4) == loader.features.nbytes
    assert loader.feature_scales is None
    step = kept.dequantize(dtype)
    assert step.feature_scales is None and step.features.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(step.features.view(bits), loader.features.view(bits))  # bit for bit, the padding too
    for field in ("input_ids", "loss_mask", "doc_ids", "position_ids", "anchors", "anchor_valid", "target_token"):
        assert torch.equal(getattr(step, field), getattr(loader, field)), field
    assert loader.dequantize(dtype) is loader
    with pytest.raises(ValueError, match="dequantize"):
        from draftsmith.modeling import DFlashDraftModel
        DFlashDraftModel.training_forward(None, kept, None, None, gamma=1.0)


# ------------------------------------------------------------------------------------------------------------
# the command line the rules run
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_python_m_draftsmith_train_runs_phases_and_the_end(stream_setup, tmp_path):
    """``python -m draftsmith.train --phase P ...`` (scripts/train_phase.py's command, one process) for each phase,
    then ``--final <last marker>`` (scripts/train.py's in stream mode): markers, then trained/."""
    settings = phase_settings(dict(TRAIN, epochs=1), slices=2, reuse=1, heldout_samples=2)
    plan, held = stream_plan(stream_setup, settings)
    assert len(held) == 2
    heldout = stream_setup["index_of"](held, "cli-heldout").parent
    (tmp_path / "plan.json").write_text(json.dumps({"phases": [
        {"first_step": p.first_step, "end_step": p.end_step, "samples": list(p.samples)} for p in plan.phases]}))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    common = ["--tokenized", str(stream_setup["tokenized"]), "--heldout", str(heldout), "--target",
              str(stream_setup["target_dir"]), "--out", str(tmp_path / "drafter"), "--threads", "1"]
    for phase in plan.phases:
        index = stream_setup["index_of"](list(phase.samples), f"cli-slice-{phase.index}")
        marker = tmp_path / "drafter" / "phases" / f"phase-{phase.index}.json"
        cmd = [sys.executable, "-m", "draftsmith.train", "--phase", str(phase.index), "--index", str(index),
               "--plan", str(tmp_path / "plan.json"), "--marker", str(marker), *common,
               "--args", json.dumps(settings.to_dict())]
        if phase.index:
            cmd += ["--previous", str(marker.parent / f"phase-{phase.index - 1}.json")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(marker.read_text())["end_step"] == phase.end_step
    final = {k: v for k, v in settings.to_dict().items() if k != "stream"}
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train", "--final", str(marker), *common,
                           "--args", json.dumps(final)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "drafter" / "trained" / "trainer_state.json").read_text())
    assert state["steps"] == plan.total_steps and state["samples"]["heldout"] == 2 and state["heldout"]["loss"] > 0
    assert (tmp_path / "drafter" / "trained" / "config.json").is_file()
