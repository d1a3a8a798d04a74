"""extract: golden features against ``output_hidden_states`` of each sample alone, resume, sanity, fp8.

Float32 tiny random targets (tests/tiny.py) saved with ``save_pretrained``; every test runs on the CPU
in a few seconds. The one CUDA test (bf16, flash-linear-attention when installed) is skipped without a GPU.
"""

from __future__ import annotations

import json
import logging
import math
import os
import runpy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftsmith import disk
from draftsmith import extract as ex
from draftsmith.config import fill_architecture_defaults, schema_defaults
from draftsmith.features import dequantize_fp8, quantize_fp8, read_chunk, write_safetensors
from draftsmith.io import read_json, sha256_file, write_json
from draftsmith.merge import MergeSettings
from draftsmith.shard_plan import balance_shards
from draftsmith.target import decoder_layers
from draftsmith.target_layers import default_target_layer_ids
from draftsmith.tokenized import read_tokenized
from extraction import LAYER_IDS, LENGTHS, alone, run_shard, setup_run, stored_samples, write_tokenized
from tiny import VOCAB, tiny_target

REPO = Path(__file__).resolve().parents[1]
KINDS = ["llama", "qwen3_5", "qwen3_next"]


# ---------------------------------------------------------------------------------------- fixtures


def with_defaults(config: dict) -> dict:
    """``config`` as the workflow's validated config holds it: every key of the extraction rules' sections, schema
    defaults where not given."""
    sections = set(config) | {"extract", "drafter", "target", "train", "stream", "gpu"}
    filled = {section: {**schema_defaults(section), **config.get(section, {})} for section in sections}
    fill_architecture_defaults(filled)
    return filled


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny float32 targets saved as HF folders: kind -> folder."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for kind in KINDS:
        tiny_target(kind).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


# ---------------------------------------------------------------------------------- plan, batches


def test_default_layer_ids_follow_the_official_formula():
    # values of z-lab dflash.model.build_target_layer_ids (dflash 0.1.0)
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    drafter = ex.PlanDrafterOptions.from_mapping
    assert ex.resolve_layer_ids(drafter({"num_layers": 2, "target_layer_ids": None}), 30) == [1, 27]
    assert ex.resolve_layer_ids(drafter({"num_layers": 1, "num_target_features": 3}), 12) == [1, 5, 9]
    with pytest.raises(ValueError, match="target layer id 4 is outside 0..3"):
        ex.resolve_layer_ids(drafter({"target_layer_ids": [0, 4]}), 4)


def test_settings_hold_the_stage_keys_and_the_effective_tap_count():
    """ExtractPlanSettings / ExtractShardSettings (and the stream-mode rules' ExtractSliceSettings /
    ExtractHeldoutSettings): exactly the keys draftsmith.stages names for their rules; with neither target_layer_ids
    nor num_target_features, the tap count is drafter.num_layers (as the rule's params)."""
    from draftsmith.stages import STAGE_KEYS, rule_params

    for cls in (ex.ExtractPlanSettings, ex.ExtractShardSettings, ex.ExtractSliceSettings,
                ex.ExtractHeldoutSettings):
        want = {section: set(kinds.get("output", ())) | set(kinds.get("runtime", ()))
                for section, kinds in STAGE_KEYS[cls.STAGE].items()}
        assert {section: set(keys) for section, keys in cls.keys().items()} == want
    config = with_defaults({"drafter": {"num_layers": 3, "target_layer_ids": None, "num_target_features": None},
                            "extract": {"shards": 2, "storage_dtype": "bfloat16", "store_target_tokens": True},
                            "target": {"trust_remote_code": False}})
    from_rule = ex.ExtractPlanSettings.from_rule(rule_params(config, "extract_plan"), config)
    assert from_rule == ex.ExtractPlanSettings.from_config(config)
    assert from_rule.drafter.num_target_features == 3 and from_rule.extract.shards == 2
    with pytest.raises(ValueError, match="extract.storage_dtype 'float16' not in"):
        ex.ExtractShardSettings.from_config({"extract": {"storage_dtype": "float16"}})


def test_shards_are_balanced_deterministic_and_complete():
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 5000, 997)
    shards = balance_shards(tokens, 8)
    assert shards == balance_shards(tokens, 8)
    assert sorted(r for s in shards for r in s) == list(range(997))
    loads = [int(tokens[s].sum()) for s in shards]
    assert max(loads) - min(loads) <= tokens.max()  # LPT: within one row of each other
    assert all(s == sorted(s) for s in shards)
    assert balance_shards([3, 2], 4)[2:] == [[], []]


def test_batches_respect_the_token_budget_and_long_rows_run_alone():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 700, 300).tolist() + [1000, 512]
    rows = list(range(len(lengths)))
    batches = ex.make_batches(rows, lengths, 512)
    assert sorted(r for b in batches for r in b.rows) == rows
    for b in batches:
        assert list(b.lengths) == sorted(b.lengths, reverse=True)
        assert b.padded_tokens <= 512 or len(b.rows) == 1
        if max(b.lengths) >= 512:
            assert len(b.rows) == 1
    firsts = [b.lengths[0] for b in batches]
    assert firsts == sorted(firsts, reverse=True)
    chunks = ex.make_chunks(batches, 5000)
    assert [b for c in chunks for b in c] == batches
    assert all(sum(b.real_tokens for b in c) >= 5000 for c in chunks[:-1])


def test_plan_contract(tmp_path, targets):
    _, plan = setup_run(tmp_path, targets["qwen3_5"], shards=3, layer_ids=None)
    assert plan["format"] == "draftsmith.plan/1"
    assert plan["layer_ids"] == [2]  # drafter.num_layers missing -> n = 1 -> [L // 2]
    assert (plan["hidden_size"], plan["num_target_layers"]) == (64, 4)
    assert plan["tokenized_rows"] == len(LENGTHS) and plan["tokenized_tokens"] == sum(LENGTHS)
    assert sorted(r for s in plan["shards"] for r in s["rows"]) == list(range(len(LENGTHS)))
    assert [s["num_tokens"] for s in plan["shards"]] == [sum(LENGTHS[r] for r in s["rows"]) for s in plan["shards"]]
    assert [s["shard"] for s in plan["shards"]] == [0, 1, 2]


# ------------------------------------------------------------------------------------- golden tests


