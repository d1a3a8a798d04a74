"""merge: a verified index over extraction shards (draftsmith.merge).

The shards here are written by the test itself to the extraction contract (chunk files with real tensors
written by :func:`draftsmith.features.write_chunk`, manifests with real sha256 and statistics computed from
the stored values, a plan, a tokenized train parquet), then broken one way at a time.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.features import read_chunk, read_safetensors_header, write_chunk
from draftsmith.io import read_json, sha256_file, write_json
from draftsmith.merge import MergeError, MergeSettings, MergeSliceSettings, format_layer_stats, merge_features
from draftsmith.shard_plan import shard_plan

SEMANTICS = ("id i = output of decoder layer i = HF output_hidden_states[i + 1]; "
             "the last layer includes the final norm")
HIDDEN = 8


@dataclass
class FeatureSet:
    root: Path
    plan: Path
    tokenized: Path
    manifests: list[Path]
    ids: list[str]
    lengths: list[int]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [tokens, n*H] float32 as stored

    @property
    def index(self) -> Path:
        return self.root / "features" / "index.json"

    def merge(self, verify_sha256: bool = False, **kw):
        settings = MergeSettings.from_config({"merge": {"verify_sha256": verify_sha256}})
        return merge_features(self.plan, self.manifests, self.tokenized, self.index, settings=settings, **kw)

    def manifest(self, shard: int) -> dict:
        return read_json(self.manifests[shard])

    def chunk_path(self, shard: int, j: int) -> Path:
        return self.manifests[shard].parent / self.manifest(shard)["chunks"][j]["file"]


def _write_tokenized(path: Path, ids, lengths, *, fingerprint="tok-fp", template_kwargs=None, seed=0):
    gen = np.random.default_rng(seed)
    input_ids = [gen.integers(3, 500, n).astype(np.int32) for n in lengths]
    loss_mask = [(np.arange(n) >= n // 3).astype(np.int8) for n in lengths]
    table = pa.table({
        "id": pa.array(ids, pa.string()),
        "source": pa.array(["unit"] * len(ids), pa.string()),
        "input_ids": pa.array([x.tolist() for x in input_ids], pa.list_(pa.int32())),
        "loss_mask": pa.array([x.tolist() for x in loss_mask], pa.list_(pa.int8())),
        "num_tokens": pa.array(lengths, pa.int32()),
    }).replace_schema_metadata({
        b"draftsmith.chat_template_kwargs": json.dumps(template_kwargs or {}).encode(),
        b"draftsmith.tokenizer_fingerprint": json.dumps(fingerprint).encode(),
        b"draftsmith.max_length": b"64",
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return input_ids, loss_mask


def _stats(hidden: torch.Tensor, n_layers: int) -> dict:
    per_layer = hidden.float().reshape(hidden.shape[0], n_layers, -1)
    return {"rms": per_layer.pow(2).mean(dim=(0, 2)).sqrt().tolist(),
            "nonfinite": int((~torch.isfinite(per_layer)).sum()),
            "zero_rows": int((per_layer == 0).all(dim=-1).any(dim=-1).sum())}


def write_shard(fs: FeatureSet, shard: int, rows: list[int], *, num_shards: int, layer_ids, storage="bfloat16",
                target_token=True, chunk_samples=2, input_ids=None, loss_mask=None, seed=0, subset=None,
                top_k=0) -> Path:
    """Write shard-{shard}/ chunk files + manifest to the extraction contract (a subset plan's manifest records
    its ``subset``; ``top_k`` > 0 stores the target's top-k and records ``target_top_k``)."""
    folder = fs.root / "features" / f"shard-{shard}"
    folder.mkdir(parents=True, exist_ok=True)
    n = len(layer_ids)
    gen = torch.Generator().manual_seed(1000 + shard + seed)
    chunks = []
    for j in range(0, len(rows), chunk_samples):
        part = rows[j:j + chunk_samples]
        lengths = [fs.lengths[r] for r in part]
        hidden = torch.randn(sum(lengths), n * HIDDEN, generator=gen) * (1 + torch.arange(n).repeat_interleave(HIDDEN))
        tt = torch.randint(3, 500, (len(hidden),), dtype=torch.int32, generator=gen) if target_token else None
        topk = {}
        if top_k:
            topk = {"target_topk_ids": torch.randint(3, 500, (len(hidden), top_k), generator=gen),
                    "target_topk_logprobs": -torch.rand(len(hidden), top_k, generator=gen).cumsum(1)}
        name = f"chunk-{j // chunk_samples:05d}.safetensors"
        write_chunk(folder / name, features=hidden, lengths=lengths, sample_index=part,
                    input_ids=np.concatenate([input_ids[r] for r in part]),
                    loss_mask=np.concatenate([loss_mask[r] for r in part]), storage_dtype=storage,
                    target_token=tt, num_layers=n, **topk)
        stored = read_chunk(folder / name)["features"]  # float32, as stored (fp8 decoded)
        offsets = np.cumsum([0, *lengths]).tolist()
        for k, r in enumerate(part):
            fs.hidden[r] = stored[offsets[k]:offsets[k + 1]]
        chunks.append({"file": name, "sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size,
                       "num_samples": len(part), "num_tokens": sum(lengths), "rows": part,
                       "ids": [fs.ids[r] for r in part], "stats": _stats(stored, n)})
    all_hidden = torch.cat([fs.hidden[r] for r in rows]) if rows else torch.zeros(0, n * HIDDEN)
    manifest = {
        "format": "draftsmith.features/1", "shard": shard, "num_shards": num_shards,
        **({"subset": subset} if subset is not None else {}), "layer_ids": list(layer_ids),
        "layer_semantics": SEMANTICS, "hidden_size": HIDDEN, "num_target_layers": 4, "storage_dtype": storage,
        "has_target_token": target_token, **({"target_top_k": top_k} if top_k else {}),
        "target_fingerprint": "target-fp", "tokenizer_fingerprint": "tok-fp",
        "chat_template_kwargs": {}, "num_samples": len(rows), "num_tokens": sum(c["num_tokens"] for c in chunks),
        "bytes": sum(c["bytes"] for c in chunks), "chunks": chunks, "stats": _stats(all_hidden, n),
    }
    write_json(folder / "manifest.json", manifest)
    return folder / "manifest.json"


def make_feature_set(root: Path, *, num_rows=9, num_shards=2, layer_ids=(1, 3), shard_layer_ids=None,
                     storage="bfloat16", target_token=True, chunk_samples=2, top_k=0) -> FeatureSet:
    """A complete, correct feature set: tokenized train parquet, plan.json, one manifest per shard."""
    lengths = [5 + (7 * r) % 11 for r in range(num_rows)]
    ids = [f"{r:04x}c0ffee{r:02d}" + ("#1" if r % 3 == 0 else "") for r in range(num_rows)]
    tokenized = root / "tokenized" / "train.parquet"
    input_ids, loss_mask = _write_tokenized(tokenized, ids, lengths)
    shards = [sorted(range(s, num_rows, num_shards)) for s in range(num_shards)]
    plan = root / "features" / "plan.json"
    write_json(plan, {"format": "draftsmith.plan/1", "num_shards": num_shards, "layer_ids": list(layer_ids),
                      "hidden_size": HIDDEN, "num_target_layers": 4, "tokenized_rows": num_rows,
                      "tokenized_tokens": sum(lengths),
                      "shards": [{"shard": s, "rows": rows, "num_tokens": sum(lengths[r] for r in rows)}
                                 for s, rows in enumerate(shards)]})
    fs = FeatureSet(root=root, plan=plan, tokenized=tokenized, manifests=[], ids=ids, lengths=lengths)
    fs._input_ids, fs._loss_mask = input_ids, loss_mask
    for s, rows in enumerate(shards):
        lids = (shard_layer_ids or {}).get(s, layer_ids)
        fs.manifests.append(write_shard(fs, s, rows, num_shards=num_shards, layer_ids=lids, storage=storage,
                                        target_token=target_token, chunk_samples=chunk_samples,
                                        input_ids=input_ids, loss_mask=loss_mask, top_k=top_k))
    return fs


def _fail(fs: FeatureSet, **kw) -> str:
    with pytest.raises(MergeError) as info:
        fs.merge(**kw)
    assert not fs.index.exists(), "a failed merge must not leave an index behind"
    return str(info.value)


def _edit_manifest(fs: FeatureSet, shard: int, edit) -> None:
    manifest = fs.manifest(shard)
    edit(manifest)
    write_json(fs.manifests[shard], manifest)


# ------------------------------------------------------------------------------------------------


def test_correct_set_merges_with_totals_of_the_tokenized_train_set(tmp_path):
    fs = make_feature_set(tmp_path)
    index = fs.merge(threads=2)

    assert index == read_json(fs.index)
    assert index["format"] == "draftsmith.index/1"
    assert index["num_samples"] == len(fs.ids) == pq.read_metadata(fs.tokenized).num_rows
    assert index["num_tokens"] == sum(fs.lengths)
    assert index["bytes"] == sum(p.stat().st_size for p in (tmp_path / "features").glob("shard-*/chunk-*"))
    assert index["layer_ids"] == [1, 3] and index["hidden_size"] == HIDDEN and index["has_target_token"]
    assert index["tokenizer_fingerprint"] == "tok-fp" and index["layer_semantics"] == SEMANTICS

    # every tokenized row exactly once, and each chunk path resolves to a file holding exactly those rows
    seen = []
    for chunk in index["chunks"]:
        path = fs.index.parent / chunk["path"]
        with safe_open(str(path), "pt") as fh:
            assert fh.get_tensor("sample_index").tolist() == chunk["rows"]
            assert fh.get_tensor("offsets")[-1].item() == chunk["num_tokens"]
        seen += chunk["rows"]
    assert sorted(seen) == list(range(len(fs.ids)))
    assert [c["shard"] for c in index["chunks"]] == sorted(c["shard"] for c in index["chunks"])

    # merged per-layer RMS equals the RMS over every stored value of that layer
    every = torch.cat([fs.hidden[r] for r in range(len(fs.ids))]).reshape(sum(fs.lengths), 2, HIDDEN)
    truth = every.pow(2).mean(dim=(0, 2)).sqrt()
    got = torch.tensor([row["rms"] for row in index["layer_stats"]], dtype=torch.float32)
    torch.testing.assert_close(got, truth, rtol=1e-5, atol=0)
    assert got[1] > 1.5 * got[0]  # the test data scales layer k by (1 + k)
    assert index["stats"] == {"nonfinite": 0, "zero_rows": 0}
    table = format_layer_stats(index)
    assert "layer id" in table and f"{index['layer_stats'][1]['rms']:.4g}" in table

    # hashing on: the same set passes, and the index says it was verified
    fs.index.unlink()
    assert fs.merge(verify_sha256=True)["sha256_verified"] is True


def test_missing_shard_fails_naming_shard_and_samples(tmp_path):
    fs = make_feature_set(tmp_path, num_shards=3)
    fs.manifests[1].unlink()
    msg = _fail(fs)
    assert "shard 1: no manifest" in msg
    assert f"row 1 (id {fs.ids[1]!r})" in msg  # shard 1 was planned rows 1, 4, 7
    assert "shard 0" not in msg and "shard 2" not in msg


def test_duplicated_sample_across_two_shards_fails_naming_both_places(tmp_path):
    fs = make_feature_set(tmp_path)
    # shard 1 also stores shard 0's first chunk (rows 0 and 2), as a stale shard of another plan would
    extra = fs.manifests[1].parent / "chunk-00099.safetensors"
    shutil.copyfile(fs.chunk_path(0, 0), extra)
    entry = dict(fs.manifest(0)["chunks"][0], file=extra.name)

    def add(manifest):
        manifest["chunks"].append(entry)
        for key in ("num_samples", "num_tokens", "bytes"):
            manifest[key] += entry[key]
    _edit_manifest(fs, 1, add)

    msg = _fail(fs)
    assert (f"sample row 0 (id {fs.ids[0]!r}) is stored 2 times: shard 0 chunk chunk-00000.safetensors; "
            f"shard 1 chunk chunk-00099.safetensors") in msg
    assert f"row 2 (id {fs.ids[2]!r}) is stored 2 times" in msg
    assert "is planned for shard 0, not shard 1" in msg


def test_truncated_chunk_fails(tmp_path):
    fs = make_feature_set(tmp_path)
    path = fs.chunk_path(0, 1)  # rows 4 and 6
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    msg = _fail(fs)
    assert "shard 0 chunk chunk-00001.safetensors" in msg
    assert f"row 4 (id {fs.ids[4]!r})" in msg
    assert f"is {len(data) - 100} bytes, the manifest says {len(data)}" in msg


def test_truncated_chunk_fails_even_when_its_manifest_matches(tmp_path):
    """A manifest written after the file was cut (size and sha256 of the cut file): the header catches it."""
    fs = make_feature_set(tmp_path)
    path = fs.chunk_path(1, 0)
    path.write_bytes(path.read_bytes()[:-40])
    _edit_manifest(fs, 1, lambda m: m["chunks"][0].update(bytes=path.stat().st_size, sha256=sha256_file(path)))
    msg = _fail(fs, verify_sha256=True)
    assert "shard 1 chunk chunk-00000.safetensors" in msg and "truncated" in msg
    assert f"row 1 (id {fs.ids[1]!r})" in msg

    path.write_bytes(path.read_bytes()[:20])  # cut inside the header itself
    _edit_manifest(fs, 1, lambda m: m["chunks"][0].update(bytes=20))
    assert "unreadable safetensors header" in _fail(fs)


def test_changed_sha256_fails_only_with_hashing(tmp_path):
    fs = make_feature_set(tmp_path)
    path = fs.chunk_path(1, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, same header, one stored value changed
    path.write_bytes(bytes(data))

    fs.merge()  # header-only by default: the change is invisible, hashing is opt-in
    fs.index.unlink()
    msg = _fail(fs, verify_sha256=True)
    assert "shard 1 chunk chunk-00001.safetensors" in msg
    assert f"sha256 {sha256_file(path)} differs from the manifest's" in msg
    assert f"row 5 (id {fs.ids[5]!r})" in msg  # shard 1 holds rows 1, 3 | 5, 7


def test_shard_with_different_layer_ids_fails(tmp_path):
    fs = make_feature_set(tmp_path, shard_layer_ids={1: (0, 2)})
    msg = _fail(fs)
    assert "shard 1: layer_ids [0, 2] differs from shard 0's [1, 3]" in msg
    assert f"chunk chunk-00000.safetensors (2 sample(s): row 1 (id {fs.ids[1]!r})" in msg


def test_other_metadata_and_template_mismatches_fail(tmp_path):
    fs = make_feature_set(tmp_path)
    _edit_manifest(fs, 1, lambda m: m.update(chat_template_kwargs={"enable_thinking": False}))
    msg = _fail(fs)
    assert "shard 1: chat_template_kwargs {'enable_thinking': False} differs from shard 0's {}" in msg

    _edit_manifest(fs, 1, lambda m: m.update(chat_template_kwargs={}))
    for s in (0, 1):  # both shards agree with each other, but not with the tokenized set
        _edit_manifest(fs, s, lambda m: m.update(tokenizer_fingerprint="other"))
    msg = _fail(fs)
    assert "tokenizer_fingerprint 'other' differs from" in msg and "train.parquet's 'tok-fp'" in msg


def test_stale_extraction_of_a_changed_tokenized_set_fails_naming_the_sample(tmp_path):
    fs = make_feature_set(tmp_path)
    lengths = list(fs.lengths)
    lengths[5] += 1  # re-tokenized with one longer row, same ids
    _write_tokenized(fs.tokenized, fs.ids, lengths)
    msg = _fail(fs)
    assert "the tokenized set changed after planning" in msg
    assert f"row 5 (id {fs.ids[5]!r}) has {fs.lengths[5]} tokens stored, {lengths[5]} tokenized" in msg

    ids = list(fs.ids)
    ids[6] = "ffffffffffffffff"
    _write_tokenized(fs.tokenized, ids, fs.lengths)
    msg = _fail(fs)
    assert f"sample row 6 has id {fs.ids[6]!r} in the manifest but 'ffffffffffffffff'" in msg


def test_broken_features_and_header_shapes_fail(tmp_path):
    fs = make_feature_set(tmp_path)
    _edit_manifest(fs, 0, lambda m: m["chunks"][2].update(stats=dict(m["chunks"][2]["stats"], zero_rows=3)))
    msg = _fail(fs)
    assert "shard 0 chunk chunk-00002.safetensors" in msg and "3 all-zero rows" in msg

    # a chunk rewritten without target tokens while the manifest says it has them
    fs = make_feature_set(tmp_path / "b")
    path = fs.chunk_path(0, 0)
    t = read_chunk(path, dtype=torch.bfloat16)
    write_chunk(path, features=t["features"], lengths=np.diff(t["offsets"].numpy()), sample_index=t["sample_index"],
                input_ids=t["input_ids"], loss_mask=t["loss_mask"], storage_dtype="bfloat16")
    _edit_manifest(fs, 0, lambda m: m["chunks"][0].update(bytes=path.stat().st_size))
    _edit_manifest(fs, 0, lambda m: m.update(bytes=sum(c["bytes"] for c in m["chunks"])))
    msg = _fail(fs)
    assert "shard 0 chunk chunk-00000.safetensors" in msg and "no tensor 'target_token'" in msg


def test_target_topk_is_carried_by_merge_and_checked_in_every_chunk(tmp_path):
    """Shards storing the target's top-k (target_top_k 3) merge into an index recording it, whose reader gives the
    tensors; a chunk without them, of another k, or shards disagreeing on k fail naming shard and chunk. Features
    without top-k merge into an index without the key (as before it existed), and such an index reads as k = 0."""
    from draftsmith.features import FeatureIndex
    from draftsmith.train.plan import FeatureMeta

    fs = make_feature_set(tmp_path / "k3", top_k=3, storage="float8_e4m3fn")
    index = fs.merge(verify_sha256=True)
    assert index["target_top_k"] == 3 and list(index).index("target_top_k") > list(index).index("has_target_token")
    header = read_safetensors_header(fs.index.parent / index["chunks"][0]["path"])
    tokens = index["chunks"][0]["num_tokens"]
    assert (header.tensors["target_topk_ids"]["dtype"], header.tensors["target_topk_ids"]["shape"]) == ("I32",
                                                                                                        [tokens, 3])
    assert (header.tensors["target_topk_logprobs"]["dtype"],
            header.tensors["target_topk_logprobs"]["shape"]) == ("F16", [tokens, 3])
    features = FeatureIndex(fs.index)
    assert features.target_top_k == 3 and FeatureMeta.of(features).target_top_k == 3
    got = features.read(features.ref(4))
    assert got["target_topk_ids"].shape == (fs.lengths[4], 3) and got["target_topk_logprobs"].dtype == torch.float16

    fs.index.unlink()  # shard 1 recorded without the top-k: the shards disagree
    _edit_manifest(fs, 1, lambda m: m.pop("target_top_k"))
    msg = _fail(fs)
    assert "shard 1: target_top_k 0 differs from shard 0's 3" in msg
    _edit_manifest(fs, 1, lambda m: m.update(target_top_k=4))  # the manifest says 4, its chunks hold 3
    msg = _fail(fs)
    assert "shard 1 chunk chunk-00000.safetensors" in msg and "tensor 'target_topk_ids' is I32 [" in msg
    assert "the manifest implies I32" in msg and ", 4]" in msg
    for s in (0, 1):
        _edit_manifest(fs, s, lambda m: m.update(target_top_k="3"))
    assert "shard 0: target_top_k '3' is not a positive integer" in _fail(fs)

    # a chunk rewritten without the top-k while its manifest records them
    fs = make_feature_set(tmp_path / "missing", top_k=2)
    path = fs.chunk_path(0, 1)
    t = read_chunk(path, dtype=torch.bfloat16)
    write_chunk(path, features=t["features"], lengths=np.diff(t["offsets"].numpy()), sample_index=t["sample_index"],
                input_ids=t["input_ids"], loss_mask=t["loss_mask"], storage_dtype="bfloat16",
                target_token=t["target_token"])
    _edit_manifest(fs, 0, lambda m: m["chunks"][1].update(bytes=path.stat().st_size))
    _edit_manifest(fs, 0, lambda m: m.update(bytes=sum(c["bytes"] for c in m["chunks"])))
    msg = _fail(fs)
    assert "shard 0 chunk chunk-00001.safetensors" in msg and "no tensor 'target_topk_ids'" in msg
    assert "no tensor 'target_topk_logprobs'" in msg

    # no top-k: no key in the manifests nor in the index; such an index (any written before the key) reads as 0
    fs = make_feature_set(tmp_path / "k0")
    assert "target_top_k" not in fs.manifest(0)
    index = fs.merge()
    assert "target_top_k" not in index and "target_top_k" not in read_json(fs.index)
    features = FeatureIndex(fs.index)
    meta = FeatureMeta.of(features)
    assert features.target_top_k == 0 and meta.target_top_k == 0 and "target_top_k" not in meta.meta
    got = features.read(features.ref(0))
    assert "target_topk_ids" not in got and "target_topk_logprobs" not in got


def test_float8_storage_with_scales_merges(tmp_path):
    fs = make_feature_set(tmp_path, storage="float8_e4m3fn", target_token=False, num_rows=5)
    index = fs.merge(verify_sha256=True)
    assert index["storage_dtype"] == "float8_e4m3fn" and not index["has_target_token"]
    header = read_safetensors_header(fs.index.parent / index["chunks"][0]["path"])
    assert header.tensors["hidden_states"]["dtype"] == "F8_E4M3"
    assert header.tensors["scales"]["shape"] == [index["chunks"][0]["num_tokens"], 2]
    every = torch.cat([fs.hidden[r] for r in range(5)]).reshape(-1, 2, HIDDEN)
    truth = every.pow(2).mean(dim=(0, 2)).sqrt()
    for row, want in zip(index["layer_stats"], truth.tolist()):
        assert math.isclose(row["rms"], want, rel_tol=1e-5)


def test_merge_settings_hold_the_stage_keys():
    from draftsmith.stages import STAGE_KEYS

    assert MergeSettings.keys() == {"merge": STAGE_KEYS["merge"]["merge"]["runtime"]}
    assert MergeSliceSettings.keys() == {"merge": STAGE_KEYS["merge_slice"]["merge"]["runtime"]}
    assert MergeSettings.from_config().merge.verify_sha256 is False  # the schema default
    with pytest.raises(ValueError, match="did you mean 'verify_sha256'"):
        MergeSettings.from_config({"merge": {"verify_sha265": True}})


def test_header_reader_matches_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int64)}, str(path),
              metadata={"k": "v"})
    header = read_safetensors_header(path)
    with safe_open(str(path), "pt") as fh:
        for name in fh.keys():
            assert header.tensors[name]["shape"] == list(fh.get_slice(name).get_shape())
        assert header.metadata == fh.metadata()
    assert 8 + header.header_bytes + header.data_bytes == path.stat().st_size


