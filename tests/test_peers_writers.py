"""The peer benchmark's writers and converter (bench/peers/) on tiny features made by draftsmith's own extract and
merge: the files hold exactly the layout the peers read (docs/peers/README.md, "How each peer reads its data"), checked
against that layout, never by importing speculators or SpecForge (CI has neither).

SpecForge 0.2.0: ``*.ckpt`` files (``torch.save`` dicts: ``input_ids`` / ``loss_mask`` int64 [T], ``hidden_states``
bf16 [T, n * H], the z-lab taps), rows without two consecutive supervised tokens in the first ``data.max_length``
tokens left out and counted. speculators 0.9.0: a ``save_to_disk`` dataset (``input_ids``, ``loss_mask``, ``seq_len``)
and ``hidden_states/hs_{i}.safetensors`` (``hidden_states`` bf16 [T, n + 1, H]: the taps then the last layer's output
before the final norm; ``token_ids`` int64 [T]), tap ids z-lab + 1, draftsmith's held-out rows last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

BENCH = Path(__file__).resolve().parents[1] / "bench" / "peers"
sys.path.insert(0, str(BENCH))

import tiny_run  # noqa: E402
import writers  # noqa: E402
from peerlib import draftsmith_split, has_supervised_pair, speculators_layer_ids, speculators_train_ratio  # noqa: E402

# rows: tiny_run's, plus one whose only supervised pair lies beyond the SpecForge max_length used below
ROWS = tiny_run.ROWS + [80]
LATE_PAIR_ROW = len(ROWS) - 1
MAX_LENGTH = 64  # every other row has a supervised pair before it (prompts are 30% of a row, <= 39 tokens)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny finished extraction: target, tokenized rows (three of them made to be filtered), merged features."""
    root = tmp_path_factory.mktemp("peers")
    real_write = tiny_run.write_tokenized

    def write(path, lengths, **kw):  # row LATE_PAIR_ROW: supervised tokens at 20 and 70, 71 only
        real_write(path, lengths, **kw)
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        masks = table.column("loss_mask").to_pylist()
        late = [0] * lengths[LATE_PAIR_ROW]
        late[20] = late[70] = late[71] = 1
        masks[LATE_PAIR_ROW] = late
        table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                                 pa.array(masks, pa.list_(pa.int8())))
        pq.write_table(table, path)

    tiny_run.write_tokenized = write
    try:
        paths = tiny_run.build(root, rows=ROWS)
    finally:
        tiny_run.write_tokenized = real_write
    rows = writers.Rows(paths["index"], paths["tokenized"])
    return {**paths, "rows": rows}


def split(rows, eval_fraction=0.15, seed=1):
    """draftsmith's held-out split of the tiny rows: rows 2, 11 and 12 held out."""
    return draftsmith_split(rows.index, eval_fraction, seed)


def test_the_split_is_draftsmiths_and_every_filtered_row_is_in_training(run):
    train, held = split(run["rows"])
    assert sorted(train + held) == list(range(len(ROWS))) and not set(train) & set(held)
    for r in (tiny_run.ALTERNATING_ROW, tiny_run.UNSUPERVISED_ROW, LATE_PAIR_ROW):
        assert r in train, "the filter cases must be training rows for these tests (change the seed or fraction)"


def test_specforge_files_have_the_layout_specforge_reads(run, tmp_path):
    rows = run["rows"]
    train, held = split(rows)
    rep = writers.write_specforge(rows, tmp_path / "sf", train, max_length=MAX_LENGTH, heldout_rows=held,
                                  threads=2)
    dropped = rep["dropped_rows"]["no_consecutive_supervised_pair"]
    assert sorted(dropped) == sorted([tiny_run.ALTERNATING_ROW, tiny_run.UNSUPERVISED_ROW, LATE_PAIR_ROW])
    assert rep["rows_in"] == len(train) == rep["rows_written"] + len(dropped)
    late = rows.read(LATE_PAIR_ROW)["loss_mask"].tolist()
    assert has_supervised_pair(late) and not has_supervised_pair(late, MAX_LENGTH)  # its only pair is cut off
    files = sorted((tmp_path / "sf").rglob("*.ckpt"))  # SpecForge: recursive, sorted by path
    written = [int(f.stem.split("-")[1]) for f in files]
    assert written == sorted(set(train) - set(dropped)), "path order must be row order; held-out rows absent"
    H, n = rows.hidden, rows.num_taps
    for f, row in zip(files, written):
        record = torch.load(f, weights_only=True)
        assert set(record) == {"input_ids", "loss_mask", "hidden_states"}
        T = int(rows.tokenized.num_tokens[row])
        assert record["input_ids"].dtype == torch.int64 and record["input_ids"].shape == (T,)
        assert record["loss_mask"].dtype == torch.int64 and set(record["loss_mask"].tolist()) <= {0, 1}
        assert record["hidden_states"].dtype == torch.bfloat16 and record["hidden_states"].shape == (T, n * H)
        stored = rows.read(row)
        assert torch.equal(record["hidden_states"], stored["features"])  # the same bytes, z-lab tap order
        assert torch.equal(record["input_ids"], stored["input_ids"])
        assert torch.equal(record["loss_mask"], stored["loss_mask"])
        assert has_supervised_pair(record["loss_mask"].tolist(), MAX_LENGTH)
        assert f.stat().st_size < T * (n * H * 2 + 16) + 4096, "a slice saved with its whole mapped storage"
    report = json.loads((tmp_path / "sf" / writers.SPECFORGE_REPORT).read_text())
    assert report["rows_dropped"] == {"no_consecutive_supervised_pair": 3} and report["heldout_rows"] == len(held)


