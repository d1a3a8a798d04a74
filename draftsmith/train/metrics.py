"""What a run measures: loss and acceptance metrics, throughput, GPU memory, and where they are written.

:class:`Metrics` sums the drafter's training outputs over micro-batches and ranks (loss, per-position CE and
accuracy, :func:`expected_acceptance_length`); :func:`evaluate` runs them over the held-out rows;
:class:`Throughput` gives context tokens/s and model TFLOP/s per GPU; :class:`StepTimes` splits a step's time by
phase (``train.time_phases``); :class:`StepMemory` and :func:`peak_memory_gib` account GPU memory;
:func:`log_train_step` and :func:`log_heldout` write the log lines and TensorBoard scalars.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from draftsmith.modeling import DFlashDraftModel

log = logging.getLogger("draftsmith.train")


def expected_acceptance_length(acc: list[float]) -> float:
    """E[tau] = 1 + sum_k prod_{j<=k} acc_j from per-position accuracies ``acc_1..acc_{B-1}`` (bonus included;
    positions treated as independent)."""
    tau, surv = 1.0, 1.0
    for a in acc:
        surv *= a
        tau += surv
    return tau


class Metrics:
    """Sums of :class:`draftsmith.modeling.DFlashTrainOutput` fields over batches (and ranks), float64 on
    ``device``: ``nslot`` = block size - 1 predicted positions per block; ``selector``: also the DFlash2
    selector's (:class:`draftsmith.modeling_dflash2.DFlash2TrainOutput`)."""

    def __init__(self, nslot: int, device: torch.device, selector: bool = False):
        self.t = {"loss_w": torch.zeros((), dtype=torch.float64, device=device),
                  "weight": torch.zeros((), dtype=torch.float64, device=device),
                  "ce": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "correct": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "count": torch.zeros(nslot, dtype=torch.float64, device=device),
                  "accept": torch.zeros((), dtype=torch.float64, device=device),
                  "blocks": torch.zeros((), dtype=torch.float64, device=device)}
        self.selector = selector
        if selector:
            for key in ("selector_ce", "selector_correct", "candidate_recall"):
                self.t[key] = torch.zeros(nslot, dtype=torch.float64, device=device)

    def add(self, out) -> None:
        self.t["loss_w"] += out.weighted_ce.detach().double()
        self.t["weight"] += out.weight_sum.detach().double()
        self.t["ce"] += out.ce_sum.double()
        self.t["correct"] += out.correct.double()
        self.t["count"] += out.count.double()
        self.t["accept"] += out.accept_sum.double()
        self.t["blocks"] += out.full_blocks.double()
        if self.selector:
            self.t["selector_ce"] += out.selector_ce_sum.double()
            self.t["selector_correct"] += out.selector_correct.double()
            self.t["candidate_recall"] += out.candidate_recall.double()

    def all_reduce(self) -> None:
        if dist.is_initialized():
            for v in self.t.values():
                dist.all_reduce(v)

    def summary(self) -> dict[str, Any]:
        t = {k: v.cpu() for k, v in self.t.items()}
        count = t["count"].clamp_min(1)
        acc = (t["correct"] / count).tolist()
        selector = {}
        if self.selector:  # teacher-forced: the gold predecessor, the serving candidates
            sel_acc = (t["selector_correct"] / count).tolist()
            selector = {"selector_ce_per_position": (t["selector_ce"] / count).tolist(),
                        "selector_accuracy_per_position": sel_acc,
                        "candidate_recall_per_position": (t["candidate_recall"] / count).tolist(),
                        "selector_tau_expected": expected_acceptance_length(sel_acc)}
        return {
            "loss": float(t["loss_w"] / t["weight"].clamp_min(1e-12)),
            "ce_per_position": (t["ce"] / count).tolist(),
            "accuracy_per_position": acc,
            "predictions_per_position": [int(c) for c in t["count"].tolist()],
            "tau_expected": expected_acceptance_length(acc),
            "tau_blocks": float(1 + t["accept"] / t["blocks"].clamp_min(1)),
            "full_blocks": int(t["blocks"]),
            **selector,
        }