@pytest.mark.parametrize("kind", KINDS)
def test_stored_features_equal_each_sample_alone(tmp_path, targets, kind):
    """Mixed lengths in one right-padded batch == output_hidden_states[i + 1] of the sample alone."""
    ids, plan = setup_run(tmp_path, targets[kind], shards=2)
    budget_batches = ex.make_batches(plan["shards"][0]["rows"], [LENGTHS[r] for r in plan["shards"][0]["rows"]], 200)
    assert any(len(set(b.lengths)) >= 3 for b in budget_batches), "the test must mix lengths in a batch"
    model = tiny_target(kind)
    ref = {r: alone(model, ids[r]) for r in range(len(LENGTHS))}
    table = pq.read_table(tmp_path / "train.parquet")
    masks = table.column("loss_mask").to_pylist()
    seen = []
    for shard, padding_mask in ((0, True), (1, True), (0, False)):
        out = f"features-mask{int(padding_mask)}"
        man = run_shard(tmp_path, targets[kind], out=out, shard=shard, padding_mask=padding_mask)
        assert man["num_samples"] == len(plan["shards"][shard]["rows"])
        assert man["num_tokens"] == plan["shards"][shard]["num_tokens"]
        assert man["layer_ids"] == LAYER_IDS and man["has_target_token"]
        assert man["tokenizer_fingerprint"] == "f" * 64
        assert man["chat_template_kwargs"] == {"enable_thinking": False}
        for row, hidden, t in stored_samples(tmp_path / out / f"shard-{shard}", man):
            feats, argmax = ref[row]
            assert hidden.shape == (LENGTHS[row], 3 * 64)
            diff = (hidden - feats).abs().max().item()
            assert diff <= 1e-4, f"{kind} row {row} mask={padding_mask}: max abs diff {diff}"
            assert torch.equal(t["target_token"], argmax), f"{kind} row {row}: target_token"
            assert t["input_ids"].tolist() == ids[row].tolist()
            assert t["loss_mask"].tolist() == masks[row]
            if padding_mask:
                seen.append(row)
    assert sorted(seen) == list(range(len(LENGTHS)))  # every sample exactly once over the shards


def test_features_only_stops_after_the_deepest_tapped_layer(tmp_path, targets):
    ids, _ = setup_run(tmp_path, targets["qwen3_5"], layer_ids=[0, 1])
    model = tiny_target("qwen3_5")
    ran = []
    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    man = run_shard(tmp_path, targets["qwen3_5"], model=model, store_target_tokens=False)
    assert not man["has_target_token"]
    assert set(ran) == {0, 1}, "layers after the deepest tapped one must not run"
    for row, hidden, t in stored_samples(tmp_path / "features" / "shard-0", man):
        assert "target_token" not in t
        diff = (hidden - alone(model, ids[row], [0, 1])[0]).abs().max().item()
        assert diff <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_target_topk_equals_the_models_distribution_per_sample(tmp_path, targets, kind):
    """extract.store_target_topk = 4, right-padded batches of mixed lengths: per real token the stored ids are
    torch.topk of the sample's logits alone, most likely first, their float16 log-probs its log_softmax there, and
    column 0 the stored target_token; the chunks hold the contract's layout and merge into an index of k = 4 whose
    reader gives them as int64 / float32."""
    from draftsmith.features import FeatureIndex, expected_tensors, read_safetensors_header
    from draftsmith.merge import merge_features

    ids, plan = setup_run(tmp_path, targets[kind], shards=2)
    rows0 = plan["shards"][0]["rows"]
    assert any(len(set(b.lengths)) >= 3 for b in ex.make_batches(rows0, [LENGTHS[r] for r in rows0], 200))
    model = tiny_target(kind)
    manifests, seen = [], []
    for shard in range(2):
        man = run_shard(tmp_path, targets[kind], shard=shard, store_target_topk=4)
        assert man["target_top_k"] == 4 and man["has_target_token"]
        projected = disk.projected_bytes(man["num_tokens"], man["num_samples"], 3, 64, "float32", True,
                                         len(man["chunks"]), target_topk=4)
        assert abs(man["bytes"] - projected) <= 0.02 * projected, (man["bytes"], projected)
        manifests.append(tmp_path / "features" / f"shard-{shard}" / "manifest.json")
        folder = manifests[-1].parent
        for rec in man["chunks"]:
            header = read_safetensors_header(folder / rec["file"])
            assert {k: (v["dtype"], v["shape"]) for k, v in header.tensors.items()} == {
                k: (dtypes[0], shape) for k, (dtypes, shape)
                in expected_tensors(man, rec["num_samples"], rec["num_tokens"]).items()}
            assert header.tensors["target_topk_logprobs"]["shape"] == [rec["num_tokens"], 4]
            assert json.loads(header.metadata["draftsmith"])["target_top_k"] == 4
        for row, _, t in stored_samples(folder, man):
            with torch.no_grad():
                logits = model(torch.from_numpy(ids[row].astype(np.int64))[None], use_cache=False).logits[0]
            want = torch.topk(logits, 4)
            assert t["target_topk_ids"].dtype == torch.int32 and t["target_topk_logprobs"].dtype == torch.float16
            assert torch.equal(t["target_topk_ids"].long(), want.indices), f"{kind} row {row}: top-k ids"
            torch.testing.assert_close(t["target_topk_logprobs"].float(),
                                       logits.float().log_softmax(-1).gather(-1, want.indices),
                                       rtol=2 ** -10, atol=1e-4)  # float16 rounding
            assert torch.equal(t["target_topk_ids"][:, 0], t["target_token"])
            assert torch.equal(t["target_token"], logits.argmax(-1).to(torch.int32))
            seen.append(row)
    assert sorted(seen) == list(range(len(LENGTHS)))
    index = merge_features(tmp_path / "plan.json", manifests, tmp_path / "train.parquet",
                           tmp_path / "features" / "index.json",
                           settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    assert index["target_top_k"] == 4
    features = FeatureIndex(tmp_path / "features" / "index.json")
    got = features.read(features.ref(3))
    assert features.target_top_k == 4 and got["target_topk_ids"].shape == (LENGTHS[3], 4)
    assert got["target_topk_ids"].dtype == torch.int32 and got["target_topk_logprobs"].dtype == torch.float16
    assert torch.equal(got["target_topk_ids"][:, 0].long(), got["target_token"])


def test_default_target_topk_writes_what_extraction_wrote_before(tmp_path, targets):
    """extract.store_target_topk at its default 0 (or given as 0) changes no output: the manifest, the chunks'
    tensors and metadata and the resume layout are those of before the key existed (no target_top_k anywhere, the
    layout key of the same parts), so folders extracted before resume and their indexes keep their fingerprints."""
    from draftsmith.extract.shard import _chunk_work, _content_hash, _layout_key
    from draftsmith.features import read_safetensors_header

    setup_run(tmp_path, targets["llama"])
    man = run_shard(tmp_path, targets["llama"], out="default")
    assert list(man) == ["format", "shard", "num_shards", "layer_ids", "layer_semantics", "hidden_size",
                         "num_target_layers", "storage_dtype", "has_target_token", "target_fingerprint",
                         "tokenizer_fingerprint", "chat_template_kwargs", "num_samples", "num_tokens", "bytes",
                         "chunks", "stats"]
    folder = tmp_path / "default" / "shard-0"
    for rec in man["chunks"]:
        header = read_safetensors_header(folder / rec["file"])
        assert sorted(header.tensors) == ["hidden_states", "input_ids", "loss_mask", "offsets", "sample_index",
                                          "target_token"]
        assert list(json.loads(header.metadata["draftsmith"])) == ["shard", "layer_ids", "hidden_size",
                                                                  "storage_dtype", "has_target_token",
                                                                  "target_fingerprint"]
    # the layout key of before: the same parts, no target_topk among them
    opts = ex.ExtractShardSettings.from_config({"extract": {"token_budget": 200, "chunk_tokens": 100}}).extract
    tok = read_tokenized(tmp_path / "train.parquet")
    rows = read_json(tmp_path / "plan.json")["shards"][0]["rows"]
    chunks = _chunk_work(ex.make_batches(rows, [LENGTHS[r] for r in rows], opts.token_budget), tok, opts.chunk_tokens)
    before = _layout_key(chunks=[[c.rows, c.ids, [list(b.rows) for b in c.batches]] for c in chunks],
                         layer_ids=LAYER_IDS, storage="float32", target_token=True, padding_mask=True,
                         target=man["target_fingerprint"], dtype="float32",
                         content=_content_hash(tok, rows))
    assert read_json(folder / "progress.json")["layout"] == before
    again = run_shard(tmp_path, targets["llama"], out="explicit", store_target_topk=0)
    for rec, other in zip(man["chunks"], again["chunks"]):
        assert rec["sha256"] == other["sha256"]
    assert (tmp_path / "explicit/shard-0/manifest.json").read_bytes() == (folder / "manifest.json").read_bytes()


def test_argmax_first_puts_the_argmax_in_column_0_of_exactly_tied_top_k():
    """topk and argmax may each pick another of exactly tied logits on a GPU: column 0 must be target_token."""
    from draftsmith.extract.extractor import argmax_first

    top = torch.tensor([[5, 7, 2, 9], [3, 1, 4, 8], [6, 0, 2, 4], [1, 2, 3, 4]])
    arg = torch.tensor([7, 3, 9, 2])  # row 0: tie ranked second; row 1: already first; row 2: > k ties; row 3: third
    got = argmax_first(top, arg)
    assert got.tolist() == [[7, 5, 2, 9], [3, 1, 4, 8], [9, 0, 2, 4], [2, 1, 3, 4]]
    assert top.tolist()[0] == [5, 7, 2, 9]  # the input is not modified
    # on real logits with ties at the maximum: the ids stay a top k (the same values), column 0 is the argmax
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 0.0, 2.0, 1.0, -1.0]])
    for k in (1, 2, 3):
        values, ids = logits.topk(k, dim=-1)
        fixed = argmax_first(ids, logits.argmax(-1))
        assert torch.equal(fixed[:, 0], logits.argmax(-1))
        assert torch.equal(logits.gather(-1, fixed), values)