def test_merge_rule_runs_through_snakemake(tmp_path):
    """rules/merge.smk + scripts/merge.py: writes the index; merge.verify_sha256 (a runtime key,
    read from the config) turns on the chunk checksums."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("Snakefile", "config.yaml"):
        shutil.copy(repo / name, work / name)
    for name in ("rules", "scripts", "schemas", "draftsmith", "envs"):
        shutil.copytree(repo / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    fs = make_feature_set(work / "results")

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "snakemake", "results/features/index.json", "--cores", "2",
                               "--allowed-rules", "merge", *extra], cwd=work, capture_output=True, text=True)

    path = fs.chunk_path(0, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (work / "verify.yaml").write_text("merge:\n  verify_sha256: true\n")
    proc = run("--configfile", "verify.yaml")
    assert proc.returncode != 0
    log = (work / "logs" / "merge" / "merge.log").read_text()
    assert "shard 0 chunk chunk-00000.safetensors" in log and "differs from the manifest's" in log
    assert not fs.index.exists()

    proc = run()  # header-only by default
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = read_json(fs.index)
    assert index["num_samples"] == len(fs.ids) and index["num_tokens"] == sum(fs.lengths)
    assert "per-layer statistics" in (work / "logs" / "merge" / "merge.log").read_text()


def test_merges_the_real_extract_stage_output(tmp_path):
    """Contract between stages: shards written by draftsmith.extract (tiny float32 llama target, 2 shards,
    several chunks each) merge, and the merged RMS equals the RMS of the stored features."""
    from draftsmith import extract
    from tiny import tiny_target

    target = tmp_path / "target"
    tiny_target("llama").save_pretrained(target)
    lengths = [23, 5, 40, 11, 17, 3, 30, 8]
    ids = [f"conv{r:02d}#1" for r in range(len(lengths))]
    _write_tokenized(tmp_path / "train.parquet", ids, lengths)
    plan = extract.build_plan(tmp_path / "train.parquet", target, extract.ExtractPlanSettings.from_config(
        {"extract": {"shards": 2}, "drafter": {"target_layer_ids": [1, 3]}}))
    write_json(tmp_path / "features" / "plan.json", plan)
    manifests = [tmp_path / "features" / f"shard-{s}" / "manifest.json" for s in range(2)]
    for s, path in enumerate(manifests):
        settings = extract.ExtractShardSettings.from_config(
            {"extract": {"token_budget": 64, "chunk_tokens": 40, "storage_dtype": "bfloat16"},
             "target": {"dtype": "float32"}})
        extract.extract_shard(plan_path=tmp_path / "features" / "plan.json", tokenized_path=tmp_path / "train.parquet",
                              target_dir=target, manifest_path=path, shard=s, settings=settings, device="cpu")

    index = merge_features(tmp_path / "features" / "plan.json", manifests, tmp_path / "train.parquet",
                           tmp_path / "features" / "index.json",
                           settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    assert index["num_samples"] == len(lengths) and index["num_tokens"] == sum(lengths)
    assert len(index["chunks"]) > 2 and index["layer_ids"] == [1, 3] and index["has_target_token"]
    stored = torch.cat([read_chunk(tmp_path / "features" / c["path"])["features"] for c in index["chunks"]])
    truth = stored.reshape(sum(lengths), 2, -1).pow(2).mean(dim=(0, 2)).sqrt()
    got = torch.tensor([row["rms"] for row in index["layer_stats"]], dtype=torch.float32)
    torch.testing.assert_close(got, truth, rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------------------ subset plans


SUBSET_ROWS = [1, 2, 4, 6, 7]


def make_subset_set(root: Path, subset=None, *, rows=SUBSET_ROWS, num_rows=9, num_shards=2) -> FeatureSet:
    """A correct feature set of a subset plan (stream mode: a phase's slice), from draftsmith.shard_plan.shard_plan:
    the tokenized set has ``num_rows`` rows, the plan and the shards only ``rows``."""
    subset = subset or {"phase": 2}
    lengths = [5 + (7 * r) % 11 for r in range(num_rows)]
    ids = [f"{r:04x}c0ffee{r:02d}" for r in range(num_rows)]
    tokenized = root / "tokenized" / "train.parquet"
    input_ids, loss_mask = _write_tokenized(tokenized, ids, lengths)
    plan = shard_plan(rows, [lengths[r] for r in rows], num_shards, layer_ids=[1, 3], hidden_size=HIDDEN,
                      num_target_layers=4, tokenized_rows=num_rows, tokenized_tokens=sum(lengths), subset=subset)
    plan_path = root / "plans" / "phase.json"
    write_json(plan_path, plan)
    fs = FeatureSet(root=root, plan=plan_path, tokenized=tokenized, manifests=[], ids=ids, lengths=lengths)
    fs._input_ids, fs._loss_mask = input_ids, loss_mask
    for spec in plan["shards"]:
        fs.manifests.append(write_shard(fs, spec["shard"], spec["rows"], num_shards=num_shards, layer_ids=[1, 3],
                                        input_ids=input_ids, loss_mask=loss_mask, subset=subset))
    return fs


def test_subset_plan_merges_exactly_its_rows_and_the_index_goes_anywhere(tmp_path):
    fs = make_subset_set(tmp_path)
    plan = read_json(fs.plan)
    assert plan["subset"] == {"phase": 2} and plan["num_samples"] == len(SUBSET_ROWS)
    assert sorted(r for s in plan["shards"] for r in s["rows"]) == SUBSET_ROWS
    index_path = tmp_path / "elsewhere" / "phase-2" / "index.json"
    index = merge_features(fs.plan, fs.manifests, fs.tokenized, index_path,
                           settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    assert index == read_json(index_path) and index["subset"] == {"phase": 2}
    assert index["num_samples"] == len(SUBSET_ROWS) == plan["num_samples"]
    assert index["num_tokens"] == sum(fs.lengths[r] for r in SUBSET_ROWS) == plan["num_tokens"]
    seen = []
    for chunk in index["chunks"]:
        assert not Path(chunk["path"]).is_absolute()
        with safe_open(str(index_path.parent / chunk["path"]), "pt") as fh:
            assert fh.get_tensor("sample_index").tolist() == chunk["rows"]
        seen += chunk["rows"]
    assert sorted(seen) == SUBSET_ROWS


def test_subset_plan_names_a_missing_and_a_foreign_row_with_the_subset(tmp_path):
    fs = make_subset_set(tmp_path, {"heldout": True})
    plan = read_json(fs.plan)
    # the plan gains row 3 for shard 0, which no chunk holds; shard 1 stores row 8, which the plan does not list
    plan["shards"][0]["rows"] = sorted(plan["shards"][0]["rows"] + [3])
    plan["shards"][0]["num_tokens"] += fs.lengths[3]
    plan["num_samples"] += 1
    plan["num_tokens"] += fs.lengths[3]
    write_json(fs.plan, plan)
    shard1 = plan["shards"][1]["rows"]
    write_shard(fs, 1, shard1 + [8], num_shards=2, layer_ids=[1, 3], input_ids=fs._input_ids,
                loss_mask=fs._loss_mask, subset={"heldout": True})
    msg = _fail(fs)
    assert "problem(s) in the extracted features (held-out):" in msg
    assert (f"held-out: sample row 3 (id {fs.ids[3]!r}), planned for shard 0, is in no chunk of shard 0's "
            "manifest") in msg
    assert "held-out: shard 1 chunk chunk-0000" in msg and f"sample row 8 (id {fs.ids[8]!r}) is not one of" in msg


def test_subset_plan_refuses_a_shard_of_another_subset(tmp_path):
    fs = make_subset_set(tmp_path, {"phase": 2})
    write_shard(fs, 0, read_json(fs.plan)["shards"][0]["rows"], num_shards=2, layer_ids=[1, 3],
                input_ids=fs._input_ids, loss_mask=fs._loss_mask, subset={"phase": 1})
    msg = _fail(fs)
    assert "phase 2: shard 0 (" in msg and "extracted for phase 1, the plan is phase 2's" in msg


def test_shard_plan_checks_its_rows():
    kw = dict(layer_ids=[1], hidden_size=HIDDEN, num_target_layers=4, tokenized_rows=5, tokenized_tokens=50)
    whole = shard_plan(range(5), [10] * 5, 2, **kw)
    assert "subset" not in whole and sorted(r for s in whole["shards"] for r in s["rows"]) == list(range(5))
    with pytest.raises(ValueError, match="covers all 5 tokenized rows, got 3"):
        shard_plan([0, 1, 2], [10] * 3, 2, **kw)
    with pytest.raises(ValueError, match="row 2 is listed twice"):
        shard_plan([2, 0, 2], [10] * 3, 2, subset={"phase": 0}, **kw)
    with pytest.raises(ValueError, match="outside the tokenized set"):
        shard_plan([4, 5], [10] * 2, 1, subset={"phase": 0}, **kw)
    with pytest.raises(ValueError, match="plan subset"):
        shard_plan([1], [10], 1, subset={"slice": 0}, **kw)
    # the same rows in any order make the same plan, balanced by tokens
    a = shard_plan([4, 0, 3], [7, 9, 2], 2, subset={"phase": 1}, reserve_bytes=123, **kw)
    assert a == shard_plan([0, 3, 4], [9, 2, 7], 2, subset={"phase": 1}, reserve_bytes=123, **kw)
    assert (a["num_samples"], a["num_tokens"], a["reserve_bytes"]) == (3, 18, 123)
    assert [s["num_tokens"] for s in a["shards"]] == [9, 9]
