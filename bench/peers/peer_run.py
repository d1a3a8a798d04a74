"""Running the three trainers on the same rows for the peer benchmark: each one's configuration built from one
drafter description, the run itself (a subprocess with the step probe, its output logged), and what each trainer's
own logs say. Used by bench/peers/throughput.py and bench/peers/quality.py.

How each trainer is told the same drafter (docs/peers/README.md lists the settings and the differences):

* the drafter's z-lab ``config.json`` is built once by draftsmith (:func:`drafter_config`, the same function as the
  workflow's train stage); speculators gets its Qwen3 part as ``--draft-config`` (its decoder shape, ``layer_types``
  and ``sliding_window``) plus ``--target-layer-ids`` (z-lab + 1), ``--block-size``, ``--mask-token-id``; SpecForge
  gets the whole file as ``model.draft_model_config`` (with ``block_size`` at the top level, where its
  ``DFlashDraftModel`` reads it);
* the Python of each peer is its own (``SPECULATORS_PYTHON`` / ``SPECFORGE_PYTHON``; on the device ``python3`` with
  the peer's site folder first on ``PYTHONPATH``), the probe folder (bench/peers/probe) on ``PYTHONPATH``.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peerlib import REPO, speculators_layer_ids

PROBE_DIR = Path(__file__).resolve().parent / "probe"
#: z-lab keys a plain Qwen3 decoder config (speculators' --draft-config) does not hold
ZLAB_ONLY_KEYS = ("dflash_config", "num_target_layers", "is_causal", "block_size", "architectures", "auto_map",
                  "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "transformers_version")


# --------------------------------------------------------------------------------------------------------------
# the drafter, once
# --------------------------------------------------------------------------------------------------------------

def drafter_config(target_dir: str | os.PathLike, drafter: dict, layer_ids: list[int], mask_token_id: int):
    """The z-lab drafter config every trainer trains: draftsmith's ``build_drafter_config`` from the target's
    config and the run's ``drafter`` section (layers, block size, layer types, window, causality, sizes,
    architecture), with the features' tapped ``layer_ids`` and the run's ``mask_token_id``."""
    from transformers import AutoConfig

    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.target import weight_files

    tcfg = AutoConfig.from_pretrained(target_dir)
    vocab = None
    files = weight_files(Path(target_dir))
    from safetensors import safe_open

    for key in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        if key in files:
            with safe_open(str(files[key]), framework="pt") as fh:
                vocab = int(fh.get_slice(key).get_shape()[0])
            break
    optional = {k: drafter.get(k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "rope_theta")}
    extra = {k: drafter[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
             if drafter.get("architecture") == "dflash2" and k in drafter}
    return build_drafter_config(
        tcfg, num_layers=int(drafter["num_layers"]), block_size=int(drafter["block_size"]),
        target_layer_ids=list(layer_ids), mask_token_id=int(mask_token_id), vocab_size=vocab,
        layer_types=drafter.get("layer_types"), sliding_window=drafter.get("sliding_window"),
        is_causal=drafter.get("is_causal"), architecture=drafter.get("architecture", "dflash"),
        **{k: v for k, v in optional.items() if v is not None}, **extra)


def zlab_dict(config) -> dict:
    """The config as draftsmith writes it into config.json (z-lab form)."""
    from draftsmith.drafter_config import drafter_config_dict

    return drafter_config_dict(config)


def write_draft_configs(config, folder: Path) -> dict[str, Path]:
    """``folder/zlab.json`` (SpecForge's draft config: the z-lab dict + top-level ``block_size``) and
    ``folder/speculators-decoder.json`` (the Qwen3 decoder part only, speculators' ``--draft-config``)."""
    folder.mkdir(parents=True, exist_ok=True)
    d = zlab_dict(config)
    zlab = dict(d, block_size=int(d["dflash_config"]["block_size"]))
    decoder = {k: v for k, v in d.items() if k not in ZLAB_ONLY_KEYS}
    decoder["model_type"] = "qwen3"
    paths = {"zlab": folder / "zlab.json", "speculators": folder / "speculators-decoder.json"}
    paths["zlab"].write_text(json.dumps(zlab, indent=1))
    paths["speculators"].write_text(json.dumps(decoder, indent=1))
    return paths


# --------------------------------------------------------------------------------------------------------------
# each trainer's command
# --------------------------------------------------------------------------------------------------------------

def python_cmd(env_name: str) -> list[str]:
    """The Python of a peer: ``$<env_name>`` split like a shell word list (default ``python3``)."""
    return shlex.split(os.environ.get(env_name, "python3"))


def speculators_cmd(*, target: Path, data: Path, out: Path, decoder_config: Path, layer_ids: list[int],
                    block_size: int, mask_token_id: int, architecture: str, train_ratio: float, total_seq_len: int,
                    max_anchors: int, lr: float, epochs: int, max_steps: int, warmup_ratio: float, log_dir: Path,
                    seed: int = 0, num_workers: int | None = None, dflash2: dict | None = None,
                    optimizer: str | None = None, loss: dict | None = None, cpu: bool = False) -> list[str]:
    """``python -m speculators.train`` (speculators 0.9.0, file backend, no vLLM: ``--on-missing raise``) on the
    writer's folder. Kept from its recipe: Muon (``--optimizer muon``, its default), its loss (CE on the verifier's
    argmax with D-PACE for DFlash; KL + fixed-exp-decay for DFlash2), grad clip 1.0 (hard-coded), bf16 autocast,
    flex attention; matched to draftsmith's run: lr, cosine schedule and warmup ratio, tokens per packed row,
    anchors per packed row, steps, seed. Loader workers: ``num_workers``, else ``$SPECULATORS_WORKERS``, else 8
    (its default, 12 spawned workers with 4 batches each in flight, holds ~50 GB of pinned host memory at the 27B
    shape). ``optimizer``: ``--optimizer`` (None: its default, Muon; ``adamw``: draftsmith's optimizer, the matched
    ablation). ``loss``: loss flags, e.g. ``{"loss_fn": "ce", "per_position_loss_weight": "dpace"}`` (None: its
    defaults for the architecture). ``cpu``: a CPU run (bench/peers/cpu_shim.py, SDPA, eager loss, no workers) in
    float32 (``--hidden-states-dtype float32``: its hidden states and autocast in float32, as draftsmith trains on the
    CPU; a CPU without bf16 instructions emulates bf16 matmuls, and a CPU-scale comparison should not differ in
    precision).

    Loss kernel: ``$SPECULATORS_LOSS`` (default ``eager``). Its default, ``fused`` (Triton kernels called inside its
    compiled forward), stopped torch 2.11's dynamo on the H200 before the first step ("ListVariable ... is already
    tracked for mutation" on ``loss_backward_kernel.configs``; docs/peers/throughput-2026-12-03/speculators.log), so
    the bench runs its eager loss: the same loss, computed by torch ops, which costs it some speed (said beside its
    figures)."""
    if num_workers is None:
        num_workers = int(os.environ.get("SPECULATORS_WORKERS", "8"))
    entry = ([str(Path(__file__).resolve().parent / "cpu_shim.py"), "speculators.train"] if cpu
             else ["-m", "speculators.train"])
    cmd = [*python_cmd("SPECULATORS_PYTHON"), *entry,
           "--verifier-name-or-path", str(target), "--speculator-type", architecture,
           "--data-path", str(data), "--hidden-states-backend", "file", "--on-missing", "raise",
           "--draft-config", str(decoder_config), "--target-layer-ids", *map(str, speculators_layer_ids(layer_ids)),
           "--block-size", str(block_size), "--mask-token-id", str(mask_token_id),
           "--train-data-ratio", repr(train_ratio), "--total-seq-len", str(total_seq_len),
           "--max-anchors", str(max_anchors), "--lr", repr(lr), "--scheduler-type", "cosine",
           "--scheduler-warmup-ratio", repr(warmup_ratio), "--epochs", str(epochs), "--max-steps", str(max_steps),
           "--save-path", str(out), "--seed", str(seed), "--num-workers", str(num_workers),
           "--logger", "tensorboard", "--log-dir", str(log_dir), "--run-name", "peers", "--log-freq", "1",
           "--no-resume-from-checkpoint"]
    if not cpu:
        cmd += ["--loss-implementation", os.environ.get("SPECULATORS_LOSS", "eager")]
    if optimizer:
        cmd += ["--optimizer", optimizer]
    for key, value in {**(dflash2 or {}), **(loss or {})}.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    if cpu:
        cmd += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
                "--hidden-states-dtype", "float32"]
    return cmd


def speculators_epochs(*, data: Path, train_ratio: float, total_seq_len: int, seed: int, steps: int,
                       peer_site: str | None = None, max_epochs: int = 1000) -> tuple[int, list[int]]:
    """``(epochs, steps of each)``: the least number of speculators epochs that holds ``steps`` optimizer steps,
    counted by speculators' own sampler (bench/peers/speculators_steps.py in its Python). Its trainer runs one extra
    step in every epoch after the one that reaches ``--max-steps``, so ``--epochs`` must be exactly this.

    Raises:
        RuntimeError: the sampler could not be run (its output quoted).
    """
    epochs = 1
    while True:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (peer_site,) if p))
        out = subprocess.run([*python_cmd("SPECULATORS_PYTHON"), str(Path(__file__).resolve().parent /
                                                                       "speculators_steps.py"),
                              "--data", str(data), "--train-ratio", repr(train_ratio), "--total-seq-len",
                              str(total_seq_len), "--seed", str(seed), "--epochs", str(epochs)],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"speculators_steps.py failed: {out.stderr[-2000:]}")
        per = json.loads(out.stdout.strip().splitlines()[-1])["steps_per_epoch"]
        if sum(per) >= steps or epochs >= max_epochs:
            cum, need = 0, 0
            for n in per:
                cum += n
                need += 1
                if cum >= steps:
                    break
            return need, per[:need]
        epochs = min(max_epochs, max(epochs * 2, -(-steps // max(1, per[0]))))


def specforge_config(*, target: Path, data: Path, out: Path, draft_config: Path, mask_token_id: int, max_length: int,
                     batch_size: int, num_anchors: int, gamma: float, lr: float, warmup_ratio: float, epochs: int,
                     max_steps: int, grad_clip: float, seed: int = 0, workers: int = 8, cpu: bool = False,
                     sharding: str | None = None, embedding_key: str = "model.embed_tokens.weight",
                     lm_head_key: str = "lm_head.weight") -> dict:
    """SpecForge 0.2.0's run config (``specforge train -c``): offline DFlash (``data.hidden_states_path``),
    ``deployment.mode: local_colocated`` on one GPU. Kept from its recipe: AdamW over fp32 masters of bf16 weights
    (its BF16Optimizer), the data tokens as labels with exp(-(k-1)/gamma) slot weights, its anchors (per sample,
    two consecutive supervised tokens), flex attention, FSDP ``SHARD_GRAD_OP`` (its default; ``sharding``
    overrides); matched: lr, cosine schedule, warmup ratio, grad clip, gamma, steps, seed. ``cpu``: the CPU smoke
    (SDPA, ``NO_SHARD``: FSDP needs an accelerator)."""
    training = {
        "strategy": "dflash", "num_epochs": int(epochs), "max_steps": int(max_steps), "total_steps": int(max_steps),
        "batch_size": int(batch_size), "learning_rate": float(lr), "lr_scheduler": "cosine",
        "warmup_ratio": float(warmup_ratio), "max_grad_norm": float(grad_clip), "num_anchors": int(num_anchors),
        "loss_decay_gamma": float(gamma), "loss_type": "dflash", "attention_backend": "sdpa" if cpu else
        "flex_attention", "log_interval": 1, "seed": int(seed), "save_interval": 0,
    }
    if cpu or sharding:
        training["fsdp_sharding"] = "NO_SHARD" if cpu else sharding
    return {
        "model": {"target_model_path": str(target), "draft_model_config": str(draft_config),
                  "mask_token_id": int(mask_token_id), "torch_dtype": "bfloat16", "embedding_key": embedding_key,
                  "lm_head_key": lm_head_key},
        "data": {"hidden_states_path": str(data), "max_length": int(max_length),
                 "dataloader_num_workers": 0 if cpu else int(workers)},
        "training": training,
        "deployment": {"mode": "local_colocated"},
        "run_id": "peers", "output_dir": str(out),
    }


def specforge_cmd(config_path: Path) -> list[str]:
    return [*python_cmd("SPECFORGE_PYTHON"), "-m", "specforge.cli", "train", "-c", str(config_path)]


def draftsmith_cmd(*, index: Path, target: Path, out: Path, args: dict, threads: int) -> list[str]:
    """``python -m draftsmith.train`` (one process) with the run's train / drafter sections as ``--args``."""
    return [sys.executable, "-m", "draftsmith.train", "--index", str(index), "--target", str(target),
            "--out", str(out), "--threads", str(threads), "--args", json.dumps(args)]


# --------------------------------------------------------------------------------------------------------------
# running one
# --------------------------------------------------------------------------------------------------------------

class GpuPoll:
    """The largest nvidia-smi ``memory.used`` (MiB) while a run goes (empty without nvidia-smi)."""

    def __init__(self, interval: float = 1.0):
        import shutil

        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(interval,), daemon=True) \
            if shutil.which("nvidia-smi") else None
        if self.thread:
            self.thread.start()

    def _run(self, interval: float) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                self.peak = max([self.peak, *(int(x) for x in out)])
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self.stop.wait(interval)

    def close(self) -> int | None:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=15)
        return self.peak or None


def run(cmd: list[str], *, log_path: Path, probe: Path, timeout: float, peer_site: str | None = None,
        peer: bool = False, cwd: Path = REPO, label: str = "") -> dict:
    """Run ``cmd`` in its own process group with the probe (``PEERS_PROBE=probe``); output to ``log_path`` (and the
    last lines kept); killed after ``timeout`` s.

    ``PYTHONPATH``: the probe folder, then for a peer (``peer``) its site folder ``peer_site`` (on the device; None
    with a virtualenv's Python) and nothing of this checkout, else the checkout and the inherited ``PYTHONPATH``
    (draftsmith's site). Returns returncode, wall seconds, the nvidia-smi peak and the output tail."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PEERS_PROBE=str(probe))
    paths = [str(PROBE_DIR), peer_site] if peer else [str(PROBE_DIR), str(REPO), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    tail: collections.deque = collections.deque(maxlen=400)
    poll = GpuPoll()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_path, "w", buffering=1) as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                tail.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=20)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = -9
        reader.join(timeout=10)
    return {"label": label, "returncode": rc, "start": start, "wall_s": time.time() - start,
            "nvidia_smi_peak_mib": poll.close(), "log": str(log_path), "tail": "".join(tail)[-6000:]}


# --------------------------------------------------------------------------------------------------------------
# what the runs say
# --------------------------------------------------------------------------------------------------------------

def read_probe(probe: Path) -> dict:
    """The probe's records of the run (every process's file ``probe.<pid>``): the process that stepped, its step
    times (seconds since it started), first-step time and peak memory."""
    best: dict[str, Any] = {"steps": []}
    for f in sorted(probe.parent.glob(probe.name + ".*")):
        start, steps = None, []
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "start":
                start = rec["wall"]
            elif "step" in rec:
                steps.append(rec)
        if len(steps) > len(best["steps"]):
            best = {"steps": steps, "process_start": start, "file": str(f)}
    steps = best["steps"]
    if not steps:
        return {"steps": 0}
    mem = [s["mem_alloc_gib"] for s in steps if s.get("mem_alloc_gib") is not None]
    res = [s["mem_reserved_gib"] for s in steps if s.get("mem_reserved_gib") is not None]
    return {"steps": len(steps), "first_step_s": steps[0]["t"], "t": [s["t"] for s in steps],
            "wall": [s["wall"] for s in steps], "optimizer": steps[0]["opt"],
            "opt_s": [s.get("opt_s") for s in steps],
            "peak_alloc_gib": max(mem) if mem else None, "peak_reserved_gib": max(res) if res else None,
            "process_start": best.get("process_start"), "file": best.get("file")}


def step_rates(probe: dict, tokens_per_step: list[float] | float, warmup: int) -> dict:
    """Context tokens/s after ``warmup`` steps from the probe's step times: ``window`` = tokens of steps
    warmup+1..N / their time; ``median`` = median over those steps of tokens / step interval (robust to a
    checkpoint or validation pass between two steps); ``median_optimizer_s`` = median over those steps of the probe's
    optimizer time (``opt_s``: GPU-synchronised optimizer steps). ``tokens_per_step``: per step, or one mean for
    all."""
    t = probe.get("t") or []
    if len(t) <= warmup + 1:
        return {"window": None, "median": None, "steps_timed": 0}
    per = tokens_per_step if isinstance(tokens_per_step, list) else [tokens_per_step] * len(t)
    per = (per + [per[-1]] * len(t))[:len(t)] if per else [float("nan")] * len(t)
    intervals = [(t[i] - t[i - 1], per[i]) for i in range(warmup + 1, len(t))]
    window = sum(n for _, n in intervals) / sum(d for d, _ in intervals)
    dts = [d for d, _ in intervals]
    opt = [o for o in (probe.get("opt_s") or [])[warmup + 1:] if o is not None]
    return {"window": window, "median": statistics.median_high(n / d for d, n in intervals if d > 0),
            "steps_timed": len(intervals), "median_step_s": statistics.median_high(dts),
            "mean_step_s": sum(dts) / len(dts), "median_optimizer_s": statistics.median_high(opt) if opt else None}


def speculators_scalars(log_dir: Path, tags: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """speculators' TensorBoard scalars ``tags`` (e.g. ``profile/fwd_ms``): for each, ``{step: value}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {tag: {} for tag in tags}
    for f in sorted(log_dir.rglob("events.out.tfevents*")):
        ea = EventAccumulator(str(f), size_guidance={"scalars": 0})
        ea.Reload()
        have = set(ea.Tags().get("scalars", []))
        for tag in tags:
            if tag in have:
                found[tag].update({e.step: e.value for e in ea.Scalars(tag)})
    return found


