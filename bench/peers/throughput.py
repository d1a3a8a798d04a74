"""Training speed of draftsmith, speculators 0.9.0 and SpecForge 0.2.0 on the same random features, one GPU (or a
CPU smoke with ``--shape tiny``): context and supervised tokens/s, useful model FLOPs and MFU by draftsmith's count,
peak memory, time to the first step. A benchmark; every figure from each trainer's own run.

Per shape (``--shape``: ``qwen3.5-27b`` = gpu-node's drafter, 5 layers of width 5120, four sliding (2,048) and one
full, block 16, taps [1, 16, 31, 46, 61]; ``smollm2-135m`` = gpu-proof's, 4 full layers of width 576, block 16, taps
[1, 14, 27]; ``tiny`` for the CPU) and config (``--config``: the sizes, e.g. config/gpu-node.yaml):

1. a target folder (the shape's config.json, random bf16 embedding and LM head, the tiny test tokenizer) and
   ``--tokens`` tokens of random bf16 features in draftsmith's format, documents of ShareGPT's lengths (prompt 30%
   unsupervised, answer supervised; bench/bench_train.py's ``write_ddp_features``);
2. for each trainer in ``--trainers`` (draftsmith, speculators, specforge; DFlash2: draftsmith-dflash2,
   speculators-dflash2; speculators-adamw: speculators with ``--optimizer adamw``, where its default is Muon;
   draftsmith-dflash2 trains the DFlash2 defaults, soft labels from the target's top 32 among them, which the
   features then hold (random, ``bench_train.random_topk``; before 2026-12-05 it trained the DFlash section's keys);
   draftsmith-adamw: draftsmith's earlier recipe, AdamW and the fixed decay, where its default is Muon + D-PACE), its
   files written from those features (bench/peers/writers.py; speculators' pre-norm slot
   random), ``--steps`` optimizer steps of the trainer with the step probe (bench/peers/probe), its files deleted;
3. per trainer: context tokens/s after ``--warmup`` steps (per-step tokens where the trainer logs them: draftsmith's
   window rate, speculators' TensorBoard profile; SpecForge logs samples/s only: its mean sample length is used),
   supervised tokens/s (x the supervised fraction of the rows), useful FLOPs per context token of its anchor rule
   (bench/peers/flops_model.py) -> TFLOP/s and MFU against the bf16 matmul peak measured first, the probe's peak
   ``torch.cuda.max_memory_allocated`` / ``reserved`` and nvidia-smi's, the time from process start to the end of
   the first optimizer step, the median time of an optimizer step (the probe's, GPU-synchronised) and each
   trainer's own split of a step where it makes one: speculators' ``profile/{fetch,fwd,bwd,clip,opt}_ms``,
   draftsmith's ``train.time_phases`` (``step_phases_ms``: GPU and host ms by phase; ``PEERS_DRAFTSMITH_PHASES=0``
   runs draftsmith without it); ``PEERS_DRAFTSMITH_PROFILE=N``: draftsmith's ``train.profile_steps`` N (a kernel
   trace of N steps after its first 10, kept as ``OUT/<shape>-<trainer>-profile/``; the profiled steps are slower,
   so keep N well under half of ``--steps`` minus ``--warmup`` for the medians to stand).

Matched settings (each trainer's sizes from the config's train section): tokens per optimizer step (draftsmith's
``tokens_per_batch``; speculators ``--total-seq-len``; SpecForge ``batch_size`` = tokens_per_batch / mean document
length), anchors per step (draftsmith ``max_anchors_per_row``; speculators ``--max-anchors``; SpecForge
``num_anchors`` = max_anchors_per_row / batch_size per sample), lr and schedule. ``PEERS_MATCH=0``: the peers'
own batch defaults instead (useful FLOPs and tokens/s still compare them).

Writes ``OUT/throughput-<shape>.json`` after every trainer and prints a table.

    python bench/peers/throughput.py --shape qwen3.5-27b --config config/gpu-node.yaml --out $OUT
    python bench/peers/throughput.py --shape smollm2-135m --config config/gpu-proof.yaml --out $OUT
    python bench/peers/throughput.py --shape tiny --out /tmp/tp --cpu        # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import peer_run  # noqa: E402
from peerlib import REPO, human_bytes, json_ready  # noqa: E402

TRAINERS = ("draftsmith", "speculators", "specforge", "draftsmith-dflash2", "speculators-dflash2", "speculators-adamw",
            "draftsmith-adamw")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_tokenizer(tdir: Path) -> None:
    """The tiny test tokenizer (tests/tiny.py: byte-level BPE, 512 ids) into the target folder: the peers load a
    tokenizer from the target (SpecForge resolves its mask token with it); every id lies inside any shape's
    vocabulary."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tdir)


