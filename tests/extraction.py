"""Extraction helpers shared by test_extract.py and test_fused.py: a tokenized parquet, a plan, one shard run
through ``extract_shard`` on the CPU, the stored samples read back, and the reference features of a sample alone;
and for test_train.py, test_train_phases.py and test_workflow.py a chunk rewritten with other values (same counts).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from draftsmith import extract as ex
from draftsmith.features import read_chunk, read_safetensors_header, write_chunk, write_index
from draftsmith.io import write_json
from tiny import VOCAB

LAYER_IDS = [0, 1, 3]  # includes 0 and L - 1 (tiny targets have L = 4)
# mixed lengths; with a 200-token budget batches hold up to six rows of different lengths, and
# 210 >= budget runs alone without a mask
LENGTHS = [210, 5, 17, 33, 64, 9, 40, 3, 70, 48, 21, 1, 66, 12]


def write_tokenized(path: Path, lengths: list[int], *, seed: int = 0, vocab: int = VOCAB) -> list[np.ndarray]:
    """A tokenized parquet in the tokenize stage's contract; returns the input ids of every row."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]
    masks = [(rng.random(n) < 0.6).astype(np.int8) for n in lengths]
    table = pa.table({
        "id": [f"conv{r:03d}#1" for r in range(len(lengths))],
        "source": ["tiny"] * len(lengths),
        "input_ids": pa.array([x.tolist() for x in ids], pa.list_(pa.int32())),
        "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.int8())),
        "num_tokens": pa.array(lengths, pa.int32()),
    })
    table = table.replace_schema_metadata({
        b"draftsmith.chat_template_kwargs": json.dumps({"enable_thinking": False}).encode(),
        b"draftsmith.tokenizer_fingerprint": json.dumps("f" * 64).encode(),
        b"draftsmith.max_length": b"1024",
    })
    pq.write_table(table, path)
    return ids


def setup_run(tmp: Path, target: Path, *, lengths=LENGTHS, shards: int = 1, layer_ids=LAYER_IDS):
    ids = write_tokenized(tmp / "train.parquet", lengths)
    plan = ex.build_plan(tmp / "train.parquet", target, ex.ExtractPlanSettings.from_config(
        {"extract": {"shards": shards}, "drafter": {"target_layer_ids": layer_ids}}))
    write_json(tmp / "plan.json", plan)
    return ids, plan


def run_shard(tmp: Path, target: Path, *, out: str = "features", shard: int = 0, model=None, **cfg):
    base = {"token_budget": 200, "chunk_tokens": 100, "storage_dtype": "float32"}
    on_chunk = cfg.pop("on_chunk", None)
    run_stats = cfg.pop("run_stats", None)
    staging_dir = cfg.pop("staging_dir", None)
    plan = cfg.pop("plan", tmp / "plan.json")
    settings = ex.ExtractShardSettings.from_config({"extract": {**base, **cfg}, "target": {"dtype": "float32"}})
    return ex.extract_shard(plan_path=plan, tokenized_path=tmp / "train.parquet",
                            target_dir=target, manifest_path=tmp / out / f"shard-{shard}" / "manifest.json",
                            shard=shard, settings=settings, model=model, device="cpu", on_chunk=on_chunk,
                            run_stats=run_stats, staging_dir=staging_dir)


def stored_samples(folder: Path, manifest: dict):
    """Yield (row, hidden [n, F] float32, tensors of the sample) for every stored sample."""
    for rec in manifest["chunks"]:
        t = read_chunk(folder / rec["file"])
        assert t["sample_index"].tolist() == rec["rows"]
        hidden = t["features"]
        off = t["offsets"].tolist()
        for s, row in enumerate(rec["rows"]):
            sl = slice(off[s], off[s + 1])
            yield row, hidden[sl], {k: v[sl] for k, v in t.items()
                                    if k in ("input_ids", "loss_mask", "target_token", "target_topk_ids",
                                             "target_topk_logprobs")}


@torch.no_grad()
def alone(model, ids: np.ndarray, layer_ids=LAYER_IDS):
    """Reference: the sample alone, unpadded, through the whole model with output_hidden_states."""
    out = model(torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return feats, out.logits[0].argmax(-1).to(torch.int32)


def rewrite_chunk(path: Path, change, storage_dtype: str) -> str:
    """Rewrite a chunk file with draftsmith.features' writer, its tensors passed through ``change`` (a function of
    the dict of tensors; the same samples and token counts), its metadata kept; returns its new sha256."""
    from safetensors.torch import load_file

    t = change(load_file(str(path)))
    offsets = t["offsets"].tolist()
    return write_chunk(path, features=t["hidden_states"], input_ids=t["input_ids"], loss_mask=t["loss_mask"],
                       lengths=[b - a for a, b in zip(offsets, offsets[1:])], sample_index=t["sample_index"].tolist(),
                       target_token=t.get("target_token"), scales=t.get("scales"), storage_dtype=storage_dtype,
                       metadata=read_safetensors_header(path).metadata or None,
                       target_topk_ids=t.get("target_topk_ids"), target_topk_logprobs=t.get("target_topk_logprobs"))


def rewrite_index_chunk(index_path: Path, ci: int, change) -> None:
    """:func:`rewrite_chunk` on chunk ``ci`` of an index, its new sha256 recorded in the index (as merge would)."""
    index = json.loads(index_path.read_text())
    entry = index["chunks"][ci]
    entry["sha256"] = rewrite_chunk(index_path.parent / entry["path"], change, index["storage_dtype"])
    write_index(index_path, index)