def evaluate(model: DFlashDraftModel, batches, embed, head, *, gamma: float, use_target_tokens: bool,
             device: torch.device, autocast, logits_chunk_bytes: int = 1 << 30,
             feature_dtype: torch.dtype | None = None, dpace_alpha: float | None = None) -> dict[str, Any]:
    """Held-out metrics over ``batches`` (this rank's share; summed over ranks): loss, CE and accuracy per
    position, ``tau_expected`` (from per-position accuracies) and ``tau_blocks`` (mean accepted prefix + 1 over
    fully supervised blocks); the loss is weighted as training's (``dpace_alpha``). Batches of float8 features are
    decoded on ``device`` to ``feature_dtype`` (default the embedding's dtype)."""
    was_training = model.training
    model.eval()
    metrics = Metrics(model.block_size - 1, device, selector=hasattr(model, "candidate_selector"))
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device, non_blocking=True).dequantize(feature_dtype or embed.dtype)
            with autocast():
                out = model.training_forward(batch, embed, head, gamma=gamma, dpace_alpha=dpace_alpha,
                                             use_target_tokens=use_target_tokens,
                                             logits_chunk_bytes=logits_chunk_bytes)
            metrics.add(out)
    metrics.all_reduce()
    model.train(was_training)
    return metrics.summary()