def test_speculators_files_have_the_layout_speculators_reads(run, tmp_path):
    import datasets

    rows = run["rows"]
    train, held = split(rows)
    prenorm = writers.TargetPrenorm(run["target"], rows.layer_ids, device="cpu", dtype="float32", token_budget=256)
    rep = writers.write_speculators(rows, tmp_path / "sp", train, held, prenorm=prenorm, threads=2)
    assert rep["rows_dropped"] == {"no_supervised_token": 1}
    assert rep["dropped_rows"]["no_supervised_token"] == [tiny_run.UNSUPERVISED_ROW]
    assert rep["rows_in"] == len(ROWS) == rep["rows_written"] + 1
    # the id shift: z-lab ids [0, 2, 3] of a 4-layer target -> speculators [1, 3, 4] (the last layer's is 4 = L)
    assert rows.layer_ids == [0, 2, 3] and rep["speculators_target_layer_ids"] == [1, 3, 4]
    kept = [r for r in train + held if r != tiny_run.UNSUPERVISED_ROW]
    n_train = len(train) - 1
    assert (rep["train_rows"], rep["val_rows"]) == (n_train, len(held))
    ratio = rep["train_data_ratio"]
    assert 0 < ratio < 1 and int(len(kept) * ratio) == n_train  # speculators' own split expression

    data = datasets.load_from_disk(str(tmp_path / "sp"))
    assert set(data.column_names) == {"input_ids", "loss_mask", "seq_len"} and len(data) == len(kept)
    assert data.format["type"] == "torch"
    H, n = rows.hidden, rows.num_taps
    norm = run_norm_and_head(run["target"])
    agree = total = 0
    for i, row in enumerate(kept):
        item = data[i]
        T = int(rows.tokenized.num_tokens[row])
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (T,)
        assert item["loss_mask"].dtype == torch.int64 and int(item["seq_len"]) == T
        hs = load_file(str(tmp_path / "sp" / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs) == {"hidden_states", "token_ids"}
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (T, n + 1, H)
        assert hs["token_ids"].dtype == torch.int64 and torch.equal(hs["token_ids"], item["input_ids"])
        stored = rows.read(row)
        assert torch.equal(hs["hidden_states"][:, :n].reshape(T, n * H), stored["features"])
        # the last slot is the last layer's output before the final norm: normed, it is the stored tap of layer
        # L - 1 (post-norm, z-lab), and through the LM head it gives the target's greedy tokens (up to bf16 ties)
        pre = hs["hidden_states"][:, n].float()
        normed = norm["norm"](pre)
        post = stored["features"].reshape(T, n, H)[:, n - 1].float()
        assert (normed - post).abs().max() <= 0.02 * post.abs().max() + 1e-3
        assert not torch.allclose(pre, post, atol=1e-2), "the slot must be before the final norm"
        agree += int((norm["head"](normed).argmax(-1) == stored["target_token"]).sum())
        total += T
    assert agree / total >= 0.97, f"greedy tokens from the bf16 pre-norm slot agree on {agree}/{total} positions"
    check = rep["prenorm_check"]
    assert check["greedy_token_agreement"] == 1.0 and check["taps_relative_rms_error"] < 1e-2


def run_norm_and_head(target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def norm(x):
        with torch.no_grad():
            return model.model.norm(x)

    def head(x):
        with torch.no_grad():
            return model.lm_head(x)

    return {"norm": norm, "head": head}


def test_speculators_split_ratio_and_ids():
    for n_train, n in [(1, 2), (9, 10), (19017, 19406), (3, 1000)]:
        assert int(n * speculators_train_ratio(n_train, n)) == n_train
    with pytest.raises(ValueError):
        speculators_train_ratio(5, 5)  # speculators always validates on some rows
    assert speculators_layer_ids([1, 14, 27]) == [2, 15, 28]


# --------------------------------------------------------------------------------------------------------------
# the converter, on a checkpoint written in speculators' documented layout
# --------------------------------------------------------------------------------------------------------------

def speculators_checkpoint(folder: Path, target_dir: Path, *, aux=(1, 3, 4), fc_taps=None, extra=None,
                           spec_overrides=None, seed=1) -> dict[str, torch.Tensor]:
    """A speculators DFlash checkpoint folder (config.json + model.safetensors) as speculators 0.9.0 saves one:
    the z-lab body's tensor names (random weights), no verifier tensors."""
    from transformers import AutoConfig

    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.modeling import DFlashDraftModel

    tcfg = AutoConfig.from_pretrained(target_dir)
    zlab = build_drafter_config(tcfg, num_layers=1, block_size=4, target_layer_ids=[max(0, j - 1) for j in aux],
                                mask_token_id=tiny_run.MASK_TOKEN)  # (the body; the config below says ``aux``)
    torch.manual_seed(seed)
    model = DFlashDraftModel(zlab)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    state = {k: v.to(torch.bfloat16) for k, v in model.trainable_state_dict().items()}
    if fc_taps is not None:
        state["fc.weight"] = state["fc.weight"][:, :fc_taps * zlab.hidden_size].contiguous()
    state.update(extra or {})
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    tl = {k: v for k, v in zlab.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "vocab_size", "max_position_embeddings",
        "layer_types", "sliding_window", "rope_parameters", "tie_word_embeddings")}
    spec = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
            "transformer_layer_config": dict(tl, model_type="qwen3"), "aux_hidden_state_layer_ids": list(aux),
            "block_size": 4, "draft_vocab_size": tl["vocab_size"], "mask_token_id": tiny_run.MASK_TOKEN,
            "sample_from_anchor": False, "sliding_window_non_causal": False, **(spec_overrides or {})}
    (folder / "config.json").write_text(json.dumps(spec))
    return state