def test_target_topk_is_refused_without_target_tokens_or_above_the_vocabulary():
    with pytest.raises(ValueError, match=r"extract.store_target_topk 4 must be 0, or > 0 with "
                                         r"extract.store_target_tokens: true \(it is False\)"):
        ex.ExtractShardSettings.from_config({"extract": {"store_target_topk": 4, "store_target_tokens": False}})
    with pytest.raises(ValueError, match="extract.store_target_topk -1 must be 0"):
        ex.ExtractPlanSettings.from_config({"extract": {"store_target_topk": -1}})
    model = tiny_target("llama")
    with pytest.raises(ValueError, match=rf"extract.store_target_topk {VOCAB + 1} is outside 0..{VOCAB}"):
        ex.FeatureExtractor(model, LAYER_IDS, target_tokens=True, target_topk=VOCAB + 1)
    with pytest.raises(ValueError, match=r"extract.store_target_topk 2 must be 0, or > 0 with "
                                         r"extract.store_target_tokens: true \(it is False\)"):
        ex.FeatureExtractor(model, LAYER_IDS, target_tokens=False, target_topk=2)
    # a target whose logits are not lm_head's output (Gemma's soft-capping, Cohere's scale): its top-k is refused,
    # its greedy token is not
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"transforms its logits after lm_head \(final_logit_softcapping = 30.0\)"):
        ex.FeatureExtractor(model, LAYER_IDS, target_tokens=True, target_topk=4)
    ex.FeatureExtractor(model, LAYER_IDS, target_tokens=True)
    model.config.final_logit_softcapping = None
    model.config.logit_scale = 0.0625
    assert ex.logit_transform(model.config) == "logit_scale = 0.0625"
    model.config.logit_scale = 1.0
    assert ex.logit_transform(model.config) == ""
    # a transform no config key names (here a wrapped forward halving the logits) is caught on the first batch
    forward = model.forward

    def halved(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = halved
    with ex.FeatureExtractor(model, LAYER_IDS, target_tokens=True, target_topk=4) as extractor:
        with pytest.raises(ValueError, match=r"logits are not lm_head of its last hidden state \(max difference"):
            extractor([np.arange(3, 12), np.arange(5, 9)])
    model.forward = forward
    with ex.FeatureExtractor(model, LAYER_IDS, target_tokens=True, target_topk=4) as extractor:
        assert len(extractor([np.arange(3, 12), np.arange(5, 9)])) == 4


def test_bf16_storage_projection_and_stats(tmp_path, targets):
    ids, _ = setup_run(tmp_path, targets["llama"])
    model = tiny_target("llama")
    man = run_shard(tmp_path, targets["llama"], storage_dtype="bfloat16")
    projected = disk.projected_bytes(sum(LENGTHS), len(LENGTHS), 3, 64, "bfloat16", True, len(man["chunks"]))
    assert abs(man["bytes"] - projected) <= 0.02 * projected, (man["bytes"], projected)
    assert man["bytes"] == sum(os.path.getsize(tmp_path / "features/shard-0" / c["file"]) for c in man["chunks"])
    for rec in man["chunks"]:
        assert sha256_file(tmp_path / "features/shard-0" / rec["file"]) == rec["sha256"]
    all_feats = []
    for row, hidden, _ in stored_samples(tmp_path / "features" / "shard-0", man):
        ref = alone(model, ids[row])[0]
        assert (hidden - ref).abs().max().item() <= 2 ** -8 * ref.abs().max().item()  # bf16 rounding
        all_feats.append(ref)
    ref_rms = torch.cat(all_feats).view(-1, 3, 64).pow(2).mean(dim=(0, 2)).sqrt()
    assert np.allclose(man["stats"]["rms"], ref_rms.numpy(), rtol=1e-3)
    assert man["stats"]["nonfinite"] == 0 and man["stats"]["zero_rows"] == 0


def test_chunk_writer_is_byte_identical_to_safetensors(tmp_path):
    """Our hashing writer produces exactly safetensors.torch.save_file's bytes and the file's sha256."""
    from safetensors.torch import load_file, save_file

    tensors = {"hidden_states": torch.randn(37, 40).to(torch.bfloat16), "scales": torch.rand(37, 2),
               "target_token": torch.randint(0, 9, (37,), dtype=torch.int32),
               "input_ids": torch.randint(0, 9, (37,), dtype=torch.int32),
               "loss_mask": torch.ones(37, dtype=torch.int8),
               "offsets": torch.tensor([0, 10, 37]), "sample_index": torch.tensor([4, 2]),
               "fp8": torch.randn(7, 3).to(torch.float8_e4m3fn), "f32": torch.randn(3, 3),
               "target_topk_logprobs": torch.randn(37, 4).half(), "f16": torch.randn(5).half()}
    meta = {"draftsmith": json.dumps({"layer_ids": [1, 2], "note": 'quote " here'})}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata=meta)
    digest = write_safetensors(tmp_path / "ours.safetensors", tensors, metadata=meta)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert digest == sha256_file(tmp_path / "ours.safetensors")
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(back[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)
    with pytest.raises(ValueError, match="'x' is torch.float64"):
        write_safetensors(tmp_path / "bad.safetensors", {"x": torch.zeros(2, dtype=torch.float64)})


def test_chunk_round_trip_through_the_features_format(tmp_path):
    """write_chunk stores what the format declares (fp8 encoded with quantize_fp8 when given float values), and
    read_chunk / ChunkFile give it back; counts that disagree with the samples' lengths are refused."""
    from draftsmith.features import ChunkFile, expected_tensors, read_safetensors_header, write_chunk

    torch.manual_seed(0)
    x = torch.randn(12, 2 * 8)
    ids, mask = np.arange(12, dtype=np.int64), (np.arange(12) % 2).astype(np.int8)
    for storage in ("bfloat16", "float8_e4m3fn"):
        path = tmp_path / f"{storage}.safetensors"
        digest = write_chunk(path, features=x, lengths=[5, 7], sample_index=[9, 4], input_ids=ids, loss_mask=mask,
                             storage_dtype=storage, target_token=ids + 1, num_layers=2)
        assert digest == sha256_file(path)
        header = read_safetensors_header(path)
        meta = {"layer_ids": [1, 3], "hidden_size": 8, "storage_dtype": storage, "has_target_token": True}
        assert {k: (v["dtype"], v["shape"]) for k, v in header.tensors.items()} == {
            k: (dtypes[0], shape) for k, (dtypes, shape) in expected_tensors(meta, 2, 12).items()}
        t = read_chunk(path)
        want = x.to(torch.bfloat16).float() if storage == "bfloat16" else dequantize_fp8(*quantize_fp8(x, 2))
        assert torch.equal(t["features"], want)
        assert t["offsets"].tolist() == [0, 5, 12] and t["sample_index"].tolist() == [9, 4]
        assert t["input_ids"].tolist() == ids.tolist() and t["target_token"].tolist() == (ids + 1).tolist()
        part = ChunkFile(path).read(5, 12, torch.float32)
        assert torch.equal(part["features"], want[5:]) and part["loss_mask"].tolist() == mask[5:].tolist()
    with pytest.raises(ValueError, match="tensor 'input_ids' has 12 rows, 2 samples of 11 tokens need 11"):
        write_chunk(tmp_path / "bad.safetensors", features=x[:11], lengths=[5, 6], sample_index=[0, 1],
                    input_ids=ids, loss_mask=mask[:11], storage_dtype="float32")


def test_chunk_with_target_topk_round_trip_and_a_chunk_without_it_is_refused(tmp_path):
    """write_chunk stores the top-k as the format declares (int32 ids, float16 log-probs, [tokens, k]); ChunkFile
    reads them back and its check, at the index's k, refuses a chunk without them or of another k, naming the
    file and the tensor; the writer refuses one of the two without the other."""
    from draftsmith.features import ChunkFile, expected_tensors, read_safetensors_header, write_chunk

    x = torch.randn(12, 2 * 8)
    ids, mask = np.arange(12, dtype=np.int64), np.ones(12, dtype=np.int8)
    top = torch.stack([torch.from_numpy(ids) + j for j in range(3)], dim=1)
    logprobs = -torch.rand(12, 3).cumsum(1)
    common = dict(features=x, lengths=[5, 7], sample_index=[9, 4], input_ids=ids, loss_mask=mask,
                  storage_dtype="bfloat16", target_token=ids)
    path = tmp_path / "topk.safetensors"
    write_chunk(path, **common, target_topk_ids=top, target_topk_logprobs=logprobs)
    meta = {"layer_ids": [1, 3], "hidden_size": 8, "storage_dtype": "bfloat16", "has_target_token": True,
            "target_top_k": 3}
    header = read_safetensors_header(path)
    assert {k: (v["dtype"], v["shape"]) for k, v in header.tensors.items()} == {
        k: (dtypes[0], shape) for k, (dtypes, shape) in expected_tensors(meta, 2, 12).items()}
    assert header.tensors["target_topk_ids"]["shape"] == [12, 3]
    assert header.tensors["target_topk_logprobs"]["dtype"] == "F16"
    chunk = ChunkFile(path)
    assert chunk.check(storage_dtype="bfloat16", has_target_token=True, width=16, top_k=3) == ([0, 5, 12], [9, 4])
    part = chunk.read(5, 12)
    assert torch.equal(part["target_topk_ids"], top[5:].to(torch.int32))
    assert torch.equal(part["target_topk_logprobs"], logprobs[5:].half())
    with pytest.raises(ValueError, match=r"topk\.safetensors: target_topk_ids has shape \[12, 3\], expected "
                                         r"\[tokens, k\] = \[12, 4\]"):
        chunk.check(storage_dtype="bfloat16", has_target_token=True, width=16, top_k=4)
    write_chunk(tmp_path / "plain.safetensors", **common)
    assert "target_topk_ids" not in ChunkFile(tmp_path / "plain.safetensors").read()
    with pytest.raises(ValueError, match=r"plain\.safetensors: tensor 'target_topk_ids' is missing"):
        ChunkFile(tmp_path / "plain.safetensors").check(storage_dtype="bfloat16", has_target_token=True, width=16,
                                                        top_k=3)
    with pytest.raises(ValueError, match="target_topk_ids and target_topk_logprobs go together"):
        write_chunk(tmp_path / "bad.safetensors", **common, target_topk_ids=top)
    with pytest.raises(ValueError, match="tensor 'target_topk_ids' has 11 rows"):
        write_chunk(tmp_path / "bad.safetensors", **common, target_topk_ids=top[:11],
                    target_topk_logprobs=logprobs[:11])


# ------------------------------------------------------------------------------------------- resume


def test_resume_after_a_kill_recomputes_nothing_finished(tmp_path, targets):
    target = targets["llama"]
    setup_run(tmp_path, target)
    reference = run_shard(tmp_path, target, out="reference")
    n_chunks = len(reference["chunks"])
    assert n_chunks >= 4

    class Killed(Exception):
        pass

    def kill_after_1(index, rec):
        if index == 1:
            raise Killed

    model = tiny_target("llama")
    with pytest.raises(Killed):
        run_shard(tmp_path, target, model=model, on_chunk=kill_after_1)
    folder = tmp_path / "features" / "shard-0"
    assert not (folder / "manifest.json").exists()
    finished = {r["file"] for r in read_json(folder / "progress.json")["chunks"]}
    assert {"chunk-00000.safetensors", "chunk-00001.safetensors"} <= finished

    # debris of a kill -9: a partial temporary file and a chunk file written but never recorded
    (folder / ".chunk-00003.safetensors.x1y2.tmp.safetensors").write_bytes(b"partial")
    unrecorded = sorted(f"chunk-{i:05d}.safetensors" for i in range(n_chunks)
                        if f"chunk-{i:05d}.safetensors" not in finished)[0]
    (folder / unrecorded).write_bytes(b"half a chunk")

    batches_per_chunk = [len(ex.make_chunks(ex.make_batches(
        list(range(len(LENGTHS))), LENGTHS, 200), 100)[i]) for i in range(n_chunks)]
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda m, a: calls.append(1))
    stats = {}
    man = run_shard(tmp_path, target, model=model, run_stats=stats)
    todo = [i for i in range(n_chunks) if f"chunk-{i:05d}.safetensors" not in finished]
    assert len(calls) == stats["forwards"] == sum(batches_per_chunk[i] for i in todo)
    assert stats["chunks_done"] == len(todo)
    assert not list(folder.glob(".chunk-*"))
    for a, b in zip(man["chunks"], reference["chunks"]):
        assert (folder / a["file"]).read_bytes() == (tmp_path / "reference/shard-0" / b["file"]).read_bytes()
        assert a["sha256"] == b["sha256"]

    # a finished chunk truncated behind our back is detected and redone; nothing else runs
    victim = folder / man["chunks"][2]["file"]
    victim.write_bytes(victim.read_bytes()[:1000])
    calls.clear()
    man2 = run_shard(tmp_path, target, model=model)
    assert len(calls) == batches_per_chunk[2]
    assert victim.read_bytes() == (tmp_path / "reference/shard-0" / victim.name).read_bytes()
    assert man2 == man

    # everything done: no forward at all (the model is not even needed)
    calls.clear()
    assert run_shard(tmp_path, target, model=model) == man and not calls