def tokenized_from_index(index_path: Path, out: Path) -> Path:
    """A tokenized parquet (the tokenize stage's contract) holding the indexed rows' ids and loss masks, so the
    writers can check the features against it as they do in a real run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draftsmith.features import FeatureIndex

    index = FeatureIndex(index_path)
    rows = sorted(s.row for s in index.samples)
    if rows != list(range(len(rows))):
        raise ValueError(f"{index_path}: rows {rows[:5]}... are not 0..n-1")
    ids, masks = [], []
    for r in rows:
        part = index.read(index.ref(r))
        ids.append(part["input_ids"].to(torch.int32).numpy())
        masks.append(part["loss_mask"].to(torch.int8).numpy())
    table = pa.table({
        "id": [f"random{r:06d}" for r in rows], "source": ["random"] * len(rows),
        "input_ids": pa.array([x.tolist() for x in ids], pa.list_(pa.int32())),
        "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.int8())),
        "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
    }).replace_schema_metadata({b"draftsmith.chat_template_kwargs": b"{}",
                                b"draftsmith.tokenizer_fingerprint": b'"random"', b"draftsmith.max_length": b"32768"})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


def matched_sizes(train: dict, mean_doc: float) -> dict:
    """Each trainer's batch settings for the same tokens and anchors per optimizer step (see the docstring); with
    ``PEERS_MATCH=0`` in the environment, the peers' own defaults instead (speculators: 8,192 tokens and 512 anchors
    a packed row; SpecForge: one sample a step, 512 anchors)."""
    T = int(train["tokens_per_batch"])
    if os.environ.get("PEERS_MATCH", "1") == "0":
        return {"tokens_per_step": T, "anchors_per_step": train.get("max_anchors_per_row"),
                "draftsmith_num_anchors": int(train["num_anchors"]), "speculators_total_seq_len": 8192,
                "speculators_max_anchors": 512, "specforge_batch_size": 1, "specforge_num_anchors": 512,
                "peers": "their defaults"}
    cap = train.get("max_anchors_per_row") or int(train["num_anchors"]) * max(1, round(T / mean_doc))
    bs = max(1, round(T / mean_doc))
    return {"tokens_per_step": T, "anchors_per_step": int(cap), "draftsmith_num_anchors": int(train["num_anchors"]),
            "speculators_total_seq_len": T, "speculators_max_anchors": int(cap),
            "specforge_batch_size": bs, "specforge_num_anchors": max(1, math.ceil(cap / bs))}


def run_one(name: str, *, ctx: dict, workdir: Path, out: Path, steps: int, warmup: int, timeout: float,
            cpu: bool) -> dict:
    """Write the trainer's files, run it ``steps`` steps, read its figures; its files deleted after."""
    import writers
    from flops_model import epoch_work

    kind, dflash2 = name.split("-")[0], name.endswith("dflash2")
    config = ctx["config2"] if dflash2 else ctx["config"]
    sizes, train = ctx["sizes"], ctx["train"]
    scratch = workdir / f"run-{name}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    probe = scratch / "probe"
    log = out / f"{ctx['shape']}-{name}.log"
    res: dict = {"trainer": name, "architecture": config.architectures[0]}
    masks = ctx["masks"]
    if kind == "draftsmith":
        # DFlash2: the train keys of a DFlash2 config, its defaults (soft labels, the selector's gradient, ...)
        args = json.loads(json.dumps(ctx["draftsmith_args2" if dflash2 else "draftsmith_args"]))
        if dflash2:
            args["drafter"].update(architecture="dflash2", **ctx["dflash2"])
        if name.endswith("-adamw"):  # draftsmith's earlier recipe, beside its Muon + D-PACE default
            args["train"].update(optimizer="adamw", loss_weighting="exp")
        # its own split of a step, as speculators logs one (CUDA events, no added sync; 0 turns it off)
        args["train"]["time_phases"] = os.environ.get("PEERS_DRAFTSMITH_PHASES", "1") != "0"
        args["train"]["profile_steps"] = int(os.environ.get("PEERS_DRAFTSMITH_PROFILE", "0"))
        cmd = peer_run.draftsmith_cmd(index=ctx["index"], target=ctx["target"], out=scratch / "out", args=args,
                                      threads=os.cpu_count() or 1)
        work = epoch_work(masks, config, trainer="draftsmith", capacity=sizes["tokens_per_step"],
                          num_anchors=sizes["draftsmith_num_anchors"], row_cap=sizes["anchors_per_step"])
        run = peer_run.run(cmd, log_path=log, probe=probe, timeout=timeout, label=name)
        state_path = scratch / "out" / "trained" / "trainer_state.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        last = state.get("last_train") or {}
        res["trainer_reported"] = {k: last.get(k) for k in ("window_tokens_per_s", "tokens_per_s",
                                                            "model_tflops_per_gpu", "loss")}
        res["trainer_reported"]["peak_memory_gib"] = state.get("peak_memory_gib")
        # train.time_phases: medians by phase after its first 10 steps (GPU and host ms)
        res["trainer_reported"]["profile_ms"] = state.get("step_phases_ms")
        traced = scratch / "out" / "profile"
        if traced.is_dir():  # train.profile_steps: kept beside the trainer's log (the run's folder is deleted)
            kept = out / f"{ctx['shape']}-{name}-profile"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(traced, kept)
            summary = traced / "summary.json"
            res["trainer_reported"]["kernel_profile"] = json.loads(summary.read_text()) if summary.is_file() else None
        tokens_per_step = work.ctx_tokens / max(1.0, work.steps)
        res["loss_last"] = last.get("loss")
    elif kind == "speculators":
        data = scratch / "data"
        rows = writers.Rows(ctx["index"], ctx["tokenized"])
        all_rows = sorted(s.row for s in rows.index.samples)
        wrep = writers.write_speculators(rows, data, all_rows[:-1], all_rows[-1:],
                                         prenorm=writers.RandomPrenorm(rows.hidden), threads=8)
        res["writer"] = {k: wrep[k] for k in ("rows_written", "tokens_written", "bytes_written", "seconds")}
        decoder = peer_run.write_draft_configs(config, scratch / "cfg")["speculators"]
        epochs, per_epoch = peer_run.speculators_epochs(
            data=data, train_ratio=wrep["train_data_ratio"], total_seq_len=sizes["speculators_total_seq_len"],
            seed=0, steps=steps, peer_site=os.environ.get("SPECULATORS_SITE"))
        res["speculators_epochs"] = {"epochs": epochs, "steps_per_epoch": per_epoch}
        extra = {k: ctx["dflash2"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")} if dflash2 else None
        cmd = peer_run.speculators_cmd(
            target=ctx["target"], data=data, out=scratch / "out", decoder_config=decoder,
            layer_ids=ctx["layer_ids"], block_size=config.block_size, mask_token_id=ctx["mask"],
            architecture="dflash2" if dflash2 else "dflash", train_ratio=wrep["train_data_ratio"],
            total_seq_len=sizes["speculators_total_seq_len"], max_anchors=sizes["speculators_max_anchors"],
            lr=float(train["lr"]), epochs=epochs, max_steps=steps, warmup_ratio=float(train["warmup_ratio"]),
            log_dir=scratch / "tb", dflash2=extra, optimizer="adamw" if name.endswith("-adamw") else None, cpu=cpu)
        cmd += ["--checkpoint-freq", "1000"]
        work = epoch_work(masks, config, trainer="speculators", capacity=sizes["speculators_total_seq_len"],
                          num_anchors=sizes["speculators_max_anchors"])
        run = peer_run.run(cmd, log_path=log, probe=probe, timeout=timeout,
                           peer_site=os.environ.get("SPECULATORS_SITE"), peer=True, label=name)
        try:
            tokens_per_step = peer_run.speculators_step_tokens(scratch / "tb")
        except Exception:  # the TensorBoard files unreadable: the mean below
            tokens_per_step = []
        if not tokens_per_step:
            tokens_per_step = work.ctx_tokens / max(1.0, work.steps)
        res["tokens_per_step_source"] = "tensorboard profile" if isinstance(tokens_per_step, list) else "mean"
        try:  # its own split of a step: loading, forward, backward, clip, optimizer (ms, medians after the warm-up)
            res["trainer_reported"] = {"profile_ms": peer_run.speculators_profile(scratch / "tb", warmup)}
        except Exception as exc:  # the TensorBoard files unreadable
            res["trainer_reported"] = {"profile_ms": None, "profile_error": repr(exc)}
    elif kind == "specforge":
        if dflash2:
            return {"trainer": name, "skipped": "SpecForge 0.2.0 has no DFlash2 strategy"}
        data = scratch / "data"
        rows = writers.Rows(ctx["index"], ctx["tokenized"])
        all_rows = sorted(s.row for s in rows.index.samples)
        wrep = writers.write_specforge(rows, data, all_rows, max_length=ctx["max_length"], threads=8)
        res["writer"] = {k: wrep[k] for k in ("rows_written", "tokens_written", "bytes_written", "seconds")}
        zlab = peer_run.write_draft_configs(config, scratch / "cfg")["zlab"]
        bs = sizes["specforge_batch_size"]
        cfg = peer_run.specforge_config(
            target=ctx["target"], data=data, out=scratch / "out", draft_config=zlab, mask_token_id=ctx["mask"],
            max_length=ctx["max_length"], batch_size=bs, num_anchors=sizes["specforge_num_anchors"],
            gamma=float(ctx["gamma"]), lr=float(train["lr"]), warmup_ratio=float(train["warmup_ratio"]),
            epochs=1000, max_steps=steps, grad_clip=float(train["grad_clip"]), cpu=cpu,
            sharding=os.environ.get("SPECFORGE_SHARDING"))
        import yaml

        (scratch / "specforge.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        work = epoch_work(masks, config, trainer="specforge", num_anchors=sizes["specforge_num_anchors"],
                          batch_size=bs)
        run = peer_run.run(peer_run.specforge_cmd(scratch / "specforge.yaml"), log_path=log, probe=probe,
                           timeout=timeout, peer_site=os.environ.get("SPECFORGE_SITE"), peer=True, label=name)
        tokens_per_step = bs * work.ctx_tokens / len(masks)
        recs = peer_run.specforge_steps(log)
        res["trainer_reported"] = {"steps_logged": len(recs), "loss_last": recs[-1].get("loss") if recs else None,
                                   "median_step_time_s": statistics.median_high(
                                       r.get("perf/optimizer_step_time_s", 0) for r in recs) if recs else None}
        res["tokens_per_step_source"] = "batch_size x mean sample tokens"
    else:
        raise ValueError(name)
    probe_rec = peer_run.read_probe(probe)
    rates = peer_run.step_rates(probe_rec, tokens_per_step, warmup)
    useful = work.as_dict(config)
    rate = rates["median"]
    sup_frac = work.supervised_tokens / max(1.0, work.ctx_tokens)
    res.update({
        "returncode": run["returncode"], "wall_s": run["wall_s"], "steps": probe_rec.get("steps"),
        "first_step_s": probe_rec.get("first_step_s"), "ctx_tokens_per_s": rate,
        "ctx_tokens_per_s_window": rates["window"], "median_step_s": rates.get("median_step_s"),
        "median_optimizer_s": rates.get("median_optimizer_s"),
        "supervised_tokens_per_s": rate * sup_frac if rate else None,
        "useful": useful, "tflops": rate * useful["flops_per_ctx_token"] / 1e12 if rate else None,
        "peak_alloc_gib": probe_rec.get("peak_alloc_gib"), "peak_reserved_gib": probe_rec.get("peak_reserved_gib"),
        "nvidia_smi_peak_mib": run["nvidia_smi_peak_mib"], "log": str(log),
    })
    if ctx["peak"] and res["tflops"]:
        res["mfu"] = res["tflops"] * 1e12 / ctx["peak"]
    if run["returncode"] != 0 or not probe_rec.get("steps"):
        res["tail"] = run["tail"][-3000:]
    shutil.rmtree(scratch, ignore_errors=True)
    return res


def table(results: dict) -> str:
    rows = ["| trainer | architecture | steps | first step s | step ms | optimizer ms | ctx tok/s | supervised tok/s | "
            "TFLOP/s (useful) | MFU | peak alloc GiB | nvidia-smi GiB |", "|" + "---|" * 12]

    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) and x is not None else "n/a"

    for name, r in results.items():
        if r.get("skipped"):
            rows.append(f"| {name} | {r['skipped']} |" + " |" * 10)
            continue
        smi = r.get("nvidia_smi_peak_mib")
        step, opt = r.get("median_step_s"), r.get("median_optimizer_s")
        rows.append(f"| {name} | {r.get('architecture')} | {r.get('steps')} | {f(r.get('first_step_s'), '.1f')} | "
                    f"{f(step * 1e3 if step else None, '.0f')} | {f(opt * 1e3 if opt else None, '.0f')} | "
                    f"{f(r.get('ctx_tokens_per_s'), ',.0f')} | {f(r.get('supervised_tokens_per_s'), ',.0f')} | "
                    f"{f(r.get('tflops'), '.1f')} | {f(100 * r['mfu'], '.1f') + '%' if r.get('mfu') else 'n/a'} | "
                    f"{f(r.get('peak_alloc_gib'), '.1f')} | {f(smi / 1024 if smi else None, '.1f')} |")
    return "\n".join(rows)


def profiles(results: dict) -> str:
    """Each trainer's own split of a step, one line each (ms, medians after the warm-up): speculators'
    ``profile/*_ms``, draftsmith's ``step_phases_ms`` (GPU / host)."""
    from draftsmith.train.metrics import StepTimes
    from draftsmith.train.profile import headline

    lines = ["Each trainer's own split of a step (ms, medians after its warm-up):"]
    for name, r in results.items():
        prof = (r.get("trainer_reported") or {}).get("profile_ms")
        if not prof:
            continue
        if "host_ms" in prof:  # draftsmith's train.time_phases
            lines.append(f"- {name} ({prof['steps']} steps): {StepTimes.describe(prof)}")
            traced = r["trainer_reported"].get("kernel_profile")
            if traced and "per_step" in traced:  # train.profile_steps
                lines.append(f"  kernel trace of steps {traced['steps']}: {headline(traced)}")
        else:
            lines.append(f"- {name}: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f}" for k, v in prof.items()
                                                      if isinstance(v, (int, float))))
    return "\n".join(lines) if len(lines) > 1 else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", choices=["qwen3.5-27b", "smollm2-135m", "tiny"])
    ap.add_argument("--config", default=None, help="the sizes (config/gpu-node.yaml, config/gpu-proof.yaml)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--trainers", default="draftsmith,speculators,specforge")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the rates (compilation)")
    ap.add_argument("--tokens", type=int, default=None, help="feature tokens written (default 180,000; tiny 16,000)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per trainer run")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import bench_train as bt

    from draftsmith.drafter_config import default_loss_gamma

    cpu = not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    tiny = args.shape == "tiny"
    shape = bt.SHAPES[args.shape]
    sizes_cfg = bt.load_sizes(args.config, tiny)
    sections = bt.merged_sections(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / f"throughput-{args.shape}.json"
    res: dict = {"shape": args.shape, "config": args.config, "steps": args.steps, "warmup": args.warmup,
                 "device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
                 "results": {}}

    def save():
        result_path.write_text(json.dumps(json_ready(res), indent=1, default=str))

    peak = None
    if not cpu:
        peak = bt.matmul_peak(device, 8192, 10)
        torch.cuda.empty_cache()
        say(f"matmul peak {peak / 1e12:.0f} TFLOP/s")
    res["matmul_peak_flops"] = peak
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="peers-tp-"))
    try:
        tokens = args.tokens or (16_000 if tiny else 180_000)
        max_length = int(sizes_cfg["tokens_per_batch"] if tiny else sections["tokenize"].get("max_length", 32768))
        lengths = bt.ddp_document_lengths(sizes_cfg, max_length, tiny)
        t0 = time.time()
        # DFlash2's default labels are the target's top-k: the features hold them when a draftsmith DFlash2 runs
        sections2 = bt.merged_sections(args.config, architecture="dflash2")
        top_k = int(sections2["extract"]["store_target_topk"] or 0) if "draftsmith-dflash2" in args.trainers else 0
        index, tdir, feats = bt.write_ddp_features(workdir / "features", args.shape, shape, lengths, tokens,
                                                   args.seed, device, target_topk=top_k)
        if not cpu:  # the features were drawn on the GPU: give its cache back before the trainers' processes run
            torch.cuda.empty_cache()  # (kept, it took 5.4 GiB of an 80 GB GPU from them: nvidia-smi's column too)
            res["bench_process_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
        write_tokenizer(tdir)
        tokenized = tokenized_from_index(index, workdir / "tokenized" / "train.parquet")
        say(f"features: {feats['documents']} documents, {feats['tokens']:,} tokens, "
            f"{human_bytes(feats['feature_bytes'])} in {time.time() - t0:.0f} s")
        res["features"] = feats
        draftsmith_args = bt.ddp_trainer_args(sections, shape, sizes_cfg, args.steps, 1)
        draftsmith_args2 = bt.ddp_trainer_args(sections2, shape, sizes_cfg, args.steps, 1)
        drafter = draftsmith_args["drafter"]
        from draftsmith.features import FeatureIndex

        fi = FeatureIndex(index)
        masks = [fi.read(fi.ref(s.row))["loss_mask"].numpy() for s in fi.samples]
        mean_doc = sum(m.size for m in masks) / len(masks)
        sizes = matched_sizes(draftsmith_args["train"], mean_doc)
        dflash2 = {k: sections["drafter"].get(k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                           "selector_top_k")}
        if tiny:
            dflash2.update(conv_group_size=16, selector_rank=16, selector_top_k=4)
        config = peer_run.drafter_config(tdir, drafter, shape["layer_ids"], drafter["mask_token_id"])
        config2 = peer_run.drafter_config(tdir, dict(drafter, architecture="dflash2", **dflash2), shape["layer_ids"],
                                          drafter["mask_token_id"])
        res["matched"] = dict(sizes, mean_document_tokens=mean_doc, drafter=peer_run.zlab_dict(config))
        save()
        ctx = {"shape": args.shape, "index": index, "tokenized": tokenized, "target": tdir, "masks": masks,
               "config": config, "config2": config2, "sizes": sizes, "train": draftsmith_args["train"],
               "draftsmith_args": draftsmith_args, "draftsmith_args2": draftsmith_args2,
               "layer_ids": shape["layer_ids"], "mask": drafter["mask_token_id"],
               "max_length": max_length, "gamma": draftsmith_args["train"].get("loss_gamma")
               or default_loss_gamma(config.block_size), "peak": peak, "dflash2": dflash2}
        for name in args.trainers.split(","):
            if name not in TRAINERS:
                raise SystemExit(f"unknown trainer {name!r}: {TRAINERS}")
            say(f"{name}: {args.steps} steps")
            try:
                r = run_one(name, ctx=ctx, workdir=workdir, out=args.out, steps=args.steps, warmup=args.warmup,
                            timeout=args.timeout, cpu=cpu)
            except Exception:  # one trainer's failure does not stop the others
                r = {"trainer": name, "error": traceback.format_exc()[-3000:]}
            res["results"][name] = r
            save()
            say(f"{name}: " + json.dumps({k: r.get(k) for k in ("returncode", "steps", "first_step_s",
                                                              "ctx_tokens_per_s", "mfu", "peak_alloc_gib", "error",
                                                              "skipped")}, default=str)[:1500])
        res["table"] = table(res["results"])
        save()
        print(res["table"])
        print(profiles(res["results"]))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    ok = all(r.get("returncode") == 0 or r.get("skipped") for r in res["results"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
