"""train stage: feature reading, packing, schedule, checkpoints / resume, DDP, and the overfit gate.

Features are produced the way extraction produces them (``draftsmith.target.capture_layers`` on a tiny random
Qwen3 target, written as ``draftsmith.features/1`` chunks plus a ``draftsmith.index/1`` index), so the trainer reads
exactly the on-disk contract. The overfit gate trains on 8 target-generated samples and measures the acceptance
length with the official z-lab ``dflash_generate`` (real speculative decoding against the target).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.features import FeatureIndex
from draftsmith.target import capture_layers
from draftsmith.train import (
    BatchPlan,
    Prefetcher,
    TrainSettings,
    expected_acceptance_length,
    load_latest_checkpoint,
    lr_factor,
    make_batch,
    pack_documents,
    pack_rows,
    split_samples,
    train,
)
from extraction import rewrite_chunk, rewrite_index_chunk
from tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]
MASK = 3  # an id the tiny targets never generate in these tests' prompts (prompts use ids >= 5)


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------

def greedy_continuation(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, P + n]``: the target's greedy continuation of ``prompt`` (no stop token)."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


def make_samples(target, num: int, prompt_len: int, gen_len: int, seed: int = 0) -> list[dict]:
    """Target-generated samples: random prompt (loss mask 0) + greedy continuation (loss mask 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        prompt = torch.randint(5, 500, (1, prompt_len), generator=g)
        ids = greedy_continuation(target, prompt, gen_len)[0]
        mask = torch.zeros_like(ids, dtype=torch.int8)
        mask[prompt_len:] = 1
        out.append({"input_ids": ids, "loss_mask": mask, "prompt_len": prompt_len})
    return out


def write_features(folder: Path, target, layer_ids: list[int], samples: list[dict], *, per_chunk: int = 3,
                   storage_dtype: str = "bfloat16", target_tokens: bool = True, top_k: int = 0) -> Path:
    """Extract features of ``samples`` with hooks and write chunks + ``index.json`` (the merge contract); ``top_k``
    > 0 also stores the target's top-k next tokens and their log-probabilities (``target_top_k`` in the index)."""
    from draftsmith.features import LAYER_SEMANTICS, index_document, write_chunk, write_index

    folder.mkdir(parents=True, exist_ok=True)
    H = target.config.hidden_size
    chunks = []
    for c0 in range(0, len(samples), per_chunk):
        part = list(range(c0, min(c0 + per_chunk, len(samples))))
        hs, ids, lm, tt, lengths, topk = [], [], [], [], [], []
        for i in part:
            x = samples[i]["input_ids"][None]
            with torch.no_grad(), capture_layers(target, layer_ids) as cap:
                logits = target(x).logits
                feats = cap.features()[0]
            hs.append(feats)
            ids.append(samples[i]["input_ids"])
            lm.append(samples[i]["loss_mask"])
            tt.append(logits[0].argmax(-1))
            topk.append(logits[0].float().log_softmax(-1).topk(max(top_k, 1), dim=-1))
            lengths.append(x.shape[1])
        name = f"shard-0/chunk-{c0 // per_chunk:05d}.safetensors"
        digest = write_chunk(folder / name, features=torch.cat(hs), lengths=lengths, sample_index=part,
                             input_ids=torch.cat(ids), loss_mask=torch.cat(lm), storage_dtype=storage_dtype,
                             target_token=torch.cat(tt) if target_tokens else None, num_layers=len(layer_ids),
                             target_topk_ids=torch.cat([t.indices for t in topk]) if top_k else None,
                             target_topk_logprobs=torch.cat([t.values for t in topk]) if top_k else None)
        chunks.append({"path": name, "shard": 0, "sha256": digest, "num_samples": len(part),
                       "num_tokens": sum(lengths), "bytes": (folder / name).stat().st_size, "rows": part})
    index = index_document({
        "chunks": chunks, "num_samples": len(samples), "num_tokens": sum(c["num_tokens"] for c in chunks),
        "bytes": sum(c["bytes"] for c in chunks), "layer_ids": layer_ids, "layer_semantics": LAYER_SEMANTICS,
        "hidden_size": H, "num_target_layers": target.config.num_hidden_layers, "storage_dtype": storage_dtype,
        "has_target_token": target_tokens, "target_fingerprint": "test", "tokenizer_fingerprint": "test",
        "chat_template_kwargs": {}, "layer_stats": {}, **({"target_top_k": top_k} if top_k else {})})
    write_index(folder / "index.json", index)
    return folder / "index.json"


def save_target(target, folder: Path) -> Path:
    target.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread (and 2 shared CI cores oversubscribe badly); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY_TRAIN = {"tokens_per_batch": 128, "num_anchors": 16, "lr": 3e-3, "warmup_ratio": 0.1, "eval_fraction": 0.0,
              "save_every": 1000, "eval_every": 1000, "log_every": 5, "grad_clip": 1.0, "labels": "target",
              "prefetch": 2}
TINY_DRAFTER = {"num_layers": 1, "block_size": 4, "mask_token_id": MASK, "target_layer_ids": [1, 2]}


@pytest.fixture(scope="module")
def qwen3_setup(tmp_path_factory):
    """A tiny Qwen3 target folder and features of 8 target-generated samples (8 + 40 tokens).

    ``initializer_range=0.1``: with the default 0.02 the frozen random LM head gives logits so flat that no
    drafter can reach a near-zero loss in a few hundred steps (real heads are far sharper)."""
    root = tmp_path_factory.mktemp("qwen3")
    target = tiny_target("qwen3", initializer_range=0.1)
    samples = make_samples(target, 8, 8, 40, seed=1)
    index = write_features(root / "features", target, [1, 2], samples)
    return {"target": target, "target_dir": save_target(target, root / "target"), "index": index,
            "samples": samples, "root": root}


# ------------------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_feature_index_reads_each_sample_exactly(tmp_path, storage):
    target = tiny_target("qwen3")
    samples = make_samples(target, 5, 4, 6)
    index_path = write_features(tmp_path, target, [0, 3], samples, per_chunk=2, storage_dtype=storage)
    index = FeatureIndex(index_path)
    assert [s.row for s in index.samples] == [0, 1, 2, 3, 4]
    for ref, sample in zip(index.samples, samples):
        got = index.read(ref, dtype=torch.float32)
        x = sample["input_ids"][None]
        with torch.no_grad(), capture_layers(target, [0, 3]) as cap:
            logits = target(x).logits
            want = cap.features()[0]
        assert torch.equal(got["input_ids"], sample["input_ids"])
        assert torch.equal(got["loss_mask"], sample["loss_mask"].bool())
        assert torch.equal(got["target_token"], logits[0].argmax(-1))
        tol = 0.02 if storage == "bfloat16" else 0.07  # relative: bf16 rounding, fp8 e4m3 rounding
        assert ((got["features"] - want).abs() <= tol * want.abs() + 1e-3).all()
    part = index.read(index.samples[1], length=3)
    assert part["input_ids"].tolist() == samples[1]["input_ids"][:3].tolist()


def test_feature_index_errors_name_the_file(tmp_path):
    target = tiny_target("qwen3")
    index_path = write_features(tmp_path, target, [1], make_samples(target, 2, 4, 4))
    meta = json.loads(index_path.read_text())
    chunk = tmp_path / meta["chunks"][0]["path"]
    tensors = load_file(str(chunk))
    del tensors["loss_mask"]
    save_file(tensors, str(chunk))
    with pytest.raises(ValueError, match=r"chunk-00000\.safetensors: tensor 'loss_mask' is missing"):
        FeatureIndex(index_path)
    chunk.unlink()
    with pytest.raises(FileNotFoundError, match="chunk 0"):
        FeatureIndex(index_path)


def test_a_truncated_chunk_is_an_input_error_naming_it(tmp_path):
    from draftsmith.features import read_chunk
    from draftsmith.io import InputError

    target = tiny_target("qwen3")
    index_path = write_features(tmp_path, target, [1], make_samples(target, 2, 4, 4))
    chunk = tmp_path / json.loads(index_path.read_text())["chunks"][0]["path"]
    chunk.write_bytes(chunk.read_bytes()[:-100])  # a copy cut short
    for read in (read_chunk, FeatureIndex):
        with pytest.raises(InputError) as info:
            read(chunk if read is read_chunk else index_path)
        message = str(info.value)
        assert message.startswith(f"{chunk}: cannot be read (SafetensorError: "), message
        assert "expected a whole safetensors chunk file written by rule extract_shard" in message
        assert "delete its shard folder and rerun extract" in message


@pytest.mark.parametrize("field, edit, says", [
    ("chunks[1].num_samples", lambda m: m["chunks"][1].update(num_samples=3), "says 3 but"),
    ("chunks[0].num_tokens", lambda m: m["chunks"][0].update(num_tokens=m["chunks"][0]["num_tokens"] + 1), "says"),
    ("chunks[0].rows", lambda m: m["chunks"][0].update(rows=[0, 9]), "says [0, 9]..."),
    ("chunks[1].bytes", lambda m: m["chunks"][1].update(bytes=7), "says 7 but"),
    ("num_samples", lambda m: m.update(num_samples=4), "says 4 but its chunks hold 3"),
    ("num_tokens", lambda m: m.update(num_tokens=1), "says 1 but its chunks hold"),
    ("chunks[0]", lambda m: m["chunks"][0].pop("rows"), "chunk 0 lacks ['rows']"),
])
def test_a_hand_edited_index_is_refused_naming_the_field(tmp_path, field, edit, says):
    """index.json is held to the chunk files it lists (their sizes and headers), not taken on its word."""
    from draftsmith.io import InputError

    target = tiny_target("qwen3")
    index_path = write_features(tmp_path, target, [1], make_samples(target, 3, 4, 4), per_chunk=2)
    FeatureIndex(index_path)  # as merge wrote it: accepted
    meta = json.loads(index_path.read_text())
    edit(meta)
    index_path.write_text(json.dumps(meta))
    with pytest.raises(InputError) as info:
        FeatureIndex(index_path)
    assert info.value.field == field
    assert str(info.value).startswith(f"{index_path}: field {field!r}: {says}")
    assert "rerun merge" in str(info.value)


def test_packing_and_split_reconcile():
    lengths = [5, 9, 3, 12, 7, 1, 20]
    rows = pack_rows(lengths, list(range(len(lengths))), capacity=12)
    assert all(sum(n for _, n in r) <= 12 for r in rows)
    assert sorted(s for r in rows for s, _ in r) == list(range(len(lengths)))  # every sample exactly once
    assert [n for r in rows for s, n in r if s == 6] == [12]  # a longer sample is cut to the capacity
    train_ids, held = split_samples(list(range(50)), 0.1, seed=3)
    assert len(held) == 5 and sorted(train_ids + held) == list(range(50))
    assert split_samples(list(range(50)), 0.1, seed=3) == (train_ids, held)
    assert len(split_samples(list(range(8)), 0.02, seed=0)[1]) == 1  # a positive fraction holds out at least one
    # the split follows the tokenized rows, not the index order (which depends on extract.shards)
    rows = [int(r) for r in torch.randperm(50, generator=torch.Generator().manual_seed(1))]
    tr2, held2 = split_samples(rows, 0.1, seed=3)
    assert [rows[i] for i in held2] == held and [rows[i] for i in tr2] == train_ids


def test_batch_plan_epochs_cover_every_sample_once():
    lengths = [int(x) for x in torch.randint(5, 60, (40,), generator=torch.Generator().manual_seed(0))]
    train_ids = list(range(3, 40))
    plan = BatchPlan(lengths, train_ids, 64, seed=1, world=2, grad_accum=2, epochs=3)
    counts = [len(plan.rows(e)) for e in range(3)]
    assert len(set(counts)) > 1  # the packing (so the step count) differs between epochs
    assert plan.steps_per_epoch == [c // 4 for c in counts] and plan.total_steps == sum(plan.steps_per_epoch)
    for e in range(3):
        assert sorted(s for row in plan.rows(e) for s, _ in row) == train_ids  # each sample once per epoch
    items = list(plan.items(0, plan.total_steps, 0)) + list(plan.items(0, plan.total_steps, 1))
    assert len(items) == plan.total_steps * 4
    for e in range(3):  # every rank's micro-batches of an epoch are distinct rows, leftovers are counted
        used = sorted(r for _, ep, r in items if ep == e)
        assert used == list(range(plan.steps_per_epoch[e] * 4))
    assert plan.skipped_rows == sum(counts) - 4 * plan.total_steps
    assert plan.locate(plan.steps_per_epoch[0]) == (1, 0)
    assert (BatchPlan(lengths, train_ids, 64, seed=1, world=2, grad_accum=2, epochs=1.5).steps_per_epoch
            == [plan.steps_per_epoch[0], -(-plan.steps_per_epoch[1] // 2)])
    assert BatchPlan(lengths, train_ids, 64, seed=1, world=2, grad_accum=2, epochs=1, max_steps=7).total_steps == 7
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        BatchPlan(lengths, train_ids[:2], 64, seed=1, world=2, grad_accum=2, epochs=1)


def test_make_batch_documents_positions_and_anchors(qwen3_setup):
    index = FeatureIndex(qwen3_setup["index"])
    batch = make_batch(index, [(0, 48), (1, 48)], num_anchors=5, seed=0, feature_dtype=torch.float32,
                       pad_tokens_to=128, pad_anchors_to=8)
    assert batch.input_ids.shape == (1, 128) and batch.features.shape == (1, 128, 128)
    assert batch.doc_ids[0, :48].eq(0).all() and batch.doc_ids[0, 48:96].eq(1).all()
    assert batch.doc_ids[0, 96:].eq(-1).all() and not batch.loss_mask[0, 96:].any()
    assert batch.position_ids[0, 48].item() == 0 and batch.position_ids[0, 95].item() == 47
    a = batch.anchors[0][batch.anchor_valid[0]]
    assert a.numel() == 10 and batch.anchors.shape[1] == 16  # 5 per document, padded to a multiple of 8
    assert (batch.loss_mask[0, a] & batch.loss_mask[0, a + 1]).all()
    assert torch.equal(batch.doc_ids[0, a], batch.doc_ids[0, a + 1])
    # max_anchors_per_row: a uniform, sorted subset of the same eligible anchors, reproducible from the seed
    capped = make_batch(index, [(0, 48), (1, 48)], num_anchors=5, seed=0, feature_dtype=torch.float32,
                        max_anchors_per_row=3)
    c = capped.anchors[0][capped.anchor_valid[0]]
    assert c.numel() == 3 and torch.equal(c, torch.sort(c).values) and set(c.tolist()) <= set(a.tolist())
    again = make_batch(index, [(0, 48), (1, 48)], num_anchors=5, seed=0, feature_dtype=torch.float32,
                       max_anchors_per_row=3)
    assert torch.equal(again.anchors, capped.anchors)


def test_pack_documents_packs_the_target_topk_with_padding_zero():
    """Documents with the target's top-k: the packed row carries target_topk_ids [1, S, k] int32 and
    target_topk_logprobs [1, S, k] float16 (as the features store them), each document at its offset, the padding 0;
    without them, None."""
    lengths, k = [3, 5, 2], 4
    g = torch.Generator().manual_seed(0)
    parts = [{"features": torch.randn(n, 6, generator=g), "input_ids": torch.randint(3, 50, (n,), generator=g),
              "loss_mask": torch.ones(n, dtype=torch.bool), "target_token": torch.randint(3, 50, (n,), generator=g),
              "target_topk_ids": torch.randint(3, 50, (n, k), generator=g, dtype=torch.int32),
              "target_topk_logprobs": -torch.rand(n, k, generator=g).cumsum(1).half()} for n in lengths]
    batch = pack_documents(parts, width=6, num_anchors=2, seed=0, feature_dtype=torch.float32, pad_tokens_to=16)
    assert batch.target_topk_ids.shape == batch.target_topk_logprobs.shape == (1, 16, k)
    assert batch.target_topk_ids.dtype == torch.int32 and batch.target_topk_logprobs.dtype == torch.float16
    for p, o in zip(parts, (0, 3, 8)):
        n = p["input_ids"].numel()
        assert torch.equal(batch.target_topk_ids[0, o:o + n], p["target_topk_ids"])
        assert torch.equal(batch.target_topk_logprobs[0, o:o + n], p["target_topk_logprobs"])
        assert torch.equal(batch.target_token[0, o:o + n], p["target_token"])
    assert not batch.target_topk_ids[0, 10:].any() and not batch.target_topk_logprobs[0, 10:].any()
    plain = pack_documents([{key: v for key, v in p.items() if not key.startswith("target_topk")} for p in parts],
                           width=6, num_anchors=2, seed=0, feature_dtype=torch.float32)
    assert plain.target_topk_ids is None and plain.target_topk_logprobs is None


def test_make_batch_reads_the_target_topk_of_the_features(tmp_path):
    """make_batch over features that store the target's top-k (target_top_k 3 in the index): each packed document's
    rows are the target's top 3 of its logits alone, column 0 its target token, when the run trains on them
    (``soft_labels``); a run on the greedy token does not read them, and an index without them packs None."""
    target = tiny_target("qwen3")
    samples = make_samples(target, 3, 4, 6)
    index = FeatureIndex(write_features(tmp_path / "k3", target, [1, 2], samples, per_chunk=2, top_k=3))
    assert index.target_top_k == 3
    batch = make_batch(index, [(0, 10), (2, 7)], num_anchors=2, seed=0, feature_dtype=torch.float32,
                       pad_tokens_to=32, soft_labels=True)
    greedy = make_batch(index, [(0, 10), (2, 7)], num_anchors=2, seed=0, feature_dtype=torch.float32,
                        pad_tokens_to=32)
    assert greedy.target_topk_ids is None and greedy.target_topk_logprobs is None
    assert torch.equal(greedy.features, batch.features) and torch.equal(greedy.target_token, batch.target_token)
    for row, o, n in ((0, 0, 10), (2, 10, 7)):
        with torch.no_grad():
            want = target(samples[row]["input_ids"][None]).logits[0, :n].float().log_softmax(-1).topk(3, dim=-1)
        assert torch.equal(batch.target_topk_ids[0, o:o + n].long(), want.indices)
        torch.testing.assert_close(batch.target_topk_logprobs[0, o:o + n].float(), want.values, rtol=2 ** -10,
                                   atol=1e-4)
        assert torch.equal(batch.target_topk_ids[0, o:o + n, 0].long(), batch.target_token[0, o:o + n])
    assert not batch.target_topk_ids[0, 17:].any() and not batch.target_topk_logprobs[0, 17:].any()
    plain = FeatureIndex(write_features(tmp_path / "k0", target, [1, 2], samples, per_chunk=2))
    assert plain.target_top_k == 0 and "target_top_k" not in plain.meta
    assert make_batch(plain, [(0, 10)], num_anchors=2, seed=0, feature_dtype=torch.float32,
                      soft_labels=True).target_topk_ids is None


def test_lr_schedule_and_expected_tau():
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[99] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_acceptance_length([0.0, 1.0]) == 1.0


# ------------------------------------------------------------------------------------------------------------
# checkpoints and resume
# ------------------------------------------------------------------------------------------------------------

def settings(train_cfg: dict, drafter: dict = TINY_DRAFTER) -> TrainSettings:
    """The trainer's settings: ``train_cfg`` and ``drafter`` over the schema defaults."""
    return TrainSettings.from_config(train=train_cfg, drafter=drafter)


def test_train_settings_hold_exactly_the_stage_keys():
    """TrainSettings' fields are rule train's keys in draftsmith.stages (output + runtime), no more, no fewer."""
    from draftsmith.stages import STAGE_KEYS

    want = {section: set(kinds.get("output", ())) | set(kinds.get("runtime", ()))
            for section, kinds in STAGE_KEYS["train"].items()}
    assert {section: set(keys) for section, keys in TrainSettings.keys().items()} == want
    with pytest.raises(ValueError, match="did you mean 'warmup_ratio'"):
        TrainSettings.from_config(train={"warmup_ratios": 0.1})


def test_run_fingerprint_is_pinned():
    """The run fingerprint names the checkpoint folder (run-<fingerprint[:12]>): the same configuration and data
    must keep it, or a rerun would not resume its own checkpoints. The hex changed once on purpose, when the
    features' content (the digest of the chunk files' sha256) joined it (issue 33 item 6). A configuration that
    names the earlier recipe (AdamW, fixed decay) keeps it; one that leaves the recipe to the defaults (Muon +
    D-PACE since they became the defaults) is another run, whose AdamW checkpoints it must not resume. Cadence keys
    and ``gpus`` (it enters as the world size) leave it alone; so do the chunks' order and paths; one chunk's sha256
    does not, and an index chunk without one is refused. In stream mode (a plan identity) the slice's chunks stay
    out: every phase shares the fingerprint."""
    from draftsmith.train import run_fingerprint

    train_cfg = {"gpus": 2, "seed": 7, "epochs": 1.5, "max_steps": None, "lr": 3e-3, "weight_decay": 0.01,
                 "warmup_ratio": 0.02, "grad_clip": 1.0, "tokens_per_batch": 1024, "grad_accum": 2, "num_anchors": 32,
                 "max_anchors_per_row": 256, "activation_checkpointing": True, "loader_workers": 4,
                 "progress_interval": 30, "logits_chunk_mib": 512, "loss_gamma": 7.0, "labels": "target",
                 "save_every": 200, "eval_every": 100, "eval_fraction": 0.02, "min_lr_ratio": 0.1,
                 "keep_checkpoints": 3, "prefetch": 4, "attention": "flex", "compile": True, "log_every": 10,
                 "optimizer": "adamw", "loss_weighting": "exp"}
    drafter_config = {"target_layer_ids": [1, 2], "mask_token_id": 3, "block_size": 4}
    meta = {"num_samples": 8, "num_tokens": 384, "layer_ids": [1, 2], "target_fingerprint": "test",
            "tokenizer_fingerprint": "test", "storage_dtype": "bfloat16", "chunks": []}
    pinned = "7f8b60695b293d7da5fef012c3c0d6b8a5de8c292fd776032cc704259118199b"
    assert run_fingerprint(drafter_config, TrainSettings.from_config(train=train_cfg).train, meta, 2) == pinned
    cadence = dict(train_cfg, save_every=7, loader_workers=1, gpus=1, log_every=1, keep_checkpoints=1)
    assert run_fingerprint(drafter_config, TrainSettings.from_config(train=cadence).train, meta, 2) == pinned
    assert run_fingerprint(drafter_config, TrainSettings.from_config(train=dict(train_cfg, lr=1e-3)).train, meta,
                           2) != pinned
    assert run_fingerprint(drafter_config, TrainSettings.from_config(train=train_cfg).train, meta, 1) != pinned

    options = TrainSettings.from_config(train=train_cfg).train
    a, b = {"path": "shard-0/chunk-00000.safetensors", "sha256": "a" * 64}, {"path": "shard-1/x", "sha256": "b" * 64}
    two = run_fingerprint(drafter_config, options, dict(meta, chunks=[a, b]), 2)
    assert two != pinned
    assert run_fingerprint(drafter_config, options, dict(meta, chunks=[dict(b, path="y"), a]), 2) == two
    assert run_fingerprint(drafter_config, options, dict(meta, chunks=[a, dict(b, sha256="c" * 64)]), 2) != two
    with pytest.raises(ValueError, match=r"chunk 1 \(shard-1/x\) has no sha256"):
        run_fingerprint(drafter_config, options, dict(meta, chunks=[a, {"path": "shard-1/x"}]), 2)
    # the recipe keys added later (D-PACE, Muon) keep a run at the earlier recipe where it was, whatever the keys
    # only the other recipe reads; choosing that recipe is another run
    fp = lambda **kw: run_fingerprint(drafter_config, TrainSettings.from_config(train=dict(train_cfg, **kw)).train,  # noqa: E731
                                      meta, 2)
    assert fp(loss_weighting="exp", dpace_alpha=0.3, optimizer="adamw", muon_lr=1e-2, muon_weight_decay=0) == pinned
    assert fp(selector_stop_gradient=False) == pinned  # a DFlash drafter has no selector
    dflash2 = dict(drafter_config, architectures=["DFlash2DraftModel"])
    fp2 = lambda **kw: run_fingerprint(dflash2, TrainSettings.from_config(train=dict(train_cfg, **kw)).train,  # noqa: E731
                                       meta, 2)
    assert fp2(selector_stop_gradient=True) == fp2() != fp2(selector_stop_gradient=False)
    # DFlash2 with AdamW keeps the fingerprint it had before the selector's stop-gradient became a key; with Muon it
    # changed once, when the selector's codebooks left Muon for AdamW (2026-12-04; it was ba3972aabd1a...)
    assert fp2(optimizer="adamw") == "1a9d9b154df03da5b9da63bcadad809f1c06564ed4bd0395294c355c68393bca"
    assert fp2(optimizer="muon") == "02b74710346ebfa5d02b0bdfa59c5747881d0f3748b96fc9df4833dcb9bdfb12"
    assert len({pinned, fp(loss_weighting="dpace"), fp(loss_weighting="dpace", dpace_alpha=0.3), fp(optimizer="muon"),
                fp(optimizer="muon", muon_lr=1e-2)}) == 5
    defaults = {k: v for k, v in train_cfg.items() if k not in ("optimizer", "loss_weighting")}
    assert (run_fingerprint(drafter_config, TrainSettings.from_config(train=defaults).train, meta, 2)
            == fp(optimizer="muon", loss_weighting="dpace") != pinned)
    plan = {"stream": {"slices": 2}, "lengths_sha256": "0" * 64}
    assert (run_fingerprint(drafter_config, options, dict(meta, chunks=[a]), 2, plan)
            == run_fingerprint(drafter_config, options, dict(meta, chunks=[b]), 2, plan))

def test_resume_reaches_the_same_weights(qwen3_setup, tmp_path):
    cfg = dict(TINY_TRAIN, max_steps=8, save_every=3, eval_fraction=0.15, eval_every=4, grad_accum=2,
               tokens_per_batch=64)
    a, b = tmp_path / "a", tmp_path / "b"
    train(qwen3_setup["index"], qwen3_setup["target_dir"], a, settings(cfg), threads=1)
    stopped = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(cfg), threads=1,
                    stop_after_steps=5)
    assert stopped["stopped_at"] == 5 and not (b / "trained").exists()
    (ckpts,) = (b / "checkpoints").glob("run-*")  # one folder per configuration
    found = load_latest_checkpoint(ckpts)
    assert found is not None and found[1]["step"] == 5
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000003", "step-00000005"]
    # a killed writer leaves a temporary folder and a truncated file: neither may be accepted
    junk = ckpts / ".step-00000006.tmp-999"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\0" * 10)
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(cfg), threads=1)
    assert state["resumed_from_step"] == 5 and state["steps"] == 8
    wa = load_file(str(a / "trained" / "model.safetensors"))
    wb = load_file(str(b / "trained" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    sa = json.loads((a / "trained" / "trainer_state.json").read_text())
    assert sa["heldout"]["loss"] == pytest.approx(state["heldout"]["loss"], rel=1e-6)
    assert sa["samples"]["train"] + sa["samples"]["heldout"] == sa["samples"]["total"] == 8
    # checkpoints at 3, 5 | 6, 8 (final); the newest 2 kept. A corrupted newest one falls back to the previous.
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000006", "step-00000008"]
    newest = ckpts / "step-00000008"
    (newest / "optimizer.safetensors").write_bytes(b"broken")
    assert load_latest_checkpoint(ckpts)[1]["step"] == 6
    # a changed configuration (Snakemake reruns train on changed params) starts fresh, never resumes another
    # configuration's checkpoint, and leaves it in place
    state2 = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(dict(cfg, lr=1e-4, max_steps=2)),
                   threads=1)
    assert state2["resumed_from_step"] == 0 and len(list((b / "checkpoints").glob("run-*"))) == 2
    assert ckpts.is_dir()
    assert any((a / "tensorboard").iterdir())


def test_resume_at_the_final_step_keeps_every_metric(qwen3_setup, tmp_path):
    """A rerun that finds the run's final checkpoint trains no step; its trainer_state.json keeps the last
    training line all the same (it was ``{}``)."""
    cfg = dict(TINY_TRAIN, max_steps=4, log_every=2, tokens_per_batch=64, time_phases=True)
    first = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg), threads=1)
    assert first["resumed_from_step"] == 0 and first["last_train"]["step"] == 4
    # train.time_phases: each step's time by phase; on the CPU the host's (4 steps, none left out of 10 warm-up)
    phases = first["step_phases_ms"]
    assert phases["steps"] == 4 and phases["skipped"] == 0 and "gpu_ms" not in phases
    assert list(phases["host_ms"]) == ["fetch", "h2d", "forward", "backward", "metrics", "clip", "optimizer",
                                       "check", "zero_grad", "log", "step"]
    assert sum(v for k, v in phases["host_ms"].items() if k != "step") <= phases["host_ms"]["step"] * 1.5
    again = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg), threads=1)
    assert again["resumed_from_step"] == 4
    assert again["last_train"] == first["last_train"]
    assert again["history"] == first["history"] and again["memory_by_phase_gib"] == first["memory_by_phase_gib"]
    assert again["step_phases_ms"] == first["step_phases_ms"]  # kept by the checkpoint, like the memory