def test_staged_shard_resumes_after_a_kill_and_appears_only_complete(tmp_path, targets):
    """A staged shard (stream mode) writes in its staging folder; killed after chunk 1, its output folder does not
    exist, the rerun keeps chunks 0 and 1 (same files) and renames the finished folder into place, byte-identical to
    an unstaged run and with no staging path in its records."""
    target = targets["llama"]
    setup_run(tmp_path, target)
    reference = run_shard(tmp_path, target, out="reference")
    staging, out = tmp_path / "stage" / "shard-0", tmp_path / "features" / "shard-0"

    class Killed(Exception):
        pass

    def kill_after_1(index, rec):
        if index == 1:
            raise Killed

    model = tiny_target("llama")
    with pytest.raises(Killed):
        run_shard(tmp_path, target, model=model, on_chunk=kill_after_1, staging_dir=staging)
    assert not out.exists()
    finished = {r["file"] for r in read_json(staging / "progress.json")["chunks"]}
    assert {"chunk-00000.safetensors", "chunk-00001.safetensors"} <= finished
    kept = {name: (staging / name).stat().st_ino for name in finished}

    out.mkdir(parents=True)  # an empty output folder (as a workflow engine may create) is replaced
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda m, a: calls.append(1))
    stats = {}
    man = run_shard(tmp_path, target, model=model, staging_dir=staging, run_stats=stats)
    assert stats["chunks_done"] == len(reference["chunks"]) - len(finished) and len(calls) == stats["forwards"]
    assert not staging.exists() and (out / "manifest.json").is_file()
    assert {name: (out / name).stat().st_ino for name in finished} == kept
    assert man == reference == read_json(out / "manifest.json")
    for rec in reference["chunks"]:
        assert (out / rec["file"]).read_bytes() == (tmp_path / "reference/shard-0" / rec["file"]).read_bytes()
    for name in ("manifest.json", "progress.json"):
        assert str(tmp_path) not in (out / name).read_text()

    # a rerun on the finished folder moves it back to stage, computes nothing and puts it into place again
    calls.clear()
    assert run_shard(tmp_path, target, model=model, staging_dir=staging) == man and not calls
    assert not staging.exists() and (out / "manifest.json").is_file()


