"""A tiny draftsmith run on the CPU for the peer benchmark's checks: a tiny random Qwen3 target with a tokenizer
(tests/tiny.py), a tokenized train set, and its merged features extracted by draftsmith's own extract and merge
(bf16, target tokens stored). The writers, the peers' trainers and the converter are smoke-tested on it
(bench/peers/run.sh with ``PEERS_TINY=1``, tests/test_peers_writers.py).

``rows``: token counts of the rows; each row's loss mask is a prompt of ~30% zeros then ones, except two rows made
to be filtered by the writers: one with alternating 0/1 (no two consecutive supervised tokens: SpecForge would
raise on it) and one with no supervised token at all.

    python bench/peers/tiny_run.py --out /tmp/peers-tiny        # -> /tmp/peers-tiny/{target,results/...}
    python bench/peers/tiny_run.py --workflow --out /tmp/peers-tiny   # -> target/, chat.jsonl, tiny.yaml

``--workflow`` writes, instead of features, what a whole tiny workflow run needs (bench/peers/run.sh's CPU smoke with
``PEERS_TINY=1``): the tiny target, ``chat.jsonl`` (synthetic OpenAI-format conversations, ``split: both``) and
``tiny.yaml``, a config overlay sized for two CPU cores (regeneration off, a 2-layer drafter, block size 4, 60
steps, a held-out evaluation set of 4 prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

ROWS = [96, 40, 130, 17, 64, 33, 88, 50, 120, 25, 70, 45, 99, 12, 60, 80]
ALTERNATING_ROW = 5   # loss mask 0101...: no consecutive supervised pair
UNSUPERVISED_ROW = 9  # loss mask all zeros
LAYER_IDS = [0, 2, 3]  # a 4-layer target: the last layer (3) is tapped too
MASK_TOKEN = 5


def write_target(folder: Path, *, seed: int = 0, layers: int = 4) -> Path:
    """A tiny random Qwen3 target (hidden 64, ``layers`` layers, vocabulary 512, float32) with the tiny
    byte-level BPE tokenizer and ChatML template of tests/tiny.py, saved as a Hugging Face folder."""
    from tiny import tiny_target, tiny_tokenizer

    model = tiny_target("qwen3", seed=seed, num_hidden_layers=layers, initializer_range=0.1)
    model.save_pretrained(folder)
    tok = tiny_tokenizer()
    tok.model_max_length = model.config.max_position_embeddings
    tok.save_pretrained(folder)
    return folder


def write_tokenized(path: Path, lengths: list[int], *, seed: int = 0, vocab: int = 512) -> None:
    """A tokenized parquet in the tokenize stage's contract (random ids 6..vocab-1, prompt then answer)."""
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for r, n in enumerate(lengths):
        ids.append(rng.integers(6, vocab, n).astype(np.int32))
        if r == ALTERNATING_ROW:
            m = (np.arange(n) % 2).astype(np.int8)
        elif r == UNSUPERVISED_ROW:
            m = np.zeros(n, np.int8)
        else:
            m = (np.arange(n) >= int(0.3 * n)).astype(np.int8)
        masks.append(m)
    table = pa.table({
        "id": [f"tiny{r:03d}#1" for r in range(len(lengths))], "source": ["tiny"] * len(lengths),
        "input_ids": pa.array([x.tolist() for x in ids], pa.list_(pa.int32())),
        "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.int8())),
        "num_tokens": pa.array(lengths, pa.int32()),
    }).replace_schema_metadata({
        b"draftsmith.chat_template_kwargs": b"{}", b"draftsmith.tokenizer_fingerprint": json.dumps("f" * 64).encode(),
        b"draftsmith.max_length": b"1024"})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def build(root: Path, *, rows: list[int] = ROWS, layer_ids: list[int] = LAYER_IDS, seed: int = 0) -> dict:
    """``root/target``, ``root/results/tokenized/train.parquet`` and ``root/results/features/`` (plan, one shard,
    index.json), bf16 features with target tokens, made by draftsmith's extract and merge. Returns the paths."""
    from draftsmith import extract as ex
    from draftsmith.io import write_json
    from draftsmith.merge import MergeSettings, merge_features

    root = Path(root)
    target = write_target(root / "target", seed=seed)
    tokenized = root / "results" / "tokenized" / "train.parquet"
    write_tokenized(tokenized, rows, seed=seed)
    features = root / "results" / "features"
    features.mkdir(parents=True, exist_ok=True)
    plan = ex.build_plan(tokenized, target, ex.ExtractPlanSettings.from_config(
        {"extract": {"shards": 1}, "drafter": {"target_layer_ids": layer_ids}}))
    write_json(features / "plan.json", plan)
    settings = ex.ExtractShardSettings.from_config({
        "extract": {"token_budget": 256, "chunk_tokens": 300, "storage_dtype": "bfloat16",
                    "store_target_tokens": True},
        "target": {"dtype": "float32"}})
    manifest = features / "shard-0" / "manifest.json"
    ex.extract_shard(plan_path=features / "plan.json", tokenized_path=tokenized, target_dir=target,
                     manifest_path=manifest, shard=0, settings=settings, device="cpu")
    merge_features(features / "plan.json", [manifest], tokenized, features / "index.json",
                   settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    return {"root": root, "target": target, "tokenized": tokenized, "index": features / "index.json"}


def write_workflow(root: Path, *, conversations: int = 48, seed: int = 0) -> dict:
    """``root/target`` (:func:`write_target`), ``root/chat.jsonl`` and ``root/tiny.yaml`` (see the module docstring).
    The conversations repeat a few arithmetic patterns so that a drafter can learn something in 60 CPU steps."""
    import random

    root = Path(root)
    target = write_target(root / "target", seed=seed)
    rng = random.Random(seed)
    words = ["the quick brown fox", "jumps over the lazy dog", "hello how are you today", "I am fine thank you",
             "def add(a, b): return a + b", "the answer is 42", "a small drafter proposes tokens",
             "the target verifies them"]
    with open(root / "chat.jsonl", "w", encoding="utf-8") as fh:
        for i in range(conversations):
            q = f"Question {i}: repeat {rng.choice(words)} please."
            a = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": a}]}) + "\n")
    overlay = {
        "target": {"model": str(target), "dtype": "float32"},
        "gpu": {"cpu_fallback": True},
        "data": {"eval_fraction": 0.15, "sources": [{"name": "chat", "path": str(root / "chat.jsonl"),
                                                    "adapter": "openai", "split": "both"}]},
        "regenerate": {"enabled": False},
        "tokenize": {"max_length": 160},
        "drafter": {"num_layers": 2, "num_target_features": 3, "block_size": 4, "mask_token_id": MASK_TOKEN,
                    "target_layer_ids": LAYER_IDS},
        "extract": {"shards": 1, "token_budget": 1024, "chunk_tokens": 512},
        "train": {"epochs": 3, "tokens_per_batch": 512, "num_anchors": 32, "max_anchors_per_row": 64,
                  "eval_fraction": 0.1, "save_every": 1000, "eval_every": 1000, "log_every": 5, "lr": 3e-3},
        "evaluate": {"max_prompt_tokens": 120, "only": ["heldout"],
                     "sets": {"heldout": {"source": "heldout", "max_prompts": 4, "max_new_tokens": 16}}},
    }
    import yaml

    (root / "tiny.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    return {"root": root, "target": target, "config": root / "tiny.yaml"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--workflow", action="store_true", help="a tiny workflow's inputs instead of features")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    paths = write_workflow(args.out) if args.workflow else build(args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