def test_converter_keeps_every_tap_and_shifts_ids_and_the_official_package_loads_it(run, tmp_path, official):
    from convert_speculators import convert

    state = speculators_checkpoint(tmp_path / "ckpt", run["target"])
    summary = convert(tmp_path / "ckpt", run["target"], tmp_path / "zlab", check_official=False)
    assert summary["zlab_target_layer_ids"] == [0, 2, 3]  # z-lab id = speculators id - 1; the last layer kept
    cfg = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"] == {
        "target_layer_ids": [0, 2, 3], "mask_token_id": tiny_run.MASK_TOKEN, "block_size": 4}
    weights = load_file(str(tmp_path / "zlab" / "model.safetensors"))
    assert set(weights) == set(state) and weights["fc.weight"].shape == (64, 3 * 64)
    assert all(torch.equal(weights[k], state[k]) for k in state)
    ref = official.DFlashDraftModel.from_pretrained(str(tmp_path / "zlab"), dtype=torch.float32).eval()
    assert ref.target_layer_ids == [0, 2, 3] and ref.mask_token_id == tiny_run.MASK_TOKEN and ref.block_size == 4


@pytest.mark.parametrize("case, message", [
    ({"aux": (0, 2, 3)}, "outside 1..4"),
    ({"fc_taps": 2}, "every tap must keep its slice"),
    ({"extra": {"t2d": torch.ones(512, dtype=torch.bool)}}, "reduced draft vocabulary"),
    ({"spec_overrides": {"sample_from_anchor": True}}, "sample_from_anchor"),
    ({"spec_overrides": {"draft_vocab_size": 256}}, "reduced draft vocabulary"),
])
def test_converter_refuses_what_the_zlab_format_cannot_say(run, tmp_path, case, message):
    from convert_speculators import ConversionError, convert

    speculators_checkpoint(tmp_path / "ckpt", run["target"], **case)
    with pytest.raises(ConversionError, match=message):
        convert(tmp_path / "ckpt", run["target"], tmp_path / "zlab", check_official=False)
    assert not (tmp_path / "zlab" / "model.safetensors").exists()