def test_subset_plan_extracts_and_merges_exactly_its_rows(tmp_path, targets):
    """Stream mode's extraction: a subset plan (shard_plan.shard_plan, one phase's rows) in two staged shards, merged
    into an index beside them whose totals are the subset's; a sample outside the subset is named with it."""
    from draftsmith.merge import MergeError, merge_features
    from draftsmith.shard_plan import shard_plan

    target = targets["llama"]
    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    rows = [0, 3, 5, 8, 11, 12]
    plan = shard_plan(rows, [LENGTHS[r] for r in rows], 2, layer_ids=LAYER_IDS, hidden_size=64, num_target_layers=4,
                      tokenized_rows=len(LENGTHS), tokenized_tokens=sum(LENGTHS), subset={"phase": 1})
    write_json(tmp_path / "plans" / "phase-1.json", plan)
    manifests = []
    for shard in range(2):
        man = run_shard(tmp_path, target, out="stream/phase-1", shard=shard, plan=tmp_path / "plans/phase-1.json",
                        staging_dir=tmp_path / "stream/.staging/phase-1" / f"shard-{shard}")
        assert man["subset"] == {"phase": 1} and man["num_tokens"] == plan["shards"][shard]["num_tokens"]
        manifests.append(tmp_path / "stream/phase-1" / f"shard-{shard}" / "manifest.json")
    index = merge_features(tmp_path / "plans/phase-1.json", manifests, tmp_path / "train.parquet",
                           tmp_path / "stream/phase-1/index.json",
                           settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    assert (index["num_samples"], index["num_tokens"]) == (len(rows), sum(LENGTHS[r] for r in rows))
    assert index["subset"] == {"phase": 1} and sorted(r for c in index["chunks"] for r in c["rows"]) == rows
    assert all(c["path"].startswith(f"shard-{c['shard']}/") for c in index["chunks"])

    # the plan of another phase, holding one row more, is not satisfied by these shards: the row is named
    other = shard_plan(rows + [1], [LENGTHS[r] for r in rows + [1]], 2, layer_ids=LAYER_IDS, hidden_size=64,
                       num_target_layers=4, tokenized_rows=len(LENGTHS), tokenized_tokens=sum(LENGTHS),
                       subset={"phase": 1})
    write_json(tmp_path / "plans" / "phase-1.json", other)
    with pytest.raises(MergeError, match=r"phase 1: sample row 1 \(id 'conv001#1'\), planned for shard"):
        merge_features(tmp_path / "plans/phase-1.json", manifests, tmp_path / "train.parquet",
                       settings=MergeSettings.from_config({}))


def test_changed_config_restarts_the_shard(tmp_path, targets):
    target = targets["llama"]
    setup_run(tmp_path, target)
    run_shard(tmp_path, target)
    man = run_shard(tmp_path, target, chunk_tokens=300)  # another layout: old chunks are not reused
    assert len(man["chunks"]) < 4
    folder = tmp_path / "features/shard-0"
    assert sorted(p.name for p in folder.glob("chunk-*")) == [c["file"] for c in man["chunks"]]


# ------------------------------------------------------------------------------- refusals and errors


def test_refuses_when_the_disk_cannot_hold_the_projection(tmp_path, targets, monkeypatch):
    setup_run(tmp_path, targets["llama"])
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: 10_000)
    with pytest.raises(disk.DiskSpaceError, match=r"still to write x headroom 1.05 .* only 0.000 GB free"):
        run_shard(tmp_path, targets["llama"], disk_headroom=1.05)
    assert not list((tmp_path / "features/shard-0").glob("chunk-*"))