def speculators_step_tokens(log_dir: Path) -> list[float]:
    """speculators' context tokens per step (TensorBoard ``profile/tokens_per_s`` x ``profile/step_ms``: the
    packed row's non-padding tokens), in step order."""
    s = speculators_scalars(log_dir, ("profile/tokens_per_s", "profile/step_ms"))
    rate, ms = s["profile/tokens_per_s"], s["profile/step_ms"]
    return [round(rate[k] * ms[k] / 1000.0) for k in sorted(rate) if k in ms]


SPECULATORS_PROFILE_PARTS = ("fetch", "h2d", "fwd", "bwd", "clip", "opt", "step")


def _profile_medians(series: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """``{"<part>_ms": median_high of that part's values after the first warmup}`` for each profile part with values
    left (``series``: part -> values in step order)."""
    out = {}
    for n in SPECULATORS_PROFILE_PARTS:
        values = series.get(n, [])[warmup:]
        if values:
            out[f"{n}_ms"] = statistics.median_high(values)
    return out


def speculators_profile(log_dir: Path, warmup: int) -> dict[str, float]:
    """speculators' own per-step profile (TensorBoard ``profile/{fetch,h2d,fwd,bwd,clip,opt,step}_ms``): the median of
    each over the steps after ``warmup``, in milliseconds (empty when it logged none)."""
    scalars = speculators_scalars(log_dir, tuple(f"profile/{n}_ms" for n in SPECULATORS_PROFILE_PARTS))
    return _profile_medians({n: [v for _, v in sorted(scalars[f"profile/{n}_ms"].items())]
                             for n in SPECULATORS_PROFILE_PARTS}, warmup)


SPECULATORS_LOG_RECORD = re.compile(r"train/loss=")
SPECULATORS_LOG_VALUE = re.compile(r"(profile/[a-z0-9_]+_ms|global_step)=([0-9.eE+-]+?)(?:,|\s|$)")


def speculators_log_profile(log_path: Path, warmup: int) -> dict[str, float]:
    """:func:`speculators_profile` from speculators' console log instead of its TensorBoard events (what a device
    call brings back when the run's folder is gone): each training record (``train/loss=...``, wrapped over lines
    by rich) gives ``profile/<part>_ms`` and ``global_step``; the median of each part over the records after the
    first ``warmup``, in milliseconds, plus ``steps_logged``."""
    records = []
    for chunk in SPECULATORS_LOG_RECORD.split(Path(log_path).read_text(errors="replace"))[1:]:
        values = {k: float(v) for k, v in SPECULATORS_LOG_VALUE.findall(chunk)}
        if "global_step" in values:
            records.append(values)
    records.sort(key=lambda r: r["global_step"])
    series = {n: [r[f"profile/{n}_ms"] for r in records[warmup:] if f"profile/{n}_ms" in r]
              for n in SPECULATORS_PROFILE_PARTS}
    return {"steps_logged": len(records), **_profile_medians(series, 0)}


def speculators_checkpoints(out: Path) -> list[Path]:
    """speculators' checkpoint folders (``SAVE_PATH/<epoch>``), oldest first."""
    return sorted((p for p in out.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


SPECFORGE_STEP = re.compile(r"^step (\d+): (\{.*\})\s*$")


def specforge_steps(log_path: Path) -> list[dict]:
    """SpecForge's per-step log records (``step N: {...}`` lines with loss, acc, perf/...)."""
    import ast

    out = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        m = SPECFORGE_STEP.match(line.strip())
        if m:
            try:
                out.append({"step": int(m.group(1)), **ast.literal_eval(m.group(2))})
            except (ValueError, SyntaxError):
                continue
    return out


def specforge_checkpoint(out: Path) -> Path | None:
    """SpecForge's newest checkpoint folder (``<run_id>-latest`` -> ``<run_id>-step<N>``)."""
    latest = out / "peers-latest"
    if latest.exists():
        return latest.resolve()
    steps = sorted(out.glob("peers-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1]))
    return steps[-1] if steps else None


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