def test_flops_model_counts_each_trainers_anchor_rule():
    from flops_model import epoch_work

    from draftsmith.drafter_config import build_drafter_config
    from tiny import tiny_config

    config = build_drafter_config(tiny_config("qwen3"), num_layers=1, block_size=4, target_layer_ids=[1],
                                  mask_token_id=5)
    masks = [np.array([0] * 10 + [1] * 30), np.array([0, 1] * 20), np.array([1] * 40)]
    d = epoch_work(masks, config, trainer="draftsmith", capacity=120, num_anchors=8, row_cap=None)
    assert d.ctx_tokens == 120 and d.supervised_tokens == 30 + 20 + 40
    assert d.blocks == 8 + 0 + 8  # per document min(8, pair anchors); the alternating one has none
    s = epoch_work(masks, config, trainer="speculators", capacity=120, num_anchors=8)
    assert s.blocks == pytest.approx(8)  # per packed row
    f = epoch_work(masks, config, trainer="specforge", num_anchors=8, batch_size=2)
    assert f.blocks == 16 and f.steps == 2
    assert 0 < d.flops(config)["total"]


PROBED_TRAINER = """
import torch
muon_like = torch.nn.Parameter(torch.zeros(4, 4))
adamw_like = torch.nn.Parameter(torch.zeros(4))
first = torch.optim.SGD([muon_like], lr=0.1)
second = torch.optim.AdamW([adamw_like], lr=0.1)
for _ in range(5):
    (muon_like.sum() + adamw_like.sum()).backward()
    first.step()
    second.step()
    first.zero_grad()
    second.zero_grad()
"""


def test_the_step_probe_counts_a_step_of_two_optimizers_once_and_times_the_optimizer(tmp_path):
    """bench/peers/probe, the passive probe every trainer of the throughput bench runs under: a trainer stepping two
    optimizers a step (speculators' Muon + AdamW) is counted one step per pair, each record carries the optimizer
    time, and step_rates gives the medians the throughput table prints (step ms, optimizer ms)."""
    import os
    import subprocess

    import peer_run

    probe = tmp_path / "probe"
    env = dict(os.environ, PEERS_PROBE=str(probe), PYTHONPATH=str(BENCH / "probe"))
    subprocess.run([sys.executable, "-c", PROBED_TRAINER], env=env, check=True, timeout=120)
    rec = peer_run.read_probe(probe)
    assert rec["steps"] == 5 and rec["optimizer"] == "SGD"
    assert len(rec["opt_s"]) == 5 and all(o is not None and 0 <= o < 5 for o in rec["opt_s"])
    assert rec["t"] == sorted(rec["t"])
    rates = peer_run.step_rates(rec, 100.0, warmup=1)
    assert rates["steps_timed"] == 3 and rates["median_optimizer_s"] == sorted(rec["opt_s"][2:])[1]
    assert rates["median"] > 0 and rates["window"] > 0


def _speculators_record(step: int, fwd: float, opt: float, step_ms: str) -> str:
    """One training record of speculators 0.9.0's console log, wrapped over lines by rich as it prints them."""
    return (f"[16:01:36] INFO     train/loss=1.605, train/full_acc=0.012,       trainer.py:587\n"
            f"                    train/position_1_acc=0.012,                                 \n"
            f"                    profile/fetch_ms=26.698,                                    \n"
            f"                    profile/fwd_ms={fwd},                             \n"
            f"                    profile/bwd_ms=544.066,                                     \n"
            f"                    profile/opt_ms={opt},                                      \n"
            f"                    profile/step_ms={step_ms},                               \n"
            f"                    profile/tokens_per_s=1.58e+04,                              \n"
            f"                    profile/h2d_ms=18.484, profile/clip_ms=8.046,               \n"
            f"                    profile/memory_mb/opt=4.20e+04, epoch=2,                    \n"
            f"                    lr=7.01e-06, global_step={step}                                 \n")


def test_speculators_profile_is_read_from_its_console_log_in_step_order(tmp_path):
    """The throughput figures of a speculators run cut before its TensorBoard events come back are read from its
    console log: every wrapped record is found, ordered by global_step, the warm-up records left out, and each part's
    median (median_high) is taken, the exponent notation included (``1.33e+03`` = 1,330 ms)."""
    import peer_run

    records = [_speculators_record(s, fwd=400.0 + s, opt=40.0 + s, step_ms=ms)
               for s, ms in [(2, "1.03e+03"), (0, "9.99e+03"), (1, "1.01e+03"), (3, "1.33e+03")]]
    log = tmp_path / "speculators.log"
    log.write_text("$ python3 -m speculators.train ...\nwarmup noise profile/fwd_ms=1.0\n" + "".join(records))
    prof = peer_run.speculators_log_profile(log, warmup=1)
    assert prof["steps_logged"] == 4
    assert prof["fwd_ms"] == 402.0 and prof["opt_ms"] == 42.0  # steps 1-3: median_high of (401, 402, 403)
    assert prof["step_ms"] == 1030.0  # (1010, 1030, 1330); step 0's 9,990 ms left out
    assert prof["h2d_ms"] == 18.484 and prof["clip_ms"] == 8.046 and prof["fetch_ms"] == 26.698
