"""The drafters of speculators 0.9.0 and SpecForge 0.2.0 trained on a finished draftsmith run's own features (the same
rows, drafter, steps), written in the z-lab format, and judged by draftsmith's evaluate on the run's evaluation sets;
paired with draftsmith's report by ``python -m draftsmith.evaluate.compare``. Run from the repository root of the
draftsmith run (``results/`` there), with the run's config files.

    python bench/peers/quality.py train    --peer specforge --config config/gpu-proof.yaml docs/peers/quality.yaml \
        --out results/peers/            # write the peer's files, train it (its files deleted after)
    python bench/peers/quality.py export   --peer specforge --config ... --out results/peers/   # -> <peer>/final
    python bench/peers/quality.py evaluate --peer specforge --config ... --out results/peers/   # -> <peer>/eval
    python bench/peers/quality.py compare  --config ... --out results/peers/   # compare-<peer>.{md,json}, summary.md

With ``--base DIR`` (every action) the draftsmith side is an earlier run's drafter config, trainer state and report
in DIR, and this run holds only the features, which must equal that run's (:func:`check_same_features`).

Peers: ``speculators``, ``specforge``, ``speculators-dflash2`` (SpecForge 0.2.0 has no DFlash2) and
``speculators-adamw`` (speculators with ``--optimizer adamw``, draftsmith's optimizer, where its default is Muon: the
ablation that tells its optimizer from the rest of its recipe), ``speculators-dflash2-ce`` (its DFlash2 with
draftsmith's backbone loss, CE on the target's argmax with D-PACE, where its DFlash2 default is KL to the target's
distribution with the fixed decay, gamma 4: the ablation that tells its loss from its selector's gradient). What each
is told (from draftsmith's run; each setting named in ``results/peers/<peer>/train.json``):

* the drafter: ``results/drafter/final/config.json`` (draftsmith's export: layers, block size, taps, mask token,
  layer types; DFlash2 sizes for the DFlash2 peer) through :func:`peer_run.drafter_config`;
* the rows: draftsmith's training split (bench/peers/writers.py) and, for speculators, its held-out rows as
  validation;
* the steps: draftsmith's optimizer steps (``trainer_state.json``), spread over the run's ``train.epochs`` epochs:
  speculators packs rows of ``train.tokens_per_batch`` tokens (``--total-seq-len``; its epochs from its own
  sampler), SpecForge takes ``batch_size`` = training rows x epochs / steps samples a step;
* anchors per step: draftsmith's ``max_anchors_per_row`` (speculators ``--max-anchors``, SpecForge
  ``num_anchors`` = that / batch_size per sample); lr, cosine schedule, warmup ratio, grad clip, seed, and the
  slot decay gamma for SpecForge (draftsmith's loss_gamma).

The peers' Pythons: ``SPECULATORS_PYTHON`` / ``SPECFORGE_PYTHON`` (default python3) with ``SPECULATORS_SITE`` /
``SPECFORGE_SITE`` first on ``PYTHONPATH`` (the device's site folders; unset with virtualenvs). ``--cpu``: the CPU
smoke (SDPA, eager loss, the shim; bench/peers/run.sh with ``PEERS_TINY=1``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # bench_train

import peer_run  # noqa: E402
from peerlib import REPO, draftsmith_split, json_ready, load_config  # noqa: E402

PEERS = ("speculators", "specforge", "speculators-dflash2", "speculators-adamw", "speculators-dflash2-ce")
#: a peer variant's loss flags (speculators 0.9.0's); the others train with its defaults for the architecture
PEER_LOSS = {"speculators-dflash2-ce": {"loss_fn": "ce", "per_position_loss_weight": "dpace"}}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """The finished draftsmith run in the current folder: its config, target, features, drafter and steps.

    ``base``: a folder holding an earlier draftsmith run of the same configs (``config.json``, the exported drafter's;
    ``trainer_state.json``; ``report.json``, its evaluation; ``features-index.json``, its features' index), used in
    place of ``results/drafter`` and ``results/eval`` when this run built only the features (``run.sh`` with
    ``PEERS_BASE``). Raises ``SystemExit`` naming the first differing key when this run's features are not the base
    run's (:func:`check_same_features`): the peer would not train on draftsmith's data."""

    def __init__(self, config_files: list[str], root: Path = Path("."), base: Path | None = None):
        from draftsmith.assets import resolve_target
        from draftsmith.drafter_config import drafter_config_from_dict

        self.root = root.resolve()
        self.config = load_config(config_files)
        self.config_files = config_files
        self.target = resolve_target(self.config["target"]["model"], self.root / self.config["assets"]["dir"])
        self.results = self.root / "results"
        self.index = self.results / "features" / "index.json"
        self.tokenized = self.results / "tokenized" / "train.parquet"
        self.base = base
        if base is None:
            final_path = self.results / "drafter" / "final" / "config.json"
            state_path = self.results / "drafter" / "trained" / "trainer_state.json"
            self.report = self.results / "eval" / "report.json"
        else:
            final_path, state_path = base / "config.json", base / "trainer_state.json"
            self.report = base / "report.json"
            check_same_features(base / "features-index.json", self.index)
        self.final_config = drafter_config_from_dict(json.loads(final_path.read_text()))
        self.state = json.loads(state_path.read_text())
        self.steps = int(self.state["steps"])
        self.train = self.config["train"]
        self.drafter = self.config["drafter"]

    @functools.cached_property
    def train_masks(self) -> list:
        """The loss masks (``[T]`` int arrays) of draftsmith's training rows, read once."""
        from draftsmith.features import FeatureIndex
        from draftsmith.tokenized import read_tokenized

        tok = read_tokenized(self.tokenized)
        rows, _ = draftsmith_split(FeatureIndex(self.index), float(self.train["eval_fraction"]),
                                   int(self.train["seed"]))
        return [tok.row(r)[1] for r in rows]

    def supervised_fraction(self) -> float:
        """Supervised tokens / tokens of draftsmith's training rows."""
        sup = sum(int(m.sum()) for m in self.train_masks)
        return sup / max(1, sum(len(m) for m in self.train_masks))

    def drafter_section(self, dflash2: bool) -> dict:
        """The drafter every trainer trains: draftsmith's exported config (its sizes, taps, mask token)."""
        c = self.final_config
        section = {"num_layers": c.num_hidden_layers, "block_size": c.block_size, "layer_types": list(c.layer_types),
                   "sliding_window": c.sliding_window, "is_causal": c.is_causal,
                   "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
                   "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                   "rope_theta": c.rope_parameters.get("rope_theta"), "architecture": "dflash"}
        if dflash2:
            section.update(architecture="dflash2", **{k: self.drafter[k] for k in (
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
        return section


def turn_rule_note(base_report: Path, peer_report: Path) -> str | None:
    """None when two evaluations asked later turns after the same answer (each report's ``run.next_turn``; a report
    without it predates the rule and followed target-only answers), else a note for the summary: the peer's
    multi-turn sets (MT-Bench) then differ from the base's wherever the two answers to a first turn did, and pair
    only where they agree (a ``PEERS_BASE`` run evaluated by an earlier draftsmith)."""
    from draftsmith.evaluate.decoders import NEXT_TURN_TARGET_ONLY

    def rule(report: Path) -> str:
        return (json.loads(report.read_text()).get("run") or {}).get("next_turn") or NEXT_TURN_TARGET_ONLY

    base, peer = rule(base_report), rule(peer_report)
    if base == peer:
        return None
    return (f"draftsmith's report ({base_report}) asked later turns {base}, the peer's ({peer_report}) {peer}: "
            "multi-turn sets pair only the turns asked the same")


def features_identity(meta: dict, where: Path) -> dict:
    """What makes two feature indexes the same features, as training's run fingerprint reads it
    (:func:`draftsmith.train.checkpoint.run_fingerprint`, offline): the sample and token counts, the shared keys
    (taps, target and tokenizer fingerprints, storage dtype) and the content, the digest of every chunk file's sha256
    (:func:`draftsmith.features.index_content_sha256`). Raises ``SystemExit`` for a chunk without a sha256."""
    from draftsmith.features import index_content_sha256
    from draftsmith.train.checkpoint import SHARED_FEATURE_KEYS

    identity = {k: meta.get(k) for k in ("num_samples", "num_tokens", *SHARED_FEATURE_KEYS)}
    try:
        identity["content_sha256"] = index_content_sha256(meta, where)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return identity


def check_same_features(base_index: Path, index: Path) -> None:
    """Raise ``SystemExit`` unless the feature index ``index`` describes the same features as ``base_index`` (both
    ``draftsmith.index/1`` JSON files): :func:`features_identity` equal, so the chunk files are byte for byte the
    base run's; the message names the first differing key and both files."""
    for path in (base_index, index):
        if not path.is_file():
            raise SystemExit(f"{path}: no feature index: cannot tell whether the peer trains on the base run's data")
    a = features_identity(json.loads(base_index.read_text()), base_index)
    b = features_identity(json.loads(index.read_text()), index)
    for key in a:
        if a[key] != b[key]:
            raise SystemExit(f"{index}: {key!r} differs from the base run's {base_index} ({str(b[key])[:80]} "
                             f"against {str(a[key])[:80]}): these are not the same features")


def _peer_dirs(out: Path, peer: str) -> dict[str, Path]:
    base = out / peer
    return {"base": base, "data": base / "data", "train": base / "train", "final": base / "final",
            "eval": base / "eval", "cfg": base / "cfg"}


def train(run: Run, peer: str, out: Path, *, cpu: bool, timeout: float, keep_data: bool = False) -> dict:
    """Write ``peer``'s files from the run's features, train it for the run's steps, delete the files."""
    import writers
    from flops_model import epoch_work

    from draftsmith.drafter_config import default_loss_gamma

    dirs = _peer_dirs(out, peer)
    for key in ("data", "train"):
        shutil.rmtree(dirs[key], ignore_errors=True)
    dirs["base"].mkdir(parents=True, exist_ok=True)
    dflash2 = "dflash2" in peer
    config = peer_run.drafter_config(run.target, run.drafter_section(dflash2), list(run.final_config.target_layer_ids),
                                     int(run.final_config.mask_token_id))
    cfgs = peer_run.write_draft_configs(config, dirs["cfg"])
    rows = writers.Rows(run.index, run.tokenized)
    train_rows, heldout = draftsmith_split(rows.index, float(run.train["eval_fraction"]), int(run.train["seed"]))
    epochs_d = float(run.train["epochs"])
    cap = run.train.get("max_anchors_per_row")
    lr, warmup, seed = float(run.train["lr"]), float(run.train["warmup_ratio"]), int(run.train["seed"])
    record: dict = {"peer": peer, "draftsmith_steps": run.steps, "draftsmith_epochs": epochs_d,
                    "drafter": peer_run.zlab_dict(config), "config_files": run.config_files}
    t0 = time.time()
    if peer.startswith("speculators"):
        say(f"{peer}: writing its files ({len(train_rows)} training + {len(heldout)} held-out rows; pre-norm slot from "
            f"the target {run.target})")
        prenorm = writers.TargetPrenorm(run.target, rows.layer_ids, device="cpu" if cpu else "cuda",
                                        dtype=run.config["target"]["dtype"],
                                        token_budget=int(run.config["extract"]["token_budget"]),
                                        padding_mask=bool(run.config["extract"]["padding_mask"]))
        wrep = writers.write_speculators(rows, dirs["data"], train_rows, heldout, prenorm=prenorm)
        del prenorm
        total_seq_len = int(run.train["tokens_per_batch"])
        max_anchors = int(cap) if cap else int(run.train["num_anchors"]) * 32
        epochs, per_epoch = peer_run.speculators_epochs(
            data=dirs["data"], train_ratio=wrep["train_data_ratio"], total_seq_len=total_seq_len, seed=seed,
            steps=run.steps, peer_site=os.environ.get("SPECULATORS_SITE"))
        extra = ({k: run.drafter[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                              "selector_top_k")} if dflash2 else None)
        cmd = peer_run.speculators_cmd(
            target=run.target, data=dirs["data"], out=dirs["train"], decoder_config=cfgs["speculators"],
            layer_ids=rows.layer_ids, block_size=config.block_size, mask_token_id=config.mask_token_id,
            architecture="dflash2" if dflash2 else "dflash", train_ratio=wrep["train_data_ratio"],
            total_seq_len=total_seq_len, max_anchors=max_anchors, lr=lr, epochs=epochs, max_steps=run.steps,
            warmup_ratio=warmup, log_dir=dirs["train"] / "tb", seed=seed, dflash2=extra,
            optimizer="adamw" if peer.endswith("-adamw") else None, loss=PEER_LOSS.get(peer), cpu=cpu)
        record.update(writer=wrep, epochs=epochs, steps_per_epoch=per_epoch, total_seq_len=total_seq_len,
                      max_anchors=max_anchors, command=cmd)
        work = epoch_work([rows.tokenized.row(r)[1] for r in train_rows], config, trainer="speculators",
                          capacity=total_seq_len, num_anchors=max_anchors)
        site = os.environ.get("SPECULATORS_SITE")
    elif peer == "specforge":
        import yaml

        max_length = int(run.config["tokenize"]["max_length"])
        say(f"{peer}: writing its files ({len(train_rows)} training rows)")
        wrep = writers.write_specforge(rows, dirs["data"], train_rows, max_length=max_length, heldout_rows=heldout)
        n = wrep["rows_written"]
        batch_size = max(1, round(n * epochs_d / run.steps))
        per_epoch_steps = max(1, n // batch_size)  # a last partial batch may be dropped: count whole ones
        epochs = math.ceil(run.steps / per_epoch_steps)  # SpecForge stops at max_steps exactly
        num_anchors = max(1, math.ceil(int(cap) / batch_size)) if cap else int(run.train["num_anchors"])
        gamma = run.train.get("loss_gamma") or default_loss_gamma(config.block_size)
        cfg = peer_run.specforge_config(
            target=run.target, data=dirs["data"], out=dirs["train"], draft_config=cfgs["zlab"],
            mask_token_id=config.mask_token_id, max_length=max_length, batch_size=batch_size,
            num_anchors=num_anchors, gamma=float(gamma), lr=lr, warmup_ratio=warmup, epochs=epochs,
            max_steps=run.steps, grad_clip=float(run.train["grad_clip"]), seed=seed, cpu=cpu,
            sharding=os.environ.get("SPECFORGE_SHARDING"), **_target_keys(run.target))
        (dirs["base"] / "specforge.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = peer_run.specforge_cmd(dirs["base"] / "specforge.yaml")
        record.update(writer=wrep, batch_size=batch_size, epochs=epochs, steps_per_epoch=per_epoch_steps,
                      num_anchors=num_anchors, gamma=gamma, specforge_config=cfg, command=cmd)
        work = epoch_work([rows.tokenized.row(r)[1] for r in train_rows if r not in
                           set(wrep["dropped_rows"]["no_consecutive_supervised_pair"])], config,
                          trainer="specforge", num_anchors=num_anchors, batch_size=batch_size)
        site = os.environ.get("SPECFORGE_SITE")
    else:
        raise SystemExit(f"unknown peer {peer!r}: {PEERS}")
    record["write_s"] = time.time() - t0
    say(f"{peer}: training {run.steps} steps: " + " ".join(map(str, cmd))[:600])
    result = peer_run.run(cmd, log_path=dirs["base"] / "train.log", probe=dirs["base"] / "probe", timeout=timeout,
                          peer_site=site, peer=True, label=peer)
    probe = peer_run.read_probe(dirs["base"] / "probe")
    useful = work.as_dict(config)
    record.update(returncode=result["returncode"], wall_s=result["wall_s"], steps=probe.get("steps"),
                  first_step_s=probe.get("first_step_s"), peak_alloc_gib=probe.get("peak_alloc_gib"),
                  peak_reserved_gib=probe.get("peak_reserved_gib"), nvidia_smi_peak_mib=result["nvidia_smi_peak_mib"],
                  useful_epoch=useful)
    t = probe.get("t") or []
    if len(t) > 1:  # whole-run rates: the epochs' tokens over the time from the first to the last step
        train_s = t[-1] - t[0]
        ctx = useful["ctx_tokens"] * record["steps"] / max(1.0, useful["steps"])
        record.update(train_s=train_s, ctx_tokens_per_s=ctx * (len(t) - 1) / len(t) / train_s,
                      supervised_tokens_per_s=useful["supervised_tokens"] / useful["ctx_tokens"]
                      * ctx * (len(t) - 1) / len(t) / train_s)
    if result["returncode"] != 0:
        record["tail"] = result["tail"]
    if not keep_data:
        shutil.rmtree(dirs["data"], ignore_errors=True)
    (dirs["base"] / "train.json").write_text(json.dumps(json_ready(record), indent=1, default=str))
    say(f"{peer}: exit {result['returncode']}, {record.get('steps')} steps in {result['wall_s']:.0f} s")
    if result["returncode"] != 0:
        raise SystemExit(f"{peer} training failed (exit {result['returncode']}); {dirs['base'] / 'train.log'}:\n"
                         + result["tail"][-3000:])
    return record


def _target_keys(target: Path) -> dict:
    """SpecForge's ``embedding_key`` / ``lm_head_key`` for the target's weight names (a tied embedding has no head:
    SpecForge then ties, from the config's ``tie_word_embeddings``)."""
    from draftsmith.target import weight_files

    files = weight_files(Path(target))
    embed = next((k for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if k in files),
                 "model.embed_tokens.weight")
    head = "lm_head.weight" if "lm_head.weight" in files else embed
    return {"embedding_key": embed, "lm_head_key": head}


def export(run: Run, peer: str, out: Path) -> dict:
    """The peer's last checkpoint as a z-lab folder ``results/peers/<peer>/final``, checked the same way for both:
    draftsmith's loader and the official ``dflash`` (when importable) load it; its taps, mask token and block size
    are draftsmith's."""
    from convert_speculators import convert, official_check

    from draftsmith.evaluate.drafter import load_drafter
    from draftsmith.modeling_dflash2 import model_class_for

    dirs = _peer_dirs(out, peer)
    shutil.rmtree(dirs["final"], ignore_errors=True)
    if peer.startswith("speculators"):
        checkpoint = peer_run.speculators_checkpoints(dirs["train"])[-1]
        summary = convert(checkpoint, run.target, dirs["final"])
    else:
        checkpoint = peer_run.specforge_checkpoint(dirs["train"])
        cmd = [*peer_run.python_cmd("SPECFORGE_PYTHON"), "-m", "specforge.cli", "export", "--to", "hf",
               "--checkpoint", str(checkpoint), "--draft-config", str(dirs["cfg"] / "zlab.json"),
               "--output-dir", str(dirs["final"]), "--embedding-source", str(run.target)]
        env = dict(os.environ, PYTHONPATH=os.environ.get("SPECFORGE_SITE", ""), HF_HUB_OFFLINE="1")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        (dirs["base"] / "export.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"specforge export failed: {done.stderr[-3000:]}")
        cfg = json.loads((dirs["final"] / "config.json").read_text())
        summary = {"checkpoint": str(checkpoint), "command": cmd, "config": cfg,
                   "official_dflash": official_check(dirs["final"], model_class_for(cfg.get("architectures")))}
    import torch

    model = load_drafter(dirs["final"], device="cpu", dtype=torch.float32)
    want = run.final_config
    got = {"target_layer_ids": list(model.target_layer_ids), "mask_token_id": int(model.mask_token_id),
           "block_size": int(model.block_size)}
    expected = {"target_layer_ids": list(want.target_layer_ids), "mask_token_id": int(want.mask_token_id),
                "block_size": int(want.block_size)}
    if got != expected:
        raise SystemExit(f"{dirs['final']}: the exported drafter has {got}, draftsmith's has {expected}")
    summary["draftsmith_loader"] = got
    (dirs["base"] / "export.json").write_text(json.dumps(json_ready(summary), indent=1, default=str))
    say(f"{peer}: exported {checkpoint} -> {dirs['final']} ({got}; official dflash: "
        f"{summary.get('official_dflash')})")
    return summary


def evaluate(run: Run, peer: str, out: Path) -> dict:
    """draftsmith's evaluate (:func:`draftsmith.evaluate.run_evaluate`, the run's evaluate settings and sets) on
    ``results/peers/<peer>/final``: ``results/peers/<peer>/eval/report.{json,md}`` and plots."""
    from draftsmith.evaluate import EvaluateSettings, run_evaluate
    from draftsmith.stages import canonical

    dirs = _peer_dirs(out, peer)
    shutil.rmtree(dirs["eval"], ignore_errors=True)
    dirs["eval"].mkdir(parents=True)
    names = {"json": "report.json", "md": "report.md", "tau": "tau.png", "positions": "per_position.png",
             "histogram": "acceptance_hist.png"}
    t0 = time.time()
    report = run_evaluate(
        target_dir=str(run.target), drafter_dir=str(dirs["final"]),
        curated_eval=str(run.results / "curated" / "eval.parquet"),
        tokenized_eval=str(run.results / "tokenized" / "eval.parquet"),
        outputs={k: str(dirs["eval"] / v) for k, v in names.items()},
        settings=EvaluateSettings.from_config(run.config), sources=canonical(run.config["data"]["sources"]),
        workers=1)
    o = report["overall"]
    say(f"{peer}: evaluated in {time.time() - t0:.0f} s: τ {o['dflash']['tau']:.3f}, prompt lookup "
        f"{o['prompt_lookup']['tau']:.3f}")
    return report


def compare(run: Run, out: Path) -> str:
    """Each peer's report paired with draftsmith's (``python -m draftsmith.evaluate.compare``) and one summary
    table (``results/peers/summary.md``, ``summary.json``)."""
    base = run.report
    peak = _matmul_peak()
    rows, data, notes = [], {"draftsmith": _row("draftsmith", run, base, None, peak)}, []
    for peer in PEERS:
        rep = _peer_dirs(out, peer)["eval"] / "report.json"
        if not rep.is_file():
            continue
        cmd = [sys.executable, "-m", "draftsmith.evaluate.compare", str(base), str(rep), "--names",
               f"draftsmith,{peer}", "--json", str(out / f"compare-{peer}.json"),
               "--md", str(out / f"compare-{peer}.md")]
        subprocess.run(cmd, check=False, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)))
        data[peer] = _row(peer, run, rep, _peer_dirs(out, peer)["base"] / "train.json", peak)
        note = turn_rule_note(base, rep)
        if note:
            notes.append(note)
    head = ("| trainer | architecture | steps | train wall s | ctx tok/s | supervised tok/s | useful TFLOP/s | MFU | "
            "peak GiB | held-out τ | MT-Bench τ | all-sets τ | lookup τ (all) |")
    rows = [head, "|" + "---|" * 13]
    for name, d in data.items():
        rows.append("| " + " | ".join(str(d.get(k, "n/a")) for k in (
            "trainer", "architecture", "steps", "train_s", "ctx_tokens_per_s", "supervised_tokens_per_s", "tflops",
            "mfu", "peak_gib", "heldout_tau", "mtbench_tau", "all_tau", "lookup_tau")) + " |")
    rows.append("")
    rows.append("Rates over each whole training run (with PEERS_OVERLAP=1 a peer trains while the previous drafter is "
                "evaluated: bench/peers/throughput.py's figures are the speed comparison). Useful FLOPs by "
                "bench/peers/flops_model.py (draftsmith's count, each trainer's own anchor rule); MFU against the "
                f"bf16 matmul peak measured here: {_fmt(peak / 1e12 if peak else None, 0)} TFLOP/s.")
    if run.base is not None:
        rows.append(f"draftsmith's row is the base run's ({run.base}): this run built the same features (counts, "
                    "taps, fingerprints and every chunk file's sha256 equal) and trained only the peers.")
    rows += [f"Note: {note}." for note in notes]
    text = "\n".join(rows) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(json_ready(data), indent=1, default=str))
    print(text)
    return text


def _fmt(x, nd=3):
    return round(x, nd) if isinstance(x, (int, float)) else "n/a"


def _matmul_peak() -> float | None:
    """The GPU's bf16 matmul rate in FLOP/s (bench/bench_train.py's 8192^3 product), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    import bench_train

    return float(bench_train.matmul_peak(torch.device("cuda"), 8192, 10))


def _draftsmith_flops_per_ctx_token(run: Run) -> float:
    """Useful FLOPs per context token of draftsmith's own epoch (its packing, anchors and row cap) by
    bench/peers/flops_model.py, the count the peers' rows use with their own anchor rules."""
    from flops_model import epoch_work

    cap = run.train.get("max_anchors_per_row")
    work = epoch_work(run.train_masks, run.final_config, trainer="draftsmith",
                      capacity=int(run.train["tokens_per_batch"]), num_anchors=int(run.train["num_anchors"]),
                      row_cap=int(cap) if cap else None)
    return work.as_dict(run.final_config)["flops_per_ctx_token"]


def _row(name: str, run: Run, report_path: Path, train_json: Path | None, peak: float | None = None) -> dict:
    rep = json.loads(report_path.read_text()) if report_path.is_file() else {}
    sets = rep.get("sets", {})
    row = {"trainer": name, "architecture": (rep.get("run") or {}).get("drafter_architecture")
           or (rep.get("run") or {}).get("architecture", "n/a"),
           "heldout_tau": _fmt(sets.get("heldout", {}).get("dflash", {}).get("tau")),
           "mtbench_tau": _fmt(sets.get("mtbench", {}).get("dflash", {}).get("tau")),
           "all_tau": _fmt(rep.get("overall", {}).get("dflash", {}).get("tau")),
           "lookup_tau": _fmt(rep.get("overall", {}).get("prompt_lookup", {}).get("tau"))}
    if train_json is None:  # draftsmith: its trainer state
        st = run.state
        last = st.get("last_train") or {}
        rate = last.get("tokens_per_s")
        peak_gib = st.get("peak_memory_gib")  # one figure per rank
        peak_gib = max(peak_gib) if isinstance(peak_gib, list) and peak_gib else peak_gib
        row.update(steps=st.get("steps"), train_s=_fmt(st.get("wall_s"), 0), ctx_tokens_per_s=_fmt(rate, 0),
                   supervised_tokens_per_s=_fmt(rate * run.supervised_fraction() if rate else None, 0),
                   peak_gib=_fmt(peak_gib, 1))
        flops = rate * _draftsmith_flops_per_ctx_token(run) if rate else None
    elif train_json.is_file():
        tr = json.loads(train_json.read_text())
        row.update(steps=tr.get("steps"), train_s=_fmt(tr.get("train_s"), 0),
                   ctx_tokens_per_s=_fmt(tr.get("ctx_tokens_per_s"), 0),
                   supervised_tokens_per_s=_fmt(tr.get("supervised_tokens_per_s"), 0),
                   peak_gib=_fmt(tr.get("peak_alloc_gib"), 1))
        rate, per_token = tr.get("ctx_tokens_per_s"), (tr.get("useful_epoch") or {}).get("flops_per_ctx_token")
        flops = rate * per_token if rate and per_token else None
    else:
        flops = None
    row.update(tflops=_fmt(flops / 1e12 if flops else None, 1),
               mfu=f"{100 * flops / peak:.1f}%" if flops and peak else "n/a")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["train", "export", "evaluate", "all", "compare"])
    ap.add_argument("--peer", choices=PEERS)
    ap.add_argument("--config", nargs="*", default=[], help="the draftsmith run's --configfile files")
    ap.add_argument("--out", type=Path, default=Path("results/peers"))
    ap.add_argument("--cpu", action="store_true", help="CPU smoke (SDPA, eager loss, the shim)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for a peer's training")
    ap.add_argument("--keep-data", action="store_true", help="keep the peer's files after training")
    ap.add_argument("--base", type=Path, help="an earlier draftsmith run of the same configs (config.json, "
                    "trainer_state.json, report.json, features-index.json) when this run built only its features")
    args = ap.parse_args(argv)
    run = Run(args.config, base=args.base)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.action == "compare":
        compare(run, args.out)
        return 0
    if not args.peer:
        ap.error(f"{args.action} needs --peer")
    if args.action in ("train", "all"):
        train(run, args.peer, args.out, cpu=args.cpu, timeout=args.timeout, keep_data=args.keep_data)
    if args.action in ("export", "all"):
        export(run, args.peer, args.out)
    if args.action in ("evaluate", "all"):
        evaluate(run, args.peer, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