def test_profile_steps_trace_a_window_of_steps_and_change_nothing_trained(qwen3_setup, tmp_path):
    """``train.profile_steps``: a torch.profiler trace of that many steps after the warm-up (earlier in a short run)
    lands in ``<out>/profile/`` (a gzipped Chrome trace holding the phase markers, a summary whose phases are the
    trainer's with host time in the forward and backward); ``train.time_phases`` leaves the profiled steps out of
    its medians; the weights equal an unprofiled run's bit for bit."""
    from draftsmith.train.profile import profile_window

    assert profile_window(0, 30, 5) == (11, 15)  # after the compile warm-up
    assert profile_window(0, 8, 3) == (6, 8) and profile_window(20, 24, 10) == (21, 24)  # short runs: the last
    assert profile_window(0, 30, 0) is None and profile_window(5, 5, 3) is None
    cfg = dict(TINY_TRAIN, max_steps=6, tokens_per_batch=64, time_phases=True)
    a, b = tmp_path / "a", tmp_path / "b"
    train(qwen3_setup["index"], qwen3_setup["target_dir"], a, settings(cfg), threads=1)
    traced = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(dict(cfg, profile_steps=2)),
                   threads=1)
    assert not (a / "profile").exists()
    # time_phases leaves the slowed steps out of its medians: the warm-up step 4, steps 5-6 (and a 7th, writing)
    assert traced["step_phases_ms"]["steps"] == 3
    summary = json.loads((b / "profile" / "summary.json").read_text())
    assert summary["steps"] == [5, 6] and summary["cuda"] is False
    assert {"fetch", "h2d", "forward", "backward", "clip", "check", "optimizer"} <= set(summary["phases"])
    assert summary["phases"]["forward"]["host_op_ms"] > 0 and summary["phases"]["backward"]["host_op_ms"] > 0
    assert summary["per_step"]["wall_ms"] > 0 and summary["per_step"]["gpu_busy_ms"] is None
    assert any(r["name"].startswith("aten::") for r in summary["top_host_ops"])
    text = (b / "profile" / "summary.txt").read_text()
    assert text.startswith("steps [5, 6]: a step ") and "forward" in text
    with gzip.open(b / "profile" / "trace.json.gz", "rt") as fh:
        trace = json.load(fh)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "draftsmith.mark.0" in names and any(str(n).startswith("aten::") for n in names)
    wa = load_file(str(a / "trained" / "model.safetensors"))
    wb = load_file(str(b / "trained" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_profile_summary_places_each_kernel_in_the_phase_that_launched_it():
    """The profile's summary on a GPU's events (made here: no GPU in CI): a kernel counts in the phase its runtime
    launch fell in, even when it runs in a later phase; the GPU's busy time is the union of the kernels' intervals;
    a kernel without a runtime call is placed by its own start."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from draftsmith.train.profile import MARK_PREFIX, describe, summarize

    def ev(name, start, end, device=DeviceType.CPU, id=0, annotation=False, self_cpu=0.0, thread=1, kind=None):
        return SimpleNamespace(name=name, device_type=device, id=id, is_user_annotation=annotation, thread=thread,
                               time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=self_cpu,
                               activity_type=kind or ("kernel" if device == DeviceType.CUDA else "cpu_op"))

    marks = [(1, "start"), (1, "forward"), (1, "backward"), (2, "start"), (2, "forward"), (2, "backward"),
             (3, "start")]
    at = [0, 1000, 3000, 4000, 5000, 7000, 8000]  # µs
    events = [ev(f"{MARK_PREFIX}{i}", t, t, annotation=True) for i, t in enumerate(at)]
    events += [ev("aten::mm", 100, 400, self_cpu=200.0), ev("cudaLaunchKernel", 150, 160, id=7),
               ev("cudaLaunchKernel", 900, 910, id=8), ev("cudaLaunchKernel", 5100, 5110, id=9),
               # kernel 7 and 8 launched in step 1's forward; 8 runs during its backward
               ev("gemm", 200, 700, DeviceType.CUDA, id=7), ev("gemm", 1500, 2500, DeviceType.CUDA, id=8),
               ev("softmax", 2000, 2600, DeviceType.CUDA, id=10),  # no runtime call: placed by its start
               ev("gemm", 5200, 6200, DeviceType.CUDA, id=9),
               # a copy (not a kernel: the copy engine), and a loader thread's host work (not the loop's)
               ev("cudaMemcpyAsync", 4100, 4110, id=11), ev("Memcpy HtoD", 4200, 4600, DeviceType.CUDA, id=11,
                                                            kind="gpu_memcpy"),
               ev("aten::pin_memory", 4100, 4900, self_cpu=800.0, thread=2)]
    summary = summarize(events, marks, cuda=True)
    assert summary["steps"] == [1, 2] and summary["kernels_by_launch"] == "3 of 4"
    # a step: 1's kernels 0.5 + 1.0 + 0.6 ms (busy 0.5 + 1.1), 2's 1.0 ms: medians of the two steps
    assert summary["per_step"] == {"wall_ms": 4.0, "kernel_ms": 1.55, "gpu_busy_ms": 1.3, "kernels": 2.0,
                                   "copy_ms": 0.2}
    assert list(summary["phases"]) == ["forward", "backward"]
    # forward: step 1's kernels 7 and 8 (1.5 ms; 8 ran in the backward) and aten::mm's 0.2 ms of host time; backward:
    # the softmax (by its start) and step 2's kernel 9 (launched after step 2's forward mark); per step of two
    assert summary["phases"]["forward"] == {"kernels": 1.0, "kernel_ms": 0.75, "host_op_ms": 0.1,
                                            "top": [{"name": "gemm", "count": 1.0, "ms": 0.75}]}
    assert summary["phases"]["backward"] == {"kernels": 1.0, "kernel_ms": 0.8, "host_op_ms": 0.0,
                                             "top": [{"name": "gemm", "count": 0.5, "ms": 0.5},
                                                     {"name": "softmax", "count": 0.5, "ms": 0.3}]}
    assert [k["name"] for k in summary["top_kernels"]] == ["gemm", "softmax"]
    summary["syncs"] = {"after h2d | draftsmith/modeling.py:700 tgt = labels.view(-1)[flat]": 2}
    text = describe(summary)
    assert "GPU busy 1.3 ms" in text and "2 synchronising calls" in text and "modeling.py:700" in text
    # the profiler's warm-up step is traced, not summarised
    warm = summarize(events, marks, cuda=True, leave_out=(1,))
    assert warm["steps"] == [2] and warm["per_step"]["kernel_ms"] == 1.0 and warm["per_step"]["wall_ms"] == 4.0


def test_muon_and_dpace_learn_resume_exactly_and_are_another_run(qwen3_setup, tmp_path, caplog):
    """``train.optimizer: muon`` with ``train.loss_weighting: dpace`` (speculators' DFlash recipe): the held-out loss
    falls; a run stopped at step 5 resumes to the uninterrupted run's weights, bit for bit (Muon's momentum and
    AdamW's moments come back from the checkpoint); the Muon group peaks at ``train.muon_lr``; and the recipe is
    part of the run's identity: the AdamW / fixed-decay run's checkpoints in the same folder are not resumed."""
    cfg = dict(TINY_TRAIN, max_steps=8, save_every=3, eval_fraction=0.15, eval_every=4, tokens_per_batch=64,
               optimizer="muon", muon_lr=2e-2, loss_weighting="dpace", dpace_alpha=0.5)
    a, b = tmp_path / "a", tmp_path / "b"
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        done = train(qwen3_setup["index"], qwen3_setup["target_dir"], a, settings(cfg), threads=1)
    assert re.search(r"slot weights D-PACE \(alpha 0\.5\), Muon \(\d+ matrices, lr 0\.02\) \+ AdamW", caplog.text)
    assert done["loss_weighting"] == "dpace" and done["optimizer"] == "muon"
    assert done["history"][0]["step"] == 4 and done["heldout"]["loss"] < done["history"][0]["loss"]
    (ckpts,) = (a / "checkpoints").glob("run-*")
    groups = json.loads((ckpts / "step-00000006" / "state.json").read_text())["optimizer"]["param_groups"]
    assert sorted(g["peak_lr"] for g in groups) == [cfg["lr"], cfg["muon_lr"]]
    stopped = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(cfg), threads=1, stop_after_steps=5)
    assert stopped["stopped_at"] == 5
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], b, settings(cfg), threads=1)
    assert state["resumed_from_step"] == 5
    wa = load_file(str(a / "trained" / "model.safetensors"))
    wb = load_file(str(b / "trained" / "model.safetensors"))
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    plain = train(qwen3_setup["index"], qwen3_setup["target_dir"], b,
                  settings(dict(cfg, optimizer="adamw", loss_weighting="exp")), threads=1)
    assert plain["resumed_from_step"] == 0 and len(list((b / "checkpoints").glob("run-*"))) == 2
    wc = load_file(str(b / "trained" / "model.safetensors"))
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_soft_labels_train_on_the_targets_topk_and_only_when_asked(qwen3_setup, tmp_path, caplog):
    """``train.labels: target_topk`` on features holding the target's top 4: the run learns (held-out loss falls),
    says so in its log and trainer_state, and trains other weights than the greedy labels; a ``target`` run on those
    features does not read the top-k and equals, bit for bit, the run on the same features without them; a soft-label
    run on features without a top-k is refused before training, naming the features and the key to set."""
    k4 = write_features(tmp_path / "k4", qwen3_setup["target"], [1, 2], qwen3_setup["samples"], top_k=4)
    cfg = dict(TINY_TRAIN, max_steps=8, eval_fraction=0.15, eval_every=4, tokens_per_batch=64)
    target = qwen3_setup["target_dir"]
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        soft = train(k4, target, tmp_path / "soft", settings(dict(cfg, labels="target_topk")), threads=1)
    assert "labels the target's top-k distribution" in caplog.text
    assert soft["labels"] == "target_topk" and soft["heldout"]["loss"] < soft["history"][0]["loss"]
    hard_k4 = train(k4, target, tmp_path / "hard-k4", settings(cfg), threads=1)
    hard = train(qwen3_setup["index"], target, tmp_path / "hard", settings(cfg), threads=1)
    assert hard_k4["labels"] == hard["labels"] == "target"
    w = {name: load_file(str(tmp_path / name / "trained" / "model.safetensors"))
         for name in ("soft", "hard-k4", "hard")}
    assert all(torch.equal(w["hard-k4"][key], w["hard"][key]) for key in w["hard"])
    assert any(not torch.equal(w["soft"][key], w["hard"][key]) for key in w["hard"])
    with pytest.raises(ValueError, match=rf"{re.escape(str(qwen3_setup['index']))}: train.labels is target_topk but "
                                         r"the features hold no top-k of the target's next-token distribution: "
                                         r"extract them with extract.store_target_topk >= 2"):
        train(qwen3_setup["index"], target, tmp_path / "refused", settings(dict(cfg, labels="target_topk")),
              threads=1)
    # train.labels_topk: the first 2 of the 4 stored tokens train as features holding the top 2 do, bit for bit;
    # more than the features hold is refused before training
    k2 = write_features(tmp_path / "k2", qwen3_setup["target"], [1, 2], qwen3_setup["samples"], top_k=2)
    narrow = train(k4, target, tmp_path / "k4-first-2", settings(dict(cfg, labels="target_topk", labels_topk=2)),
                   threads=1)
    train(k2, target, tmp_path / "k2-all", settings(dict(cfg, labels="target_topk")), threads=1)
    w2, w4 = (load_file(str(tmp_path / name / "trained" / "model.safetensors")) for name in ("k2-all", "k4-first-2"))
    assert all(torch.equal(w2[key], w4[key]) for key in w2)
    assert narrow["heldout"]["loss"] != soft["heldout"]["loss"]
    assert narrow["soft_label_tokens"] == 2 and soft["soft_label_tokens"] == 4 and "soft_label_tokens" not in hard
    with pytest.raises(ValueError, match=r"train.labels_topk is 8 but the features hold the target's top 4"):
        train(k4, target, tmp_path / "too-wide", settings(dict(cfg, labels="target_topk", labels_topk=8)), threads=1)


def test_muon_state_refuses_another_split_of_the_parameters(qwen3_setup):
    """A Muon + AdamW state loads only into the same split (the fingerprint keeps other recipes apart; this is the
    second guard)."""
    from draftsmith.train import MuonAdamW, make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opts = settings(dict(TINY_TRAIN, optimizer="muon")).train
    opt, params = make_optimizer(model, opts, on_gpu=False)
    assert isinstance(opt, MuonAdamW) and len(params) == 4
    assert opt.optimizers[1].ns_dtype == torch.float32  # off the GPU: no emulated bf16 products
    sum(p.sum() for p in params).backward()
    opt.step()
    other, _ = make_optimizer(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), opts, on_gpu=False)
    with pytest.raises(ValueError, match="parameter groups do not match"):
        other.load_state_dict(opt.state_dict())
    again, _ = make_optimizer(model, opts, on_gpu=False)
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.optimizers[1].state[model[0].weight]["momentum_buffer"],
                       opt.optimizers[1].state[model[0].weight]["momentum_buffer"])


def test_muon_leaves_the_dflash2_codebooks_to_adamw():
    """Muon takes the drafter's hidden-layer matrices (attention, MLP, fc, the convolutions' and the selector's
    projections), AdamW the norms, the static kernels and the selector's vocabulary-sized codebooks (rows looked up
    per token, as an embedding's: speculators 0.9.0 and Muon's authors keep those on AdamW)."""
    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.modeling_dflash2 import DFlash2DraftModel
    from draftsmith.train import MuonAdamW, make_optimizer

    target = tiny_target("qwen3")
    cfg = build_drafter_config(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 2], mask_token_id=5,
                               architecture="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
    model = DFlash2DraftModel(cfg)
    opt, _ = make_optimizer(model, settings(dict(TINY_TRAIN, optimizer="muon")).train, on_gpu=False)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    adamw, muon = ({names[id(p)] for g in o.param_groups for p in g["params"]} for o in opt.optimizers)
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "layers.0.attention_conv.base_kernel"} <= adamw
    assert {"candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight",
            "layers.0.self_attn.q_proj.weight", "fc.weight"} <= muon
    assert not any("codebook" in n or "norm" in n for n in muon)


def _save_args(tmp_path: Path):
    from types import SimpleNamespace

    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(3)
    opt.step()
    model = SimpleNamespace(trainable_state_dict=lambda: {"w": weight.detach().clone()})
    return tmp_path / "run-x", model, opt


def test_a_failed_checkpoint_save_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import errno

    from draftsmith.io import DiskFullError
    from draftsmith.train import checkpoint

    ckpt_dir, model, opt = _save_args(tmp_path)
    checkpoint.save_checkpoint(ckpt_dir, 1, model, opt, {"fingerprint": "x"})
    before = sorted(p.name for p in ckpt_dir.iterdir())
    real = checkpoint.save_file

    def failing(error):
        def save(tensors, path, metadata=None):
            if path.endswith("optimizer.safetensors"):
                raise error
            real(tensors, path, metadata=metadata)
        return save

    monkeypatch.setattr(checkpoint, "save_file", failing(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        checkpoint.save_checkpoint(ckpt_dir, 2, model, opt, {"fingerprint": "x"})
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before == ["latest.json", "step-00000001"]
    monkeypatch.setattr(checkpoint, "save_file", failing(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(DiskFullError) as info:
        checkpoint.save_checkpoint(ckpt_dir, 2, model, opt, {"fingerprint": "x"})
    assert f"writing {ckpt_dir / 'step-00000002' / 'optimizer.safetensors'} (" in str(info.value)
    assert " bytes free on " in str(info.value)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before
    assert load_latest_checkpoint(ckpt_dir)[1]["step"] == 1  # the earlier checkpoint is untouched
    # safetensors reports a full disk as SafetensorError, not OSError (issue 46 item 2): the same DiskFullError
    from safetensors import SafetensorError

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(checkpoint, "save_file", failing(full))
    with pytest.raises(DiskFullError) as info:
        checkpoint.save_checkpoint(ckpt_dir, 2, model, opt, {"fingerprint": "x"})
    assert f"writing {ckpt_dir / 'step-00000002' / 'optimizer.safetensors'} (" in str(info.value)
    assert " bytes free on " in str(info.value) and isinstance(info.value.__cause__, SafetensorError)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before
    # state.json (written through atomic_path, whose error names the temporary folder) is named under its final name
    monkeypatch.setattr(checkpoint, "save_file", real)
    from draftsmith import io

    def full_replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io.os, "replace", full_replace)
    with pytest.raises(DiskFullError, match=rf"writing {re.escape(str(ckpt_dir / 'step-00000002' / 'state.json'))} "):
        checkpoint.save_checkpoint(ckpt_dir, 2, model, opt, {"fingerprint": "x"})
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == before


def test_a_save_killed_midway_leaves_a_temporary_folder_the_next_run_removes(qwen3_setup, tmp_path, caplog):
    """Issue 46 item 2: kill -9 during a checkpoint save leaves ``.step-N.tmp-<pid>@<host>`` (a checkpoint's size:
    230 MB on the tiny model, ~10 GB at 27B). The next run of train removes it (its writer's pid is not running),
    in every run folder, and names it in the log; the checkpoints themselves stay."""
    from draftsmith.io import HOST

    caplog.set_level(logging.INFO, logger="draftsmith")
    cfg = dict(TINY_TRAIN, max_steps=4, save_every=2, tokens_per_batch=64)
    out = tmp_path / "drafter"
    assert train(qwen3_setup["index"], qwen3_setup["target_dir"], out, settings(cfg), threads=1,
                 stop_after_steps=2)["stopped_at"] == 2
    (ckpts,) = (out / "checkpoints").glob("run-*")
    other = out / "checkpoints" / "run-0123456789ab"  # another configuration's folder
    code = ("import os, signal, sys, torch\n"
            "from draftsmith.train import checkpoint\n"
            "real = checkpoint.save_file\n"
            "def save(tensors, path, metadata=None):\n"
            "    real(tensors, path, metadata=metadata)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 after the first file\n"
            "checkpoint.save_file = save\n"
            "w = torch.nn.Parameter(torch.ones(1000))\n"
            "opt = torch.optim.AdamW([w])\n"
            "model = type('M', (), {'trainable_state_dict': lambda self: {'w': w.detach()}})()\n"
            "checkpoint.save_checkpoint(__import__('pathlib').Path(sys.argv[1]), 3, model, opt, {})\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(ckpts)], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -9, err[-3000:]
    left = [ckpts / f".step-00000003.tmp-{proc.pid}@{HOST}", other / f".step-00000001.tmp-{proc.pid}@{HOST}"]
    assert [p.name for p in ckpts.glob(".step-*")] == [left[0].name] and (left[0] / "model.safetensors").is_file()
    shutil.copytree(left[0], left[1])
    caplog.clear()
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], out, settings(cfg), threads=1)
    assert state["resumed_from_step"] == 2
    assert not left[0].exists() and not left[1].exists()
    for folder in left:
        assert f"{folder} (" in caplog.text
    assert caplog.text.count(f"pid {proc.pid} is not running on {HOST}") == 2
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004"]


def test_the_run_identity_covers_the_features_content_and_a_rerun_of_a_finished_run_trains(qwen3_setup, tmp_path,
                                                                                           caplog):
    """Issue 33 item 6. A finished run whose trained/ is gone (Snakemake removes a rule's outputs before it reruns
    it: --forcerun train) trains from step 0 again (and, on the CPU, reaches the same weights bit for bit); with
    trained/ in place a direct call has nothing to train. A run stopped at step 2 of 4 still resumes from step 2.
    Features rewritten with the same counts (one chunk's loss mask) are another run: fresh, other weights. A byte
    changed in a chunk file after merge stops a fresh start, naming the file and both sha256."""
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    cfg = dict(TINY_TRAIN, max_steps=4, save_every=2, tokens_per_batch=64)
    index, target, out = qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path / "drafter"
    weights = lambda: load_file(str(out / "trained" / "model.safetensors"))  # noqa: E731
    first = train(index, target, out, settings(cfg), threads=1)
    assert first["resumed_from_step"] == 0
    w1 = weights()
    (ckpts,) = (out / "checkpoints").glob("run-*")
    record = json.loads((ckpts / "finished-run.json").read_text())
    assert record["step"] == 4 and record["output"] == "../../trained/trainer_state.json"

    caplog.clear()  # trained/ in place: nothing to train
    assert train(index, target, out, settings(cfg), threads=1)["resumed_from_step"] == 4
    assert "previous run finished at step 4 and its output is in place: nothing left to train" in caplog.text

    caplog.clear()  # trained/ gone (what Snakemake does before rerunning train): fresh, not the old final checkpoint
    shutil.rmtree(out / "trained")
    again = train(index, target, out, settings(cfg), threads=1)
    assert again["resumed_from_step"] == 0 and again["last_train"]["step"] == 4
    assert ("previous run finished at step 4 and its output ../../trained/trainer_state.json is gone" in caplog.text
            and "starting fresh (removed its checkpoints at steps [2, 4])" in caplog.text)
    assert "verified the sha256 of the chunk files of" in caplog.text
    w2 = weights()
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)

    caplog.clear()  # an interrupted run (stopped at step 2 of 4, no trained/) resumes from its checkpoint
    shutil.rmtree(out / "trained")
    assert train(index, target, out, settings(cfg), threads=1, stop_after_steps=2)["stopped_at"] == 2
    assert not (ckpts / "finished-run.json").exists()
    resumed = train(index, target, out, settings(cfg), threads=1)
    assert resumed["resumed_from_step"] == 2 and "resuming interrupted run from step 2 of 4" in caplog.text
    w3 = weights()
    assert all(torch.equal(w1[k], w3[k]) for k in w1)

    # the same counts, another loss mask in chunk 0 (the prompts supervised too): a new run, other weights
    changed = tmp_path / "changed"
    shutil.copytree(index.parent, changed)
    rewrite_index_chunk(changed / "index.json", 0, lambda t: dict(t, loss_mask=torch.ones_like(t["loss_mask"])))
    meta = json.loads((changed / "index.json").read_text())
    assert (meta["num_samples"], meta["num_tokens"]) == (json.loads(index.read_text())["num_samples"],
                                                         json.loads(index.read_text())["num_tokens"])
    caplog.clear()
    other = train(changed / "index.json", target, out, settings(cfg), threads=1)
    assert other["resumed_from_step"] == 0 and other["fingerprint"] != first["fingerprint"]
    assert len(list((out / "checkpoints").glob("run-*"))) == 2
    held = sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())  # the first run's folder, kept
    assert held > 0 and (f"1 checkpoint folder(s) of other configurations or data hold {held / 1e9:.2f} GB in "
                         f"{out / 'checkpoints'}") in caplog.text and f"{ckpts.name} {held / 1e9:.2f} GB" in caplog.text
    w4 = weights()
    assert any(not torch.equal(w1[k], w4[k]) for k in w1)

    # a byte changed in chunk 1 after merge (the index still records the old sha256): a fresh start refuses it
    chunk = changed / meta["chunks"][1]["path"]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    shutil.rmtree(out / "trained")
    with pytest.raises(ValueError, match=rf"chunk 1 file {re.escape(str(chunk))} has sha256 [0-9a-f]{{64}}, the "
                                         rf"index records {meta['chunks'][1]['sha256']}"):
        train(changed / "index.json", target, out, settings(cfg), threads=1)


def test_a_resume_checks_the_chunks_it_reads(qwen3_setup, tmp_path, monkeypatch, caplog):
    """Issue 46 item 3: the chunk files are verified on a resume too, as cheaply as it must. A fresh start hashes every
    chunk and records each one's sha256, size and mtime in the run's checkpoint folder; a resume hashes only the
    chunks whose size or mtime differ from that record. A chunk rewritten (same size, other features) while the run
    was interrupted stops the resume naming the chunk and what to do; on main it was trained on silently."""
    from draftsmith import features as features_module

    caplog.set_level(logging.INFO, logger="draftsmith.train")
    folder = tmp_path / "features"
    shutil.copytree(qwen3_setup["index"].parent, folder)
    index, target, out = folder / "index.json", qwen3_setup["target_dir"], tmp_path / "drafter"
    meta = json.loads(index.read_text())
    chunks = [folder / c["path"] for c in meta["chunks"]]
    hashed = []
    real = features_module.sha256_file
    monkeypatch.setattr(features_module, "sha256_file", lambda path, **kw: hashed.append(Path(path)) or real(path))
    cfg = dict(TINY_TRAIN, max_steps=6, save_every=2, tokens_per_batch=64)

    assert train(index, target, out, settings(cfg), threads=1, stop_after_steps=2)["stopped_at"] == 2
    assert sorted(hashed) == chunks  # a fresh start: every chunk
    (ckpts,) = (out / "checkpoints").glob("run-*")
    record = json.loads((ckpts / "verified-chunks.json").read_text())
    entry = record["chunks"][str(chunks[1].resolve())]
    assert entry["sha256"] == meta["chunks"][1]["sha256"] and entry["bytes"] == chunks[1].stat().st_size
    assert entry["mtime_ns"] == chunks[1].stat().st_mtime_ns

    hashed.clear()  # resumed, nothing changed: no chunk hashed
    assert train(index, target, out, settings(cfg), threads=1, stop_after_steps=4)["stopped_at"] == 4
    assert hashed == [] and "resuming interrupted run from step 2 of 6" in caplog.text
    assert f"0 of {len(chunks)} chunk file(s) hashed" in caplog.text

    # chunk 1 rewritten while the run was interrupted: same size and counts, other features
    original = chunks[1].read_bytes()
    rewrite_chunk(chunks[1], lambda t: dict(t, hidden_states=t["hidden_states"] * 2), meta["storage_dtype"])
    assert chunks[1].stat().st_size == len(original) and chunks[1].read_bytes() != original
    hashed.clear()
    with pytest.raises(ValueError, match=rf"chunk 1 file {re.escape(str(chunks[1]))} has sha256 [0-9a-f]{{64}}, the "
                                         rf"index records {meta['chunks'][1]['sha256']}.*resuming run") as info:
        train(index, target, out, settings(cfg), threads=1)
    assert "its checkpoints are kept" in str(info.value)
    assert hashed == [chunks[1]]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004"]

    # the file put back (a new mtime, the same bytes): hashed again once, then the run resumes and finishes
    chunks[1].write_bytes(original)
    hashed.clear()
    state = train(index, target, out, settings(cfg), threads=1)
    assert state["resumed_from_step"] == 4 and hashed == [chunks[1]]


def test_a_rerun_of_a_finished_run_over_a_damaged_chunk_keeps_its_checkpoints(qwen3_setup, tmp_path):
    """Issue 46: ``--forcerun train`` (trained/ removed) over a chunk damaged after merge fails on its sha256 before
    anything of the finished run is removed: its checkpoints and its record stay (main removed them first)."""
    folder = tmp_path / "features"
    shutil.copytree(qwen3_setup["index"].parent, folder)
    index, target, out = folder / "index.json", qwen3_setup["target_dir"], tmp_path / "drafter"
    cfg = dict(TINY_TRAIN, max_steps=4, save_every=2, tokens_per_batch=64)
    train(index, target, out, settings(cfg), threads=1)
    (ckpts,) = (out / "checkpoints").glob("run-*")
    before = sorted(p.name for p in ckpts.iterdir())
    assert "finished-run.json" in before and "step-00000004" in before
    meta = json.loads(index.read_text())
    chunk = folder / meta["chunks"][0]["path"]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    shutil.rmtree(out / "trained")
    with pytest.raises(ValueError, match=rf"chunk 0 file {re.escape(str(chunk))} has sha256 .*; rerunning the "
                                         rf"finished run {re.escape(str(ckpts))}: its checkpoints are kept"):
        train(index, target, out, settings(cfg), threads=1)
    assert sorted(p.name for p in ckpts.iterdir()) == before


@pytest.mark.parametrize("recipe", [{"optimizer": "adamw", "loss_weighting": "exp", "selector_stop_gradient": True},
                                    {"loss_weighting": "dpace", "selector_stop_gradient": True}, {}],
                         ids=["adamw", "muon-dpace", "defaults"])
def test_dflash2_trains_through_the_trainer_and_exports(official, qwen3_setup, tmp_path, recipe):
    """drafter.architecture dflash2: the same trainer trains the backbone, the convolutions and the selector (every
    new module leaves its initialisation, with AdamW and with Muon + D-PACE), reports the selector's held-out
    metrics, and exports a folder the official DFlash2DraftModel loads."""
    from draftsmith.export import ExportSettings, export_drafter

    drafter = dict(TINY_DRAFTER, architecture="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
    cfg = dict(TINY_TRAIN, max_steps=6, eval_fraction=0.25, **recipe)
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg, drafter), threads=1)
    assert state["architecture"] == "DFlash2DraftModel" and math.isfinite(state["heldout"]["loss"])
    assert state["selector_stop_gradient"] is recipe.get("selector_stop_gradient", False)
    if not recipe:  # DFlash2's defaults: speculators' recipe (its soft labels need top-k features: not these)
        assert (state["loss_weighting"], state["gamma"], state["optimizer"]) == ("exp", 4.0, "muon")
    heldout = state["heldout"]
    assert len(heldout["selector_accuracy_per_position"]) == 3 and heldout["selector_tau_expected"] >= 1.0
    assert all(0.0 <= r <= 1.0 for r in heldout["candidate_recall_per_position"])
    w = load_file(str(tmp_path / "trained" / "model.safetensors"))
    assert w["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0  # zero at initialisation
    assert w["layers.0.mlp_conv.base_kernel"][:, 1].abs().sum() > 0  # the second tap: zero at initialisation
    export_drafter(tmp_path / "trained", qwen3_setup["target_dir"], tmp_path / "final",
                   ExportSettings.from_config(drafter={"export_dtype": "float32"}))
    ref = official.DFlash2DraftModel.from_pretrained(str(tmp_path / "final")).eval()
    assert torch.equal(ref.candidate_selector.predecessor_codebook.weight,
                       w["candidate_selector.predecessor_codebook"])


@pytest.mark.slow
def test_torchrun_ddp_gloo_two_processes(qwen3_setup, tmp_path):
    """The rule's shape: torchrun with 2 CPU processes (gloo) running ``python -m draftsmith.train``."""
    args = {"train": dict(TINY_TRAIN, max_steps=4, tokens_per_batch=64, eval_fraction=0.15),
            "drafter": TINY_DRAFTER, "target": {}}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "draftsmith.train", "--index", str(qwen3_setup["index"]), "--target",
           str(qwen3_setup["target_dir"]), "--out", str(tmp_path), "--threads", "2", "--args", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "trained" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["steps"] == 4
    assert "Newton-Schulz split over 2 ranks" in proc.stderr  # ShardedMuon: each rank orthogonalises its share
    last = state["last_train"]
    assert last["step"] == 4 and last["window_tokens_per_s"] > 0 and last["model_tflops_per_gpu"] > 0
    assert state["peak_memory_gib"] is None  # CPU
    assert len(list((tmp_path / "checkpoints").glob("run-*/step-00000004/state.json"))) == 1
    cfg = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2], "mask_token_id": MASK, "block_size": 4}


HOLDER = r"""
import sys
from draftsmith.io import lock_folder
lock_folder(sys.argv[1], what="the checkpoint folder")
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_second_writer_to_a_checkpoint_folder_is_refused(tmp_path):
    """While a run holds <out>/checkpoints (writer.lock, flock'ed, with its pid and host), python -m draftsmith.train
    into the same folder stops before it reads or writes anything, naming the holder; once the holder is gone the
    folder is free at once (the next run gets past the lock to its inputs)."""
    import socket

    ckpt = tmp_path / "out" / "checkpoints"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    record = json.loads((ckpt / "writer.lock").read_text())
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    cmd = [sys.executable, "-m", "draftsmith.train", "--index", str(tmp_path / "missing-index.json"), "--target",
           str(tmp_path / "no-target"), "--out", str(tmp_path / "out"), "--args", "{}"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 1
    assert (f"the checkpoint folder {ckpt} is written by another run: pid {holder.pid} on host "
            f"{socket.gethostname()} holds {ckpt / 'writer.lock'}") in second.stderr
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["checkpoints", "writer.lock"]
    holder.communicate("\n", timeout=30)
    after = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert after.returncode != 0 and "written by another run" not in after.stderr
    assert "missing-index.json" in after.stderr  # it got past the lock to its inputs
    assert json.loads((ckpt / "writer.lock").read_text())["pid"] != holder.pid  # the new run's record


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_torchrun_ddp_nccl_two_gpus(qwen3_setup, tmp_path):
    """The rule's shape on two GPUs: NCCL bound to each rank's GPU, gradients as views into DDP's buckets; both
    ranks report their peak memory and the step rates."""
    args = {"train": dict(TINY_TRAIN, max_steps=6, tokens_per_batch=64, eval_fraction=0.15, log_every=3),
            "drafter": TINY_DRAFTER, "target": {}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "draftsmith.train", "--index", str(qwen3_setup["index"]), "--target",
           str(qwen3_setup["target_dir"]), "--out", str(tmp_path), "--args", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "trained" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["steps"] == 6
    assert len(state["peak_memory_gib"]) == 2 and all(p > 0 for p in state["peak_memory_gib"])
    assert state["last_train"]["model_tflops_per_gpu"] > 0 and math.isfinite(state["last_train"]["loss"])


# ------------------------------------------------------------------------------------------------------------
# overfit gate: near-zero loss, then real speculative decoding with the official package
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_overfit_gate_acceptance_with_official_dflash_generate(official, qwen3_setup, tmp_path, monkeypatch):
    dm = official
    from draftsmith.export import ExportSettings, export_drafter

    cfg = dict(TINY_TRAIN, max_steps=300, lr=1e-2, warmup_ratio=0.05, num_anchors=64, tokens_per_batch=96)
    drafter = dict(TINY_DRAFTER, num_layers=2)
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg, drafter), threads=1)
    assert state["last_train"]["loss"] < 0.05, state["last_train"]
    export_drafter(tmp_path / "trained", qwen3_setup["target_dir"], tmp_path / "final",
                   ExportSettings.from_config(drafter={"export_dtype": "float32"}))

    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # its timing calls assume CUDA; semantics untouched
    model = dm.DFlashDraftModel.from_pretrained(str(tmp_path / "final")).eval()
    target = qwen3_setup["target"]
    try:  # draftsmith's own speculative decoder (evaluate stage), with our model class
        from draftsmith.evaluate.decode import DFlashProposer, speculative_generate
        from draftsmith.modeling import DFlashDraftModel
        ours = DFlashDraftModel.from_pretrained(tmp_path / "final")
    except ImportError:
        speculative_generate = None
    taus, taus_own = [], []
    for sample in qwen3_setup["samples"]:
        p = sample["prompt_len"]
        prompt = sample["input_ids"][None, :p]
        n_new = sample["input_ids"].numel() - p
        out = dm.dflash_generate(model, target, prompt, n_new, None, return_stats=True)
        # lossless: speculative output is the target's own greedy continuation
        assert out.output_ids[0].tolist() == sample["input_ids"].tolist()
        taus.append(sum(out.acceptance_lengths) / len(out.acceptance_lengths))
        if speculative_generate is not None:
            res = speculative_generate(target, DFlashProposer(ours, target), prompt, max_new_tokens=n_new)
            assert res.tokens == sample["input_ids"][p:].tolist()
            assert res.committed == out.acceptance_lengths  # same decode, step by step
            taus_own.append(res.tau)
    tau = sum(taus) / len(taus)
    block = drafter["block_size"]
    print(f"overfit gate: tau = {tau:.3f} (block {block}), per sample {[round(t, 2) for t in taus]}; "
          f"draftsmith decoder: {[round(t, 2) for t in taus_own]}")
    assert tau >= 0.8 * block, taus
    assert not taus_own or sum(taus_own) / len(taus_own) >= 0.8 * block, taus_own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_compiled_gpu_training_learns_and_resumes(qwen3_setup, tmp_path, architecture):
    """The GPU path the shipped configs take (bf16 autocast, compiled layers and flex_attention BlockMask,
    pinned prefetch, anchor buckets), for DFlash and DFlash2 drafters: the training loss falls far below chance,
    held-out metrics come out, and a run stopped after a checkpoint resumes to the planned step count; with
    ``train.time_phases`` each phase has a GPU time (CUDA events) and the phases fill the step."""
    cfg = dict(TINY_TRAIN, max_steps=60, lr=1e-2, eval_fraction=0.25, eval_every=30, compile=True,
               save_every=30, time_phases=True)
    drafter = TINY_DRAFTER if architecture == "dflash" else dict(
        TINY_DRAFTER, architecture="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
    stopped = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg, drafter), threads=2,
                    stop_after_steps=30)
    assert stopped == {"stopped_at": 30, "total_steps": 60}
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg, drafter), threads=2)
    assert state["resumed_from_step"] == 30 and state["steps"] == 60 and state["device"].startswith("cuda")
    assert [h["step"] for h in state["history"]] == [30, 60] and math.isfinite(state["heldout"]["loss"])
    chance = math.log(qwen3_setup["target"].config.vocab_size)  # the loss of a uniform guess
    assert state["last_train"]["loss"] < 0.75 * chance, (state["last_train"], chance)  # H200: 3.44 vs 6.24
    assert (tmp_path / "trained" / "model.safetensors").is_file()
    phases = state["step_phases_ms"]
    assert phases["steps"] == 20 and phases["skipped"] == 10  # the resumed process's 30 steps
    gpu = phases["gpu_ms"]
    assert set(gpu) == set(phases["host_ms"]) and gpu["forward"] > 0 and gpu["backward"] > 0
    assert 0.5 * gpu["step"] <= sum(v for k, v in gpu.items() if k != "step") <= 1.5 * gpu["step"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_steps_on_the_gpu_place_kernels_by_phase_and_find_the_syncs(qwen3_setup, tmp_path):
    """``train.profile_steps`` on the compiled GPU path: kernels are found and placed by their launches (forward and
    backward both launch some), the GPU's busy time is at most a step's wall time, and the synchronising calls
    include the trainer's one read a step (the finite-loss check), named by its draftsmith line."""
    cfg = dict(TINY_TRAIN, max_steps=16, compile=True, profile_steps=3)
    state = train(qwen3_setup["index"], qwen3_setup["target_dir"], tmp_path, settings(cfg), threads=2)
    assert state["steps"] == 16
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["steps"] == [11, 12, 13] and summary["cuda"] is True
    per = summary["per_step"]
    assert per["kernels"] > 0 and 0 < per["gpu_busy_ms"] <= per["kernel_ms"] + 1e-6 <= per["wall_ms"] * 1.5
    launched, total = (int(x) for x in summary["kernels_by_launch"].split(" of "))
    assert total > 0 and launched >= 0.9 * total, summary["kernels_by_launch"]
    assert summary["phases"]["forward"]["kernels"] > 0 and summary["phases"]["backward"]["kernels"] > 0
    assert any("draftsmith/train/" in where for where in summary["syncs"]), summary["syncs"]
    print((tmp_path / "profile" / "summary.txt").read_text())


def test_prefetcher_keeps_the_order_with_several_workers_and_reraises():
    """Several loader threads finish out of order (random delays); batches still come in the items' order, and
    a failing item's exception reaches the training loop."""
    import random
    import time as _time

    def make(i):
        _time.sleep(random.random() * 0.01)
        if i == 37:
            raise ValueError("row 37 is broken")
        return i

    pf = Prefetcher(list(range(30)), make, depth=6, workers=4)
    assert list(pf) == list(range(30))
    pf.close()
    pf = Prefetcher(list(range(50)), make, depth=6, workers=4)
    got = []
    with pytest.raises(ValueError, match="row 37"):
        for x in pf:
            got.append(x)
    pf.close()
    assert got == list(range(37))


def test_throughput_windows_leave_out_evaluation_and_count_flops(monkeypatch):
    """Window rates cover only the steps since the last log line or skip (held-out evaluation, checkpoint); the
    overall rate covers everything since the loop started; model TFLOP/s are per GPU."""
    from draftsmith.train import metrics as train_module

    clock = iter([100.0, 102.0, 110.0, 111.0, 112.0])
    monkeypatch.setattr(train_module.time, "time", lambda: next(clock))
    t = train_module.Throughput(torch.device("cpu"))  # t = 100
    t.add(1000, 4e12)
    first = t.rates(world=2)  # t = 102: 1000 tokens in 2 s
    assert first == {"tokens_per_s": 500.0, "window_tokens_per_s": 500.0, "model_tflops_per_gpu": 1.0}
    t.skip()  # t = 110: an 8 s evaluation is not training
    t.add(300, 1e12)
    t.add(300, 1e12)
    second = t.rates(world=2)  # t = 111: 600 tokens in 1 s of training; 1600 tokens in 11 s overall
    assert second["window_tokens_per_s"] == pytest.approx(600.0)
    assert second["tokens_per_s"] == pytest.approx(1600 / 11)
    assert second["model_tflops_per_gpu"] == pytest.approx(1.0)
    assert t.rates(world=1)["window_tokens_per_s"] == 0.0  # t = 112: an empty window


def test_step_memory_keeps_the_run_peak_across_phase_resets():
    """StepMemory resets the allocator's peak at every phase: the run's peak (what trainer_state reports per rank)
    must survive those resets, and each phase must report its own peak and what it left allocated."""
    from draftsmith.train import StepMemory

    gib = 2 ** 30
    counters = {"now": 0, "peak": 0}

    def alloc(n):
        counters["now"] += n
        counters["peak"] = max(counters["peak"], counters["now"])

    def reset():
        counters["peak"] = counters["now"]

    mem = StepMemory(allocated=lambda: counters["now"], peak=lambda: counters["peak"], reset=reset)
    alloc(50 * gib)          # a first step peaked at 50 GiB ...
    alloc(-20 * gib)         # ... and left 30 GiB (weights, optimizer state)
    mem.start()
    alloc(25 * gib)          # forward: activations
    mem.mark("forward")
    alloc(10 * gib)          # backward: gradients on top, then the activations go
    alloc(-25 * gib)
    mem.mark("backward")
    alloc(3 * gib)           # optimizer temporaries
    alloc(-3 * gib)
    mem.mark("optimizer")
    mem.mark("forward")      # a second micro-batch's phase gets its own name
    assert mem.phases == {
        "start": {"allocated_gib": 30.0},
        "forward": {"peak_gib": 55.0, "after_gib": 55.0},
        "backward": {"peak_gib": 65.0, "after_gib": 40.0},
        "optimizer": {"peak_gib": 43.0, "after_gib": 40.0},
        "forward.2": {"peak_gib": 40.0, "after_gib": 40.0},
    }
    assert mem.run_peak == 65 * gib  # the allocator alone would now say 40
    assert "backward peak 65.0 -> 40.0" in mem.summary()


def test_step_times_split_each_step_by_phase_and_take_medians_after_the_warm_up(monkeypatch):
    """StepTimes: a phase's host time is the time since the mark before (a phase marked twice in a step adds up),
    a step lasts from its start to the next step's (the last one to its last mark), and the summary's medians leave
    out the first ``skip`` steps unless there are no others."""
    import draftsmith.train.metrics as metrics
    from draftsmith.train import StepTimes

    clock = {"t": 0.0}
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["t"])

    def after(ms):
        clock["t"] += ms / 1e3

    timer = StepTimes(torch.device("cpu"), skip=1)
    timer.mark("fetch")  # before any step: ignored
    for step, forward_ms in ((1, 500.0), (2, 10.0), (3, 12.0), (4, 14.0)):
        timer.start(step)
        after(1)
        timer.mark("fetch")
        after(forward_ms / 2)
        timer.mark("forward")
        after(forward_ms / 2)
        timer.mark("forward")  # a second micro-batch
        after(3)
        timer.mark("optimizer")
        after(0.5)  # a gap until the next step starts: in the step, in no phase
        done = timer.collect()
        assert [r["step"] for r in done] == ([] if step == 1 else [step - 1])
    assert timer.collect(wait=True)[-1]["host_ms"]["step"] == pytest.approx(1 + 14 + 3)
    first = timer.records[0]["host_ms"]
    assert first == pytest.approx({"fetch": 1.0, "forward": 500.0, "optimizer": 3.0, "step": 504.5})
    summary = timer.summary()
    assert summary["steps"] == 3 and summary["skipped"] == 1 and "gpu_ms" not in summary
    assert summary["host_ms"] == pytest.approx({"fetch": 1.0, "forward": 12.0, "optimizer": 3.0, "step": 16.5})
    assert StepTimes.describe(summary).startswith("fetch 1.0, forward 12.0, optimizer 3.0")
    assert StepTimes(torch.device("cpu"), skip=10).summary() is None


def test_layers_compiled_under_ddp_stay_one_graph_each(tmp_path):
    """Under DDP the trainer compiles each drafter layer as one graph (whole_layer_graphs_under_ddp). Control: with
    dynamo's default DDPOptimizer the same layers, run inside DDP's forward, are cut at DDP's bucket size into
    several graphs each (fewer fusions, more saved activations: the suspect of DDP's extra memory on 2 H200s)."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    import torch.distributed as dist

    from draftsmith.train import whole_layer_graphs_under_ddp

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(512, 512) for _ in range(3))  # 1.05 MB each

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    def graphs_per_layer() -> float:
        torch._dynamo.reset()
        graphs = []

        def counting_backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch.manual_seed(0)
        layers = torch.nn.Sequential(Layer(), Layer())
        for layer in layers:
            layer.compile(backend=counting_backend)
        # buckets of ~1 Linear's parameters (DDPOptimizer's first bucket is 1 MB): the default cuts each layer
        model = torch.nn.parallel.DistributedDataParallel(layers, bucket_cap_mb=1.1)
        model(torch.randn(8, 512)).sum().backward()
        return len(graphs) / len(layers)

    saved = dynamo_config.optimize_ddp
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert graphs_per_layer() > 1          # dynamo's default: cut at the buckets
        whole_layer_graphs_under_ddp()
        assert graphs_per_layer() == 1         # the trainer's: one graph per layer
    finally:
        dynamo_config.optimize_ddp = saved
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_training_in_a_one_process_ddp_group_equals_the_plain_run(qwen3_setup, tmp_path, monkeypatch):
    """Inside a process group the trainer wraps its step in DDP even for one process (bench_train --ddp-overhead
    measures DDP's own cost that way on one GPU): gradient accumulation under no_sync, gradients kept as views into
    DDP's buckets and zeroed in place. The weights after 4 steps equal the plain one-process run's exactly."""
    import torch.distributed as dist

    cfg = dict(TINY_TRAIN, max_steps=4, grad_accum=2, tokens_per_batch=64, eval_fraction=0.15)
    plain, wrapped = tmp_path / "plain", tmp_path / "ddp"
    train(qwen3_setup["index"], qwen3_setup["target_dir"], plain, settings(cfg), threads=1)
    wrapped_steps = []

    class CountingDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module, **kwargs):
            wrapped_steps.append(type(module).__name__)
            super().__init__(module, **kwargs)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", CountingDDP)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        state = train(qwen3_setup["index"], qwen3_setup["target_dir"], wrapped, settings(cfg), threads=1)
    finally:
        dist.destroy_process_group()
    assert state["world_size"] == 1 and state["steps"] == 4 and wrapped_steps == ["_TrainStep"]
    wa = load_file(str(plain / "trained" / "model.safetensors"))
    wb = load_file(str(wrapped / "trained" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_collectives_outwait_a_checkpoint_on_a_slow_file_system(monkeypatch):
    """Under torchrun the process group waits an hour for a slow rank: rank 0 writes 21 GB checkpoints at a
    27B-class drafter while the others wait at a barrier, longer than torch's 10-minute NCCL default on a slow
    shared file system."""
    import torch.distributed as dist

    from draftsmith.train import distributed as train_mod

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    train_mod.setup_distributed("cpu")
    assert calls == [("gloo", {"timeout": __import__("datetime").timedelta(hours=1)})]
    assert train_mod.COLLECTIVE_TIMEOUT_S >= 21.4e9 / 36e6  # a 21.4 GB checkpoint at 36 MB/s


# ------------------------------------------------------------------------------------------------------------
# the loss of an optimizer step: one normalisation over all its micro-batches and ranks; non-finite steps stop
# ------------------------------------------------------------------------------------------------------------

SPLIT_DOC_TOKENS = 32  # every document: two fill a 64-token row exactly, four a 128-token row


def _capture_step_gradient(path: Path):
    """Patch ``clip_grad_norm_`` (the trainer calls it right after the step's backward passes and, under DDP, the
    gradient all-reduce) to save the gradients it sees to ``path`` (safetensors, ``g0``, ``g1``, ... in order)."""
    clip = torch.nn.utils.clip_grad_norm_

    def capture(params, *args, **kwargs):
        params = list(params)
        if not Path(path).exists():
            save_file({f"g{i}": p.grad.detach().clone().contiguous() for i, p in enumerate(params)}, str(path))
        return clip(params, *args, **kwargs)

    return capture


def _load_gradients(path: Path) -> list[torch.Tensor]:
    """The gradients :func:`_capture_step_gradient` saved, in parameter order."""
    tensors = load_file(str(path))
    return [tensors[f"g{i}"] for i in range(len(tensors))]


def _split_worker(rank: int, world: int, index: str, target_dir: str, out: str, cfg: dict, grads: str):
    """One gloo rank of :func:`test_step_gradient_does_not_depend_on_the_split` (torch.multiprocessing.spawn)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    mine = Path(grads) if rank == 0 else Path(out) / "grads.safetensors"
    torch.nn.utils.clip_grad_norm_ = _capture_step_gradient(mine)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=world)
    try:
        train(index, target_dir, Path(out) / "run", settings(cfg), threads=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_step_gradient_does_not_depend_on_the_split(tmp_path, monkeypatch):
    """Four documents with 2, 3, 27 and 28 supervised tokens, the two short ones packed into one row, the two long
    ones into another: the gradient of the optimizer step is the same (relative norm difference < 1e-5) whether the
    step is one micro-batch of all four, ``grad_accum: 2`` micro-batches or 2 gloo ranks. Averaging each
    micro-batch's own mean weighted the few slots of the short row like the many of the long one (issue 33.1).
    Every eligible anchor is taken (num_anchors > document length), so each packing trains the same blocks."""
    import torch.multiprocessing as mp

    from draftsmith.features import FeatureIndex
    from draftsmith.train import loss_weight, plan_data

    target = tiny_target("qwen3", initializer_range=0.1)
    base = dict(TINY_TRAIN, max_steps=1, epochs=1, num_anchors=64, eval_fraction=0.0)
    one = dict(base, tokens_per_batch=4 * SPLIT_DOC_TOKENS, grad_accum=1)
    accum = dict(base, tokens_per_batch=2 * SPLIT_DOC_TOKENS, grad_accum=2)
    ranks = dict(base, tokens_per_batch=2 * SPLIT_DOC_TOKENS, grad_accum=1)

    # which documents the plan packs together (it depends on the lengths and the seed only): the first row gets
    # the short answers, the second the long ones
    placeholder = [{"input_ids": torch.full((SPLIT_DOC_TOKENS,), 7), "prompt_len": 1,
                    "loss_mask": torch.ones(SPLIT_DOC_TOKENS, dtype=torch.int8)} for _ in range(4)]
    probe = write_features(tmp_path / "probe", target, [1, 2], placeholder, per_chunk=4)
    rows = plan_data(probe, settings(accum).train, 1).plan.rows(0)
    assert [len(r) for r in rows] == [2, 2]
    supervised = dict(zip([s for row in rows for s, _ in row], [2, 3, 27, 28]))
    g = torch.Generator().manual_seed(5)
    samples = []
    for doc in range(4):
        ids = torch.randint(5, 500, (SPLIT_DOC_TOKENS,), generator=g)
        mask = torch.zeros(SPLIT_DOC_TOKENS, dtype=torch.int8)
        mask[SPLIT_DOC_TOKENS - supervised[doc]:] = 1
        samples.append({"input_ids": ids, "loss_mask": mask, "prompt_len": SPLIT_DOC_TOKENS - supervised[doc]})
    index_path = write_features(tmp_path / "features", target, [1, 2], samples, per_chunk=4)
    target_dir = save_target(target, tmp_path / "target")
    index = FeatureIndex(index_path)
    weights = [loss_weight(make_batch(index, row, num_anchors=64, seed=0, feature_dtype=torch.float32), 4, 7.0)
               for row in rows]
    assert weights[1] > 10 * weights[0] > 0  # the rows' loss weights are far apart: the split matters

    def run_one_process(name: str, cfg: dict) -> list[torch.Tensor]:
        grads = tmp_path / f"{name}.safetensors"
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", _capture_step_gradient(grads))
        train(index_path, target_dir, tmp_path / name, settings(cfg), threads=1)
        return _load_gradients(grads)

    reference = run_one_process("one", one)
    got = {"grad_accum 2": run_one_process("accum", accum)}
    (tmp_path / "ranks").mkdir()
    mp.spawn(_split_worker, args=(2, str(index_path), str(target_dir), str(tmp_path / "ranks"), ranks,
                                  str(tmp_path / "ranks.safetensors")), nprocs=2, join=True)
    got["2 gloo ranks"] = _load_gradients(tmp_path / "ranks.safetensors")
    ref_norm = torch.cat([g.flatten() for g in reference]).norm()
    assert ref_norm > 0
    for name, grads in got.items():
        assert len(grads) == len(reference)
        diff = torch.cat([(a - b).flatten() for a, b in zip(grads, reference)]).norm()
        assert diff / ref_norm < 1e-5, (name, float(diff / ref_norm))


def test_a_nan_in_the_features_stops_training_naming_the_step_and_rows(qwen3_setup, tmp_path):
    """A NaN in one merged chunk (extraction and merge refuse them; here one written into a chunk whose sha256 the
    index then records, as a NaN that reached merge would be): ``python -m draftsmith.train`` stops at the step
    that reads it, names the step, the tokenized row and its chunk, exits 1, and leaves the checkpoints of the
    steps before it as they were (no checkpoint of the NaN step, no ``trained/``)."""
    import shutil

    from safetensors import safe_open

    from draftsmith.features import write_index
    from draftsmith.io import sha256_file
    from draftsmith.train import plan_data, verify_checkpoint

    features = tmp_path / "features"
    shutil.copytree(qwen3_setup["index"].parent, features)
    index_path = features / "index.json"
    cfg = dict(TINY_TRAIN, max_steps=8, epochs=1, tokens_per_batch=64, save_every=2, keep_checkpoints=4)
    plan = plan_data(index_path, settings(cfg).train, 1).plan
    (_, key, r), = plan.items(5, 6, 0)  # the sixth step: after the checkpoints at steps 2 and 4
    ((sample, tokens),) = plan.rows(key)[r]  # 48-token samples, one per 64-token row
    index = FeatureIndex(index_path)
    ref = index.ref(sample)
    chunk = index.files[ref.chunk]
    with safe_open(str(chunk), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(chunk))
    tensors["hidden_states"][ref.start, 0] = float("nan")  # the sample's first token: every block of it attends to it
    save_file(tensors, str(chunk), metadata=metadata)
    meta = json.loads(index_path.read_text())  # its sha256 recorded, as if merge had written it: a fresh start
    meta["chunks"][ref.chunk]["sha256"] = sha256_file(chunk)  # verifies the chunks, and would refuse it otherwise
    write_index(index_path, meta)

    out = tmp_path / "out"
    args = {"train": cfg, "drafter": TINY_DRAFTER, "target": {}}
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train", "--index", str(index_path), "--target",
                           str(qwen3_setup["target_dir"]), "--out", str(out), "--threads", "1", "--args",
                           json.dumps(args)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "step 6 of 8: the loss is not finite" in err, err[-3000:]
    assert f"tokenized rows {sample} ({tokens} tokens) in {chunk}" in err, err[-3000:]
    assert "Traceback" not in err
    (ckpts,) = (out / "checkpoints").glob("run-*")
    assert f"the newest checkpoint, {ckpts / 'step-00000004'} (step 4), is kept" in err, err[-3000:]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004"]
    assert json.loads((ckpts / "latest.json").read_text())["step"] == 4
    state = verify_checkpoint(ckpts / "step-00000004")
    assert state is not None and state["step"] == 4
    for name, tensor in load_file(str(ckpts / "step-00000004" / "model.safetensors")).items():
        assert torch.isfinite(tensor).all(), name
    assert not (out / "trained").exists()


def test_a_non_finite_gradient_norm_alone_stops_the_step_naming_all_its_rows(tmp_path):
    """Every micro-batch's loss finite but the gradient norm not (an overflow in the backward): the error names the
    step and every micro-batch's rows (any of them may be the cause) and says that no checkpoint exists yet; finite
    values pass."""
    from types import SimpleNamespace

    from draftsmith.train import Dist, NonFiniteError, Trainer

    run = SimpleNamespace(ranks=Dist(), device=torch.device("cpu"), ckpt_dir=tmp_path / "run-x", total_steps=9,
                          describe_rows=lambda step, rank, micro: f"rows of step {step} micro {micro}")
    losses = [torch.tensor(1.5), torch.tensor(0.25)]
    assert Trainer.check_finite(run, 2, losses, torch.tensor(3.0)) is None
    with pytest.raises(NonFiniteError) as err:
        Trainer.check_finite(run, 2, losses, torch.tensor(float("inf")))
    msg = str(err.value)
    assert msg.startswith("step 3 of 9: the gradient norm is inf (every micro-batch's loss is finite")
    assert "micro-batch 0 of rank 0: rows of step 2 micro 0; micro-batch 1 of rank 0: rows of step 2 micro 1" in msg
    assert f"no checkpoint of this run in {tmp_path / 'run-x'} yet" in msg


def test_a_small_heldout_split_is_warned_about(qwen3_setup, caplog):
    """Training's held-out metrics from a handful of samples say little: fewer than MIN_HELDOUT_SAMPLES held-out
    samples log a warning naming the count and train.eval_fraction; none when the split holds enough."""
    from draftsmith.train import plan_data
    from draftsmith.train.plan import MIN_HELDOUT_SAMPLES, warn_few_heldout

    index_path = qwen3_setup["index"]
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        data = plan_data(index_path, settings(dict(TINY_TRAIN, eval_fraction=0.1)).train, 1)
    few = len(data.heldout_ids)
    assert 0 < few < MIN_HELDOUT_SAMPLES
    assert f"only {few} held-out sample(s) (train.eval_fraction 0.1 of {len(data.lengths)})" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        warn_few_heldout(MIN_HELDOUT_SAMPLES, 0.02, 1600)
    assert "held-out sample" not in caplog.text