def test_plan_refuses_when_features_and_reserve_do_not_fit_naming_the_smallest_slices_and_fp8(tmp_path, targets,
                                                                                                monkeypatch):
    """extract_plan fails before any GPU work when features x headroom + reserve exceed the free disk; the message
    names the smallest stream.slices whose slice fits (checked here by trying every count) and fp8's bytes a token."""
    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    reserve = 5_000
    features = disk.projected_bytes(sum(LENGTHS), len(LENGTHS), 3, 64, "bfloat16", True)
    free = reserve + int(features * 1.05 / 3.5)
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: free)
    settings = ex.ExtractPlanSettings.from_config({"drafter": {"target_layer_ids": LAYER_IDS},
                                                   "stream": {"reserve_gb": reserve / 1e9}})
    with pytest.raises(disk.DiskSpaceError) as info:
        ex.build_plan(tmp_path / "train.parquet", targets["llama"], settings)
    smallest = next(s for s in range(1, len(LENGTHS) + 1) if math.ceil(-(-features // s) * 1.05) + reserve <= free)
    assert smallest == 4
    msg = str(info.value)
    assert f"does not fit. The smallest stream.slices that fits is {smallest} " in msg
    fp8 = disk.bytes_per_token(3, 64, "float8_e4m3fn", True)
    assert f"With extract.storage_dtype: float8_e4m3fn ({fp8} bytes a token" in msg
    assert f"{disk.bytes_per_token(3, 64, 'bfloat16', True)} bytes a token in bfloat16" in msg

    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: reserve + math.ceil(features * 1.05))
    assert ex.build_plan(tmp_path / "train.parquet", targets["llama"], settings)["reserve_bytes"] == reserve


def test_shard_disk_check_counts_every_shard_of_the_plan(tmp_path, targets, monkeypatch):
    """Shards run at once: each checks what all shards of its plan still have to write (plus the plan's reserve).
    Two shards whose shares each fit but not together are refused, naming both; once shard 1 is done (its staged
    folder renamed into place), shard 0 fits the same free disk."""
    target = targets["llama"]
    _, plan = setup_run(tmp_path, target, shards=2)
    write_json(tmp_path / "plan.json", {**plan, "reserve_bytes": 0})
    shares = [disk.projected_bytes(s["num_tokens"], len(s["rows"]), 3, 64, "float32", True,
                                   -(-s["num_tokens"] // 100)) for s in plan["shards"]]
    free = int(1.05 * 0.8 * sum(shares))
    assert free > 1.05 * max(shares) + 4096
    staging = tmp_path / ".staging"
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: free)
    with pytest.raises(disk.DiskSpaceError, match=r"shard 0: .* by the 2 shards of the plan, which run at once "
                                                  r"\(shard 0: .*, shard 1: .*\).* only .* GB free"):
        run_shard(tmp_path, target, shard=0, staging_dir=staging / "shard-0")
    assert not list((staging / "shard-0").glob("chunk-*")) and not (tmp_path / "features/shard-0").exists()

    monkeypatch.undo()
    run_shard(tmp_path, target, shard=1, staging_dir=staging / "shard-1")
    monkeypatch.setattr(disk, "free_disk_bytes", lambda path: free)
    man = run_shard(tmp_path, target, shard=0, staging_dir=staging / "shard-0")
    assert man["num_tokens"] == plan["shards"][0]["num_tokens"]


@pytest.mark.parametrize("bad", ["zero", "nan"])
def test_broken_hidden_states_fail_naming_the_sample(tmp_path, targets, bad):
    setup_run(tmp_path, targets["llama"])
    model = tiny_target("llama")
    seqs = []

    def corrupt(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        seqs.append(hidden.shape)
        if len(seqs) == 2:  # second batch, its second row, position 3
            hidden[1, 3] = 0.0 if bad == "zero" else float("nan")
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    decoder_layers(model)[1].register_forward_hook(corrupt)
    batches = ex.make_batches(list(range(len(LENGTHS))), LENGTHS, 200)
    row = batches[1].rows[1]
    what = "all-zero row" if bad == "zero" else "non-finite"
    with pytest.raises(ex.FeatureSanityError,
                       match=rf"sample id 'conv{row:03d}#1' \(tokenized row {row}\) .* layer id 1, position 3: {what}"):
        run_shard(tmp_path, targets["llama"], model=model)


def test_bad_tokenized_input_is_named(tmp_path, targets):
    path = tmp_path / "train.parquet"
    table = pa.table({"id": ["a", "b"], "input_ids": pa.array([[5, 6], [7, 8, 9]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1], [1, 1]], pa.list_(pa.int8())),
                      "num_tokens": pa.array([2, 3], pa.int32())})
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"row 1 \(id b\): num_tokens is 3 but field 'loss_mask' has 2"):
        read_tokenized(path)
    setup_run(tmp_path, targets["llama"], lengths=[4, 6])
    t = pq.read_table(tmp_path / "train.parquet")
    ids = t.column("input_ids").to_pylist()
    ids[1][2] = VOCAB + 7
    pq.write_table(t.set_column(t.schema.get_field_index("input_ids"), "input_ids",
                                pa.array(ids, pa.list_(pa.int32()))), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"row 1 \(id conv001#1\): field 'input_ids' position 2 holds 519"):
        run_shard(tmp_path, targets["llama"])
    write_tokenized(tmp_path / "train.parquet", [4, 6, 8])
    with pytest.raises(ValueError, match="is stale"):
        run_shard(tmp_path, targets["llama"])


# ---------------------------------------------------------------------------------------------- fp8


def test_fp8_round_trip_error_is_bounded():
    torch.manual_seed(0)
    x = torch.randn(512, 3 * 256) * torch.rand(512, 1) * 40  # per-token scales vary over orders
    x[:, 10] *= 50  # an outlier channel, as real hidden states have
    q, scales = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (512, 3) and scales.dtype == torch.float32
    y = dequantize_fp8(q, scales)
    err = (y - x).abs()
    bound = torch.maximum(2 ** -4 * x.abs(), 2 ** -10 * scales.repeat_interleave(256, dim=1))
    assert bool((err <= bound * (1 + 1e-6)).all())
    rel = ((y - x).view(512, 3, -1).norm(dim=-1) / x.view(512, 3, -1).norm(dim=-1))
    assert rel.max().item() < 0.045 and 0.01 < rel.mean().item() < 0.035
    # the row maximum maps to 448 exactly: it survives the round trip up to float32 rounding
    assert torch.allclose(y.view(512, 3, -1).abs().amax(-1), x.view(512, 3, -1).abs().amax(-1), rtol=1e-6)


def test_fp8_storage_end_to_end(tmp_path, targets):
    ids, _ = setup_run(tmp_path, targets["qwen3_5"])
    model = tiny_target("qwen3_5")
    man = run_shard(tmp_path, targets["qwen3_5"], storage_dtype="float8_e4m3fn")
    assert man["storage_dtype"] == "float8_e4m3fn"
    per_token = disk.bytes_per_token(3, 64, "float8_e4m3fn", True)
    assert per_token == 3 * 64 + 12 + 9
    for row, hidden, _ in stored_samples(tmp_path / "features" / "shard-0", man):
        ref = alone(model, ids[row])[0]
        rel = (hidden - ref).view(-1, 3, 64).norm(dim=-1) / ref.view(-1, 3, 64).norm(dim=-1)
        assert rel.max().item() < 0.05


def test_shards_pass_the_merge_stage(tmp_path, targets):
    """The chunk files and manifests of two shards satisfy the merge stage's checks (sha256 included)."""
    from draftsmith.merge import merge_features

    setup_run(tmp_path, targets["llama"], shards=2)
    manifests = []
    for shard in range(2):
        run_shard(tmp_path, targets["llama"], shard=shard, storage_dtype="float8_e4m3fn")
        manifests.append(tmp_path / "features" / f"shard-{shard}" / "manifest.json")
    index = merge_features(plan_path=tmp_path / "plan.json", manifest_paths=manifests,
                           tokenized_path=tmp_path / "train.parquet", index_path=tmp_path / "features" / "index.json",
                           settings=MergeSettings.from_config({"merge": {"verify_sha256": True}}))
    assert (index["num_samples"], index["num_tokens"]) == (len(LENGTHS), sum(LENGTHS))


# ------------------------------------------------------------------------------------- rule scripts


def test_rule_scripts_run_with_a_snakemake_object(tmp_path, targets, monkeypatch):
    """The thin entry points: plan then one shard, as Snakemake's script directive would call them (params =
    the stage's output keys, the rest from the config)."""
    from draftsmith.stages import rule_params

    write_tokenized(tmp_path / "train.parquet", LENGTHS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # an empty GPU pool: the lease runs on the CPU
    extract_cfg = {"shards": 2, "token_budget": 200, "chunk_tokens": 100, "storage_dtype": "bfloat16",
                   "store_target_tokens": True, "require_fla": False, "disk_headroom": 1.05,
                   "padding_mask": True}
    target_cfg = {"dtype": "auto", "attn_implementation": "sdpa", "trust_remote_code": False}
    config = with_defaults({"extract": {**extract_cfg, "fuse": "auto"}, "target": target_cfg,
                            "drafter": {"num_layers": 1, "target_layer_ids": None, "num_target_features": None},
                            "gpu": {"cpu_fallback": True}})  # no GPU here: the CPU on purpose, as config.yaml says
    root_handlers = logging.getLogger().handlers[:]
    try:
        runpy.run_path(str(REPO / "scripts/extract_plan.py"), init_globals={"snakemake": SimpleNamespace(
            input=SimpleNamespace(train=str(tmp_path / "train.parquet"), target=str(targets["llama"])),
            output=[str(tmp_path / "plan.json")], log=[str(tmp_path / "plan.log")],
            params=SimpleNamespace(settings=rule_params(config, "extract_plan")), config=config)})
        plan = read_json(tmp_path / "plan.json")
        assert plan["layer_ids"] == [2] and plan["num_shards"] == 2
        runpy.run_path(str(REPO / "scripts/extract_shard.py"), init_globals={"snakemake": SimpleNamespace(
            input=SimpleNamespace(plan=str(tmp_path / "plan.json"), train=str(tmp_path / "train.parquet"),
                                  target=str(targets["llama"])),
            output=[str(tmp_path / "features/shard-1/manifest.json")], log=[str(tmp_path / "shard.log")],
            params=SimpleNamespace(settings=rule_params(config, "extract_shard")), config=config,
            wildcards=SimpleNamespace(shard="1"),
            resources=SimpleNamespace(gpu=1), threads=1)})
    finally:
        root = logging.getLogger()
        for h in root.handlers[:]:
            if h not in root_handlers:
                root.removeHandler(h)
                h.close()
    man = read_json(tmp_path / "features/shard-1/manifest.json")
    assert man["num_tokens"] == plan["shards"][1]["num_tokens"] and man["storage_dtype"] == "bfloat16"
    text = (tmp_path / "shard.log").read_text()
    assert "projected" in text and "tok/s" in text


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 + flash-linear-attention)")
@pytest.mark.parametrize("fuse", [False, True])
def test_cuda_bf16_padded_equals_alone_on_a_hybrid_target(tmp_path, fuse):
    """bf16 on the GPU: right-padded batches of a Qwen3.5-style target (GDN + full attention; fla when
    installed) give the features of each sample alone, run the same way (eager, or fused: compiled norms
    and MLPs, fla conv1d). docs/design.md records 0.0 difference with fla."""
    import contextlib

    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from draftsmith.fused import fused_target
    from draftsmith.target import fla_available

    cfg = Qwen3_5TextConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                            linear_value_head_dim=64, linear_conv_kernel_dim=4, pad_token_id=0,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    model.save_pretrained(tmp_path / "target")
    lengths = [300, 77, 200, 130, 64, 65, 1, 250]
    ids = write_tokenized(tmp_path / "train.parquet", lengths, vocab=1024)
    write_json(tmp_path / "plan.json", ex.build_plan(tmp_path / "train.parquet", tmp_path / "target",
                                                     ex.ExtractPlanSettings.from_config(
                                                         {"drafter": {"target_layer_ids": [0, 2, 3]}})))
    for padding_mask in (True, False):
        out = tmp_path / f"f{int(padding_mask)}" / "shard-0" / "manifest.json"
        settings = ex.ExtractShardSettings.from_config(
            {"extract": {"token_budget": 1024, "chunk_tokens": 512, "storage_dtype": "bfloat16", "fuse": fuse}})
        man = ex.extract_shard(plan_path=tmp_path / "plan.json", tokenized_path=tmp_path / "train.parquet",
                               target_dir=tmp_path / "target", manifest_path=out, shard=0, model=model,
                               settings=settings)
        worst, worst_rel, mismatched, total = 0.0, 0.0, 0, 0
        for row, hidden, t in stored_samples(out.parent, man):
            with torch.no_grad(), (fused_target(model) if fuse else contextlib.nullcontext()):
                o = model(torch.from_numpy(ids[row].astype(np.int64))[None].cuda(), output_hidden_states=True,
                          use_cache=False)
            ref = torch.cat([o.hidden_states[i + 1][0] for i in [0, 2, 3]], -1).float().cpu()
            diff = (hidden - ref).abs().max().item()
            worst, worst_rel = max(worst, diff), max(worst_rel, diff / ref.abs().max().item())
            mismatched += int((t["target_token"] != o.logits[0].argmax(-1).int().cpu()).sum())
            total += len(t["target_token"])
        print(f"cuda bf16 fla={fla_available()} fuse={fuse} padding_mask={padding_mask}: max abs diff {worst} "
              f"(relative to the row max {worst_rel:.2e}), target_token mismatches {mismatched}/{total}")
        assert worst_rel <= 2 ** -6, worst_rel  # a couple of bf16 ulps at most (kernel choice)
        assert mismatched <= 0.01 * total  # near-ties of bf16 logits may flip between kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_target_topk_of_padded_batches(tmp_path):
    """On the GPU (bf16 logits, pinned host buffers filled on a side stream): the stored top 4 of right-padded
    batches are those of each sample alone but for near-ties of bf16 logits, column 0 is the stored target_token."""
    model = tiny_target("llama").to(torch.bfloat16).cuda()
    model.save_pretrained(tmp_path / "target")
    ids, _ = setup_run(tmp_path, tmp_path / "target")
    man = run_shard(tmp_path, tmp_path / "target", model=model, store_target_topk=4, storage_dtype="bfloat16")
    mismatched, total = 0, 0
    for row, _, t in stored_samples(tmp_path / "features" / "shard-0", man):
        assert torch.equal(t["target_topk_ids"][:, 0], t["target_token"])
        with torch.no_grad():
            logits = model(torch.from_numpy(ids[row].astype(np.int64))[None].cuda(), use_cache=False).logits[0]
        want = logits.float().log_softmax(-1).topk(4, dim=-1)
        same = t["target_topk_ids"].long() == want.indices.cpu()
        mismatched, total = mismatched + int((~same).sum()), total + same.numel()
        got = t["target_topk_logprobs"].float()
        assert ((got - want.values.cpu()).abs() <= 0.05)[same].all()
    assert mismatched <= 0.02 * total, (mismatched, total)  # near-ties of bf16 logits may swap between kernels


def test_hybrid_on_cpu_with_fla_installed_is_refused_with_a_sentence(targets, monkeypatch):
    # seen on an H200 box: with fla importable, transformers sends CPU tensors to fla's Triton kernels
    from draftsmith import target as tgt

    monkeypatch.setattr(tgt, "fla_available", lambda: True)
    with pytest.raises(RuntimeError, match="flash-linear-attention is installed.*CUDA device"):
        tgt.load_target(targets["qwen3_5"], device="cpu")
    assert tgt.load_target(targets["llama"], device="cpu") is not None  # attention-only targets are unaffected


def test_every_disk_check_measures_where_its_bytes_go_and_a_refusal_gives_the_advice(tmp_path, targets,
                                                                                     monkeypatch):
    """Issue 46 item 3. results/features on another mount than results/tokenized: extract_plan measures the disk
    where the features go (main measured results/tokenized: the plan passed and the shards refused); a shard's own
    refusal gives the advice (the smallest stream.slices that fits, fp8), which main's did not; the checkpoints'
    reserve is held to results/drafter's file system when that is another one."""
    import collections
    import shutil

    from draftsmith.stages import rule_params

    results = tmp_path / "results"
    (results / "features").mkdir(parents=True)
    (results / "tokenized").mkdir()
    write_tokenized(results / "tokenized" / "train.parquet", LENGTHS)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    free = {"features": 10**12, "drafter": 10**12, "other": 10**12}
    real_usage = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")

    def disk_usage(path):
        path = Path(path).resolve()
        for name in ("features", "drafter"):
            if path == results / name or results / name in path.parents:
                return usage(10**13, 0, free[name])
        return usage(10**13, 0, free["other"]) if results in path.parents or path == results else real_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    config = with_defaults({"extract": {"shards": 2, "token_budget": 200, "chunk_tokens": 100},
                            "target": {"dtype": "float32"}, "stream": {"reserve_gb": 0},
                            "drafter": {"num_layers": 1, "target_layer_ids": None, "num_target_features": None},
                            "gpu": {"cpu_fallback": True}})
    logs = tmp_path / "logs"

    def run(script: str, output: Path, **extra):
        root_handlers = logging.getLogger().handlers[:]
        try:
            runpy.run_path(str(REPO / "scripts" / f"{script}.py"), init_globals={"snakemake": SimpleNamespace(
                input=SimpleNamespace(train=str(results / "tokenized" / "train.parquet"), target=str(targets["llama"]),
                                      plan=str(results / "features" / "plan.json")),
                output=[str(output)], log=[str(logs / f"{script}.log")],
                params=SimpleNamespace(settings=rule_params(config, script)), config=config, **extra)})
        finally:
            for h in logging.getLogger().handlers[:]:
                if h not in root_handlers:
                    logging.getLogger().removeHandler(h)
                    h.close()

    # leftovers of killed writers under results/: one whose pid is known dead (removed by the check), one of another
    # host last written before this run (kept, named and counted in the refusal)
    import subprocess
    import sys

    from draftsmith.io import HOST, PROCESS_START

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = results / "features" / f".plan.json.abcd1234.tmp-{int(gone.stdout)}@{HOST}"
    dead.write_bytes(b"x" * 100)
    stale = results / "tokenized" / ".train.parquet.efgh5678.tmp-77@elsewhere.parquet"
    stale.write_bytes(b"y" * 2_000_000)
    os.utime(stale, (PROCESS_START - 3600, PROCESS_START - 3600))

    # the features' file system has room for about a third of them: the plan refuses, measured where they go
    projected = disk.projected_bytes(sum(LENGTHS), len(LENGTHS), 1, 64, "bfloat16", True)
    free["features"] = int(projected / 2.9)
    smallest = next(s for s in range(1, len(LENGTHS)) if math.ceil(-(-projected // s) * 1.05) <= free["features"])
    with pytest.raises(disk.DiskSpaceError) as info:
        run("extract_plan", results / "features" / "plan.json")
    message = str(info.value)
    assert not dead.exists() and stale.exists()
    assert f"1 temporary file(s) whose writer may still run hold 0.002 GB ({stale}): delete them" in message
    stale.unlink()
    assert f"free under {results / 'features'}: does not fit" in message
    assert f"The smallest stream.slices that fits is {smallest} with stream.slices_on_disk 1." in message
    assert "With extract.storage_dtype: float8_e4m3fn" in message

    # room at plan time, less when the shards run (another job wrote meanwhile): the shard's refusal advises too
    free["features"] = 10**12
    run("extract_plan", results / "features" / "plan.json")
    plan = read_json(results / "features" / "plan.json")
    assert plan["disk"]["drafter_dir"] == "../drafter" and plan["disk"]["results_dir"] == ".."
    free["features"] = int(projected / 2.9)
    with pytest.raises(disk.DiskSpaceError) as info:
        run("extract_shard", results / "features" / "shard-0" / "manifest.json",
            wildcards=SimpleNamespace(shard="0"), resources=SimpleNamespace(gpu=1), threads=1)
    message = str(info.value)
    assert f"only {free['features'] / 1e9:.3f} GB free under {results / 'features' / 'shard-0'}" in message
    assert "For the whole run" in message and f"The smallest stream.slices that fits is {smallest}" in message
    assert "With extract.storage_dtype: float8_e4m3fn" in message

    # results/drafter on its own file system: the reserve is held to it, the features to theirs
    free["features"] = 10**12
    free["drafter"] = 1000
    (results / "drafter").mkdir()  # a mount point exists
    config["stream"]["reserve_gb"] = 0.001
    monkeypatch.setattr(disk, "same_file_system", lambda a, b: False, raising=False)
    with pytest.raises(disk.DiskSpaceError) as info:
        run("extract_plan", results / "features" / "plan.json")
    message = str(info.value)
    assert f"a reserve of 0.001 GB for checkpoints and the trained drafter, with 0.000 GB free under " \
           f"{results / 'drafter'} (another file system): does not fit" in message
    assert f"the reserve alone exceeds the free disk under {results / 'drafter'}" in message
