"""A kernel trace of a few training steps (``train.profile_steps``): where a step's time goes below the phases.

``train.time_phases`` splits each step into phases by the host's clock and CUDA events; it cannot say whether a
phase's GPU time is kernels or the gaps between them, which kernels dominate, or where the host waits for the GPU.
:class:`StepProfiler` runs ``torch.profiler`` (CPU and, on a GPU, CUDA activity) over ``train.profile_steps``
consecutive steps after the compile warm-up, with zero-length markers at the trainer's phase boundaries, and writes
to ``<run out>/profile/``:

- ``trace.json.gz``: the Chrome / Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev);
- ``summary.json`` and ``summary.txt``: per step, the host's wall time, the GPU's kernel time (summed and as the
  union of their intervals: the GPU's busy time) and the kernel count; per phase, the kernels launched in it (count
  and GPU ms, a kernel counted in the phase its launch fell in) and the host's operator time; the 25 kernels with
  the most GPU time and the 25 operators with the most host self time; and, on a GPU, every **synchronising CUDA
  call** the steps made (``torch.cuda.set_sync_debug_mode("warn")`` over the window), each with the draftsmith
  source line that led to it, counted.

The profile changes nothing that is trained (the same weights with and without it); it slows the profiled steps.
Rank 0 only. Reference: PyTorch's profiler recipe (https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html).
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import logging
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from draftsmith.io import atomic_path, write_json, write_text

log = logging.getLogger("draftsmith.train")

#: the profiled steps start after this many steps of the process (torch.compile's first graphs, the allocator)
PROFILE_SKIP = 10
MARK_PREFIX = "draftsmith.mark."
SYNC_MESSAGE = "synchronizing CUDA operation"  # torch's set_sync_debug_mode("warn") warning (c10/cuda)
TOP = 25
PHASE_TOP = 8


def profile_window(start_step: int, end_step: int, steps: int, skip: int = PROFILE_SKIP) -> tuple[int, int] | None:
    """The steps (1-based, as logged; first and last, inclusive) a run of steps ``start_step + 1 .. end_step``
    profiles: ``steps`` of them after the first ``skip`` of this process, earlier when the run is shorter; None for
    ``steps`` 0 or a run of no step."""
    run = end_step - start_step
    if steps <= 0 or run <= 0:
        return None
    n = min(steps, run)
    first = start_step + 1 + min(skip, run - n)
    return first, first + n - 1


class StepProfiler:
    """``torch.profiler`` over steps ``first .. last`` of the training loop, with the phase marks of
    :class:`~draftsmith.train.metrics.StepTimes` (the trainer calls :meth:`start` and :meth:`mark` beside it, and
    :meth:`close` when the loop ends, whatever the reason).

    Args:
        device: the training device (CUDA: kernels, and the synchronising calls).
        out_dir: the run's folder; the profile goes to ``out_dir / "profile"`` (replaced).
        window: ``(first, last)`` step numbers (:func:`profile_window`).
    """

    def __init__(self, device: torch.device, out_dir: Path, window: tuple[int, int]):
        self.cuda = device.type == "cuda"
        self.folder = Path(out_dir) / "profile"
        self.first, self.last = window
        self.stack: contextlib.ExitStack | None = None
        self.prof = None
        self.steps: list[int] = []
        self.marks: list[tuple[int, str]] = []  # (step, phase) in the order the markers were recorded
        self.syncs: dict[str, int] = {}
        self.summary: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.prof is not None

    def start(self, step: int) -> None:
        """Step ``step`` begins: the window opens at :attr:`first`, closes (and the profile is written) after
        :attr:`last`."""
        if self.active and step > self.last:
            self._marker("start", step)  # the last profiled step's end
            self.close()
        if self.summary is None and not self.active and step == self.first:
            self._open()
        if self.active:
            self.steps.append(step)
            self._marker("start", step)

    def mark(self, phase: str) -> None:
        """Phase ``phase`` of the current step ends (as :meth:`StepTimes.mark`)."""
        if self.active:
            self._marker(phase, self.steps[-1])

    def _marker(self, phase: str, step: int) -> None:
        with torch.profiler.record_function(f"{MARK_PREFIX}{len(self.marks)}"):
            pass
        self.marks.append((step, phase))

    def _open(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        stack = contextlib.ExitStack()
        if self.cuda:
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if SYNC_MESSAGE in str(message):
                    self._sync_seen()
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = stack.enter_context(profile(activities=activities, record_shapes=False, with_stack=False))
        self.stack = stack
        log.info("profiling steps %d-%d (train.profile_steps) into %s", self.first, self.last, self.folder)

    def _sync_seen(self) -> None:
        """Count a synchronising call by its draftsmith source line (else the innermost Python line)."""
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in Path(f.filename).name]
        ours = [f for f in frames if "/draftsmith/" in f.filename and not f.filename.endswith("train/profile.py")]
        where = ours[-1] if ours else (frames[-1] if frames else None)
        key = f"{_short(where.filename)}:{where.lineno} {where.line or ''}".strip() if where else "<unknown>"
        self.syncs[key] = self.syncs.get(key, 0) + 1

    def close(self) -> dict[str, Any] | None:
        """End the window (if open), write the trace and the summary; returns the summary (None if nothing was
        profiled). A failure to write is logged, not raised: the profile must not stop a training run."""
        if not self.active:
            return self.summary
        stack, prof, self.stack, self.prof = self.stack, self.prof, None, None
        stack.close()
        t0 = time.perf_counter()
        # a profile is a diagnostic: whatever fails below is logged, and training goes on
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_trace(prof)
        except Exception as exc:
            log.warning("train.profile_steps: the trace of steps %d-%d could not be written: %r", self.first,
                        self.last, exc)
        try:
            self.summary = summarize(prof.events(), self.marks, cuda=self.cuda)
            self.summary["syncs"] = dict(sorted(self.syncs.items(), key=lambda kv: -kv[1]))
            write_json(self.folder / "summary.json", self.summary)
            write_text(self.folder / "summary.txt", describe(self.summary))
        except Exception as exc:
            log.warning("train.profile_steps: the summary of steps %d-%d could not be made: %r", self.first,
                        self.last, exc)
            self.summary = {"error": repr(exc)}
            return self.summary
        log.info("profile of steps %d-%d written to %s in %.1f s: %s", self.first, self.last, self.folder,
                 time.perf_counter() - t0, headline(self.summary))
        return self.summary

    def _write_trace(self, prof) -> None:
        """``trace.json.gz``, written whole or not at all."""
        with tempfile.TemporaryDirectory(dir=self.folder) as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with atomic_path(self.folder / "trace.json.gz") as dest:
                with open(raw, "rb") as src, gzip.open(dest, "wb", compresslevel=6) as dst:
                    shutil.copyfileobj(src, dst)


def _short(filename: str) -> str:
    """``.../draftsmith/train/trainer.py`` -> ``draftsmith/train/trainer.py`` (the same for torch's files)."""
    parts = Path(filename).parts
    for root in ("draftsmith", "torch", "transformers"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return Path(filename).name


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def summarize(events, marks: list[tuple[int, str]], *, cuda: bool) -> dict[str, Any]:
    """The profile's figures from ``torch.profiler``'s events and the phase markers (:class:`StepProfiler`).

    Each kernel is placed in the phase in which it was launched: its CUDA runtime call (same correlation id) when
    the profile has one, else its own start. Times in ms; ``per_step`` entries are medians over the steps.

    Returns:
        ``{"steps", "per_step": {"wall_ms", "kernel_ms", "gpu_busy_ms", "kernels"}, "phases": {phase: {"kernels",
        "kernel_ms", "host_op_ms", "top"}}, "top_kernels": [...], "top_host_ops": [...], "kernels_by_launch"}``;
        a phase's ``top``: its kernels with the most GPU time (on a GPU), else its operators with the most host
        self time.
    """
    from torch.autograd import DeviceType

    mark_at: list[float] = []
    mark_of: list[tuple[int, str]] = []
    kernels, host_ops = [], []
    runtime_start: dict[int, float] = {}
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name.startswith(MARK_PREFIX):
                k = int(e.name[len(MARK_PREFIX):])
                if k < len(marks):
                    mark_at.append(e.time_range.start)
                    mark_of.append(marks[k])
                continue
            if e.is_user_annotation:
                continue
            if e.name.startswith(("cuda", "cu")) and e.id:  # a runtime call: kernels share its correlation id
                runtime_start.setdefault(e.id, e.time_range.start)
            host_ops.append(e)
        elif e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            kernels.append(e)
    order = sorted(range(len(mark_at)), key=mark_at.__getitem__)
    mark_at = [mark_at[i] for i in order]
    mark_of = [mark_of[i] for i in order]
    steps = sorted({s for s, ph in mark_of if ph != "start"})  # the closing marker starts no profiled step

    def phase_at(t_us: float) -> tuple[int, str] | None:
        """(step, phase) of a time: the phase whose end marker is the first at or after it (``between``: after
        a step's last phase, before the next step's start); None outside the profiled steps."""
        i = bisect.bisect_left(mark_at, t_us)
        if i == 0 or i >= len(mark_at):
            return None
        step, phase = mark_of[i]
        return (mark_of[i - 1][0], "between") if phase == "start" else (step, phase)

    step_wall = {}
    for s in steps:
        times = [t for t, (st, _) in zip(mark_at, mark_of) if st == s]
        nxt = [t for t, (st, ph) in zip(mark_at, mark_of) if st == s + 1 and ph == "start"]
        step_wall[s] = ((nxt[0] if nxt else times[-1]) - times[0]) / 1e3
    phases: dict[str, dict[str, float]] = {}
    per_step: dict[int, dict[str, Any]] = {s: {"kernel_ms": 0.0, "kernels": 0, "spans": []} for s in steps}
    by_launch = 0
    top_k: dict[str, list[float]] = {}
    in_phase: dict[str, dict[str, list[float]]] = {}  # phase -> kernel (GPU) or operator (CPU) -> [count, ms]
    for k in kernels:
        t = runtime_start.get(k.id)
        by_launch += t is not None
        where = phase_at(t if t is not None else k.time_range.start)
        if where is None:
            continue
        step, phase = where
        ms = (k.time_range.end - k.time_range.start) / 1e3
        p = phases.setdefault(phase, {"kernels": 0, "kernel_ms": 0.0, "host_op_ms": 0.0})
        p["kernels"] += 1
        p["kernel_ms"] += ms
        rec = per_step[step]
        rec["kernel_ms"] += ms
        rec["kernels"] += 1
        rec["spans"].append((k.time_range.start, k.time_range.end))
        for top in (top_k.setdefault(k.name, [0, 0.0]), in_phase.setdefault(phase, {}).setdefault(k.name, [0, 0.0])):
            top[0] += 1
            top[1] += ms
    top_h: dict[str, list[float]] = {}
    for e in host_ops:
        where = phase_at(e.time_range.start)
        if where is None:
            continue
        ms = e.self_cpu_time_total / 1e3
        phases.setdefault(where[1], {"kernels": 0, "kernel_ms": 0.0, "host_op_ms": 0.0})["host_op_ms"] += ms
        tops = [top_h.setdefault(e.name, [0, 0.0])]
        if not cuda:
            tops.append(in_phase.setdefault(where[1], {}).setdefault(e.name, [0, 0.0]))
        for top in tops:
            top[0] += 1
            top[1] += ms
    n = max(1, len(steps))

    def ranked(table: dict[str, list[float]], count: int) -> list[dict[str, Any]]:
        return [{"name": name, "count": round(c / n, 1), "ms": round(ms / n, 3)}
                for name, (c, ms) in sorted(table.items(), key=lambda kv: -kv[1][1])[:count]]

    med = (lambda xs: round(statistics.median(xs), 3) if xs else None)  # noqa: E731
    return {
        "steps": steps, "cuda": bool(cuda),
        "per_step": {"wall_ms": med([step_wall[s] for s in steps]),
                     "kernel_ms": med([per_step[s]["kernel_ms"] for s in steps]) if cuda else None,
                     "gpu_busy_ms": med([_union_ms(per_step[s]["spans"]) for s in steps]) if cuda else None,
                     "kernels": med([per_step[s]["kernels"] for s in steps]) if cuda else None},
        "phases": {ph: {"kernels": round(v["kernels"] / n, 1), "kernel_ms": round(v["kernel_ms"] / n, 3),
                        "host_op_ms": round(v["host_op_ms"] / n, 3), "top": ranked(in_phase.get(ph, {}), PHASE_TOP)}
                   for ph, v in phases.items()},
        "top_kernels": ranked(top_k, TOP),
        "top_host_ops": ranked(top_h, TOP),
        "kernels_by_launch": f"{by_launch} of {len(kernels)}",
    }


def headline(summary: dict[str, Any]) -> str:
    """One line: a step's wall time, the GPU's busy and kernel time, kernels and synchronising calls."""
    s = summary.get("per_step") or {}
    if s.get("gpu_busy_ms") is None:
        return f"a step {s['wall_ms']:.1f} ms on the host" if s.get('wall_ms') is not None else "no step"
    syncs = sum((summary.get("syncs") or {}).values())
    return (f"a step {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms ({s['kernel_ms']:.1f} ms of "
            f"kernels, {s['kernels']:.0f} kernels); {syncs} synchronising calls in "
            f"{len(summary.get('steps') or [])} steps")


def describe(summary: dict[str, Any]) -> str:
    """``summary.txt``: :func:`headline`, then the phases, top kernels, top host operators and synchronising calls
    (ms a step)."""
    cuda = summary.get("cuda")
    lines = [f"steps {summary['steps']}: {headline(summary)}", "",
             "phase       kernels   kernel ms   host op ms   (kernels by their launch; host: operators' self time)"
             if cuda else "phase      host op ms   (operators' self time)"]
    for ph, v in summary["phases"].items():
        lines.append(f"{ph:10s} {v['kernels']:8.1f} {v['kernel_ms']:11.3f} {v['host_op_ms']:12.3f}" if cuda
                     else f"{ph:10s} {v['host_op_ms']:11.3f}")
    for title, key in (("kernels with the most GPU time (a step)", "top_kernels"),
                       ("operators with the most host self time (a step)", "top_host_ops")):
        if summary.get(key):
            lines += ["", f"{title}:"] + [f"  {r['ms']:9.3f} ms  x{r['count']:<6g} {r['name'][:150]}"
                                          for r in summary[key]]
    lines += ["", "by phase, its kernels with the most GPU time (a step):" if cuda else
              "by phase, its operators with the most host self time (a step):"]
    for ph, v in summary["phases"].items():
        if v.get("top"):
            lines.append(f"  {ph}:")
            lines += [f"    {r['ms']:9.3f} ms  x{r['count']:<6g} {r['name'][:140]}" for r in v["top"]]
    if summary.get("syncs"):
        lines += ["", "synchronising CUDA calls (all profiled steps), by the draftsmith line that made them:"]
        lines += [f"  {n:5d}  {where}" for where, n in summary["syncs"].items()]
    if cuda:
        lines.append(f"\nkernels placed by their launch: {summary.get('kernels_by_launch')}")
    return "\n".join(lines) + "\n"