class Throughput:
    """Context tokens and model FLOPs per second, summed over ranks: since the loop started, and over the
    current window (the steps since the last log line; held-out evaluations and checkpoints are left out, so the
    window rate is the training rate once compilation has warmed up).

    The model FLOPs are :func:`draftsmith.flops.step_flops` (PaLM-style MFU: matmuls only, no recomputation);
    ``model_tflops_per_gpu`` divided by the GPU's dense bf16 peak is the MFU.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.t_start = self.t_window = time.time()
        self.tokens = self.window_tokens = 0
        self.window_flops = 0.0

    def add(self, tokens: int, flops: float) -> None:
        self.tokens += tokens
        self.window_tokens += tokens
        self.window_flops += flops

    def skip(self, now: float | None = None) -> None:
        """Start a new window (now, or at ``now``): the time since the last call is not training (evaluation,
        checkpoint)."""
        self.t_window = time.time() if now is None else now
        self.window_tokens, self.window_flops = 0, 0.0

    def rates(self, world: int) -> dict[str, float]:
        """``{"tokens_per_s", "window_tokens_per_s", "model_tflops_per_gpu"}`` over all ranks (a collective under
        torch.distributed), then a new window."""
        now = time.time()
        sums = torch.tensor([self.tokens, self.window_tokens, self.window_flops], dtype=torch.float64,
                            device=self.device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        tokens, window_tokens, window_flops = sums.tolist()
        window_s = max(now - self.t_window, 1e-9)
        out = {"tokens_per_s": tokens / max(now - self.t_start, 1e-9),
               "window_tokens_per_s": window_tokens / window_s,
               "model_tflops_per_gpu": window_flops / window_s / world / 1e12}
        self.skip(now)
        return out


class StepTimes:
    """Where each optimizer step's time goes, phase by phase (``train.time_phases``): the host's wall time and, on
    a GPU, the GPU's, in milliseconds.

    The trainer calls :meth:`start` when a step begins and :meth:`mark` at the end of each phase: ``fetch`` (the
    step's micro-batches from the prefetcher, and the loss scale), ``h2d`` (to the device), ``forward``,
    ``backward``, ``metrics`` (the step's loss and accuracy sums; these four summed over micro-batches), ``clip``,
    ``check`` (the finite-loss check: one host sync a step), ``optimizer``, ``zero_grad`` and ``log`` (the log
    line, held-out evaluation and checkpoint of the steps that have them). On a GPU every mark records a CUDA event
    on the current stream; the GPU time of a phase is the time between its event and the one before (the GPU's
    timeline: kernels and the gaps the host leaves between them), so a phase whose host time exceeds its GPU time
    is bound by kernel launches or the host. Events are read once they have completed (:meth:`collect`,
    non-blocking), so timing adds no synchronisation to the loop, except once at the end of a run of steps (the
    trainer's ``collect(wait=True)`` before the last checkpoint, which then holds the summary). A step's ``step``
    time runs from its start to the next step's (host and GPU), the last step's from its start to its last mark.
    speculators' ``profile/{fetch,fwd,bwd,clip,opt}_ms`` (its trainer's ``Profiler``) is the same split,
    synchronising the GPU at each boundary instead.

    Args:
        device: the training device (CUDA: GPU times too; else host times only).
        skip: steps left out of :meth:`summary`'s medians (compilation, warm-up); all steps when there are no more.
    """

    def __init__(self, device: torch.device, skip: int = 10):
        self.cuda = device.type == "cuda"
        self.skip = int(skip)
        self.records: list[dict[str, Any]] = []  # completed steps: {"step", "host_ms": {}, "gpu_ms": {}}
        self.pending: list[dict[str, Any]] = []  # steps whose GPU events may still be running
        self.current: dict[str, Any] | None = None
        self.left_out: set[int] = set()

    def leave_out(self, steps) -> None:
        """Keep ``steps`` (step numbers) out of :meth:`summary`'s medians (steps a profiler slowed), unless no other
        step is left."""
        self.left_out |= {int(s) for s in steps}

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream())  # the stream the step's kernels run on
        return ev

    def start(self, step: int) -> None:
        """Step ``step`` (1-based, as logged) begins; the step before it ends here."""
        now = time.perf_counter()
        event = self._event() if self.cuda else None
        if self.current is not None:
            self.current["host_ms"]["step"] = (now - self.current["t0"]) * 1e3
            self.current["next_event"] = event
            self.pending.append(self.current)
        self.current = {"step": int(step), "t0": now, "t": now, "host_ms": {}, "events": [("start", event)]}

    def mark(self, phase: str) -> None:
        """Phase ``phase`` of the current step ends (times of a phase marked twice in a step add up)."""
        cur = self.current
        if cur is None:
            return
        now = time.perf_counter()
        cur["host_ms"][phase] = cur["host_ms"].get(phase, 0.0) + (now - cur["t"]) * 1e3
        cur["t"] = now
        if self.cuda:
            cur["events"].append((phase, self._event()))

    def collect(self, wait: bool = False) -> list[dict[str, Any]]:
        """The pending steps whose events have completed (all of them, after a GPU sync, with ``wait``), moved to
        :attr:`records` with their GPU times; returns them (the caller may log them)."""
        if wait and self.current is not None:  # the run's last step: it ends at its last mark
            cur, self.current = self.current, None
            cur["host_ms"]["step"] = (cur["t"] - cur["t0"]) * 1e3
            cur["next_event"] = cur["events"][-1][1] if self.cuda else None
            self.pending.append(cur)
        done = []
        while self.pending:
            rec = self.pending[0]
            last = rec.get("next_event")
            if self.cuda and last is not None and not (wait or last.query()):
                break
            if self.cuda and last is not None:
                last.synchronize()
                gpu: dict[str, float] = {}
                events = rec["events"]
                for (_, before), (phase, after) in zip(events, events[1:]):
                    gpu[phase] = gpu.get(phase, 0.0) + before.elapsed_time(after)
                gpu["step"] = events[0][1].elapsed_time(last)
                rec["gpu_ms"] = gpu
            self.pending.pop(0)
            out = {"step": rec["step"], "host_ms": rec["host_ms"], **({"gpu_ms": rec["gpu_ms"]} if "gpu_ms" in rec
                                                                        else {})}
            self.records.append(out)
            done.append(out)
        return done

    def summary(self) -> dict[str, Any] | None:
        """Medians over the recorded steps after the first :attr:`skip` (all of them when there are no more), but
        those left out (:meth:`leave_out`):
        ``{"steps": n, "skipped": k, "host_ms": {phase: ms}, "gpu_ms": {phase: ms}}`` (``gpu_ms`` on a GPU only);
        None before any step completed. trainer_state.json's ``step_phases_ms``."""
        recs = self.records[self.skip:] if len(self.records) > self.skip else self.records
        recs = [r for r in recs if r["step"] not in self.left_out] or recs
        if not recs:
            return None
        out: dict[str, Any] = {"steps": len(recs), "skipped": len(self.records) - len(recs)}
        for kind in ("host_ms", "gpu_ms"):
            phases = [k for r in recs for k in r.get(kind, {})]
            if phases:
                order = list(dict.fromkeys(phases))
                out[kind] = {k: round(statistics.median(r[kind].get(k, 0.0) for r in recs if kind in r), 3)
                             for k in order}
        return out

    @staticmethod
    def describe(summary: dict[str, Any]) -> str:
        """One log line of :meth:`summary`: ``fetch 0.1 / 2.0, ..., step 124.0 / 124.3 ms`` (GPU / host)."""
        host, gpu = summary.get("host_ms", {}), summary.get("gpu_ms")
        if gpu is None:
            return ", ".join(f"{k} {v:.1f}" for k, v in host.items()) + " ms (host)"
        return ", ".join(f"{k} {gpu.get(k, 0.0):.1f} / {host.get(k, 0.0):.1f}" for k in host) + " ms (GPU / host)"


class StepMemory:
    """GPU memory of each phase of one optimizer step: what the step starts with and, per phase, the peak
    allocated during it and what stays allocated after it (GiB, torch's caching-allocator counters).

    The phases are ``forward`` / ``backward`` per micro-batch (``forward.2``, ... when ``grad_accum`` > 1), then
    ``clip`` (gradient norm), ``optimizer`` (AdamW step) and ``zero_grad``. Reading the counters needs no GPU
    sync: allocations are made when the host enqueues the kernels. Each phase resets the allocator's peak, so
    the whole run's peak is carried in :attr:`run_peak` (bytes) and :func:`peak_memory_gib` takes it as a floor.
    Written to trainer_state.json as ``memory_by_phase_gib`` (rank 0's); the question it answers: where DDP's
    extra memory over one process sits.

    Args:
        allocated, peak, reset: the counters (default ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` /
            ``reset_peak_memory_stats`` of ``device``), replaceable for tests.
    """

    def __init__(self, device: torch.device | None = None, *, allocated=None, peak=None, reset=None):
        self.allocated = allocated or (lambda: torch.cuda.memory_allocated(device))
        self.peak = peak or (lambda: torch.cuda.max_memory_allocated(device))
        self.reset = reset or (lambda: torch.cuda.reset_peak_memory_stats(device))
        self.run_peak = 0
        self.phases: dict[str, dict[str, float]] = {}

    def start(self) -> None:
        """Before the step: records what is allocated (weights, optimizer state, DDP buckets) and resets the peak."""
        self.run_peak = max(self.run_peak, self.peak())
        self.phases = {"start": {"allocated_gib": round(self.allocated() / 2 ** 30, 2)}}
        self.reset()

    def mark(self, phase: str) -> None:
        """At the end of ``phase``: its peak and what it left allocated; resets the peak for the next phase."""
        peak = self.peak()
        self.run_peak = max(self.run_peak, peak)
        name, k = phase, 1
        while name in self.phases:
            k += 1
            name = f"{phase}.{k}"
        self.phases[name] = {"peak_gib": round(peak / 2 ** 30, 2), "after_gib": round(self.allocated() / 2 ** 30, 2)}
        self.reset()

    def summary(self) -> str:
        """One log line: ``start 30.1; forward peak 60.2 -> 58.0; ...`` (GiB)."""
        parts = [f"start {self.phases['start']['allocated_gib']:.1f}"] if "start" in self.phases else []
        parts += [f"{k} peak {v['peak_gib']:.1f} -> {v['after_gib']:.1f}" for k, v in self.phases.items()
                  if k != "start"]
        return "; ".join(parts) + " GiB"


def peak_memory_gib(device: torch.device, floor_bytes: int = 0) -> list[float] | None:
    """Peak GPU memory allocated by torch on each rank (GiB, ``torch.cuda.max_memory_allocated``, or
    ``floor_bytes`` when higher: the peak of phases whose counter :class:`StepMemory` reset; rank order);
    None on the CPU. A collective under torch.distributed."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([max(torch.cuda.max_memory_allocated(device), floor_bytes) / 2 ** 30], dtype=torch.float64,
                        device=device)
    every = [peak]
    if dist.is_initialized():
        every = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(every, peak)
    return [round(float(t), 2) for t in every]


def log_train_step(writer, step: int, metrics: Metrics, lr: float, grad_norm: torch.Tensor, throughput: Throughput,
                   *, world: int, on_gpu: bool, bar) -> dict[str, Any]:
    """The training line of step ``step``: loss and accuracy summed over ranks (a collective), learning rate,
    gradient norm, rates (:meth:`Throughput.rates`) to TensorBoard (``writer``, None on ranks > 0) and the progress
    bar; returns it as ``{"step", "loss", "lr", "grad_norm", **rates}``."""
    grad_norm = float(grad_norm)
    metrics.all_reduce()
    summary = metrics.summary()
    rates = throughput.rates(world)
    if writer is not None:
        writer.add_scalar("train/loss", summary["loss"], step)
        writer.add_scalar("train/lr", lr, step)
        writer.add_scalar("train/grad_norm", grad_norm, step)
        writer.add_scalar("train/tokens_per_s", rates["window_tokens_per_s"], step)
        writer.add_scalar("train/model_tflops_per_gpu", rates["model_tflops_per_gpu"], step)
        writer.add_scalar("train/accuracy_pos01", summary["accuracy_per_position"][0], step)
    flops = f", {rates['model_tflops_per_gpu']:.0f} TFLOP/s/GPU" if on_gpu else ""
    bar.set_postfix_str(f"loss {summary['loss']:.4f}, lr {lr:.2e}, {rates['window_tokens_per_s']:,.0f} ctx "
                        f"tok/s{flops}", refresh=False)
    return {"step": step, "loss": summary["loss"], "lr": lr, "grad_norm": grad_norm, **rates}


def log_heldout(writer, metrics: dict, step: int) -> None:
    """The held-out metrics of ``step`` (:func:`evaluate`) to TensorBoard (``writer``, None on ranks > 0) and the
    log."""
    if writer is not None:
        writer.add_scalar("eval/loss", metrics["loss"], step)
        writer.add_scalar("eval/tau_expected", metrics["tau_expected"], step)
        writer.add_scalar("eval/tau_blocks", metrics["tau_blocks"], step)
        for k, a in enumerate(metrics["accuracy_per_position"], start=1):
            writer.add_scalar(f"eval/accuracy_pos{k:02d}", a, step)
    log.info("step %d held-out: loss %.4f, tau_expected %.3f, tau_blocks %.3f, acc %s", step, metrics["loss"],
             metrics["tau_expected"], metrics["tau_blocks"],
             " ".join(f"{a:.2f}" for a in metrics["accuracy_per_position"]))
    if "selector_tau_expected" in metrics:  # DFlash2
        if writer is not None:
            writer.add_scalar("eval/selector_tau_expected", metrics["selector_tau_expected"], step)
        log.info("step %d held-out selector (teacher-forced): tau_expected %.3f, acc %s, candidate recall %s", step,
                 metrics["selector_tau_expected"],
                 " ".join(f"{a:.2f}" for a in metrics["selector_accuracy_per_position"]),
                 " ".join(f"{a:.2f}" for a in metrics["candidate_recall_per_position"]))
