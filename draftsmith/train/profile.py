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
  the most GPU time and the 25 operators with the most host self time; and, on a GPU, the **synchronising CUDA
  calls** torch's sync debug mode flags over the window (``torch.cuda.set_sync_debug_mode("warn")``: ``.item()``,
  ``nonzero`` and boolean indexing, blocking copies to the host; not an explicit ``torch.cuda.synchronize()`` or
  event wait), each counted with the phase it came after and the draftsmith source line that led to it.

The profile changes nothing that is trained (the same weights with and without it); it slows the profiled steps,
which ``train.time_phases`` then leaves out of its medians. Rank 0 only; each process of a run (a resumed one, each
phase of a sliced one) replaces the profile of the one before. Reference: PyTorch's profiler recipe (https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html).
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import logging
import shutil
import statistics
import sys
import tempfile
import threading
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

    The profiler starts one step early when the run has one (``warm``: the profiler's own start-up, CUPTI's, lands
    there; the step is in the trace, not in the summary). Nothing here raises into training: a profiler that fails
    to start or to write is logged and the run goes on, with torch's sync debug mode and the warnings hook undone.

    Args:
        device: the training device (CUDA: kernels, and the synchronising calls).
        out_dir: the run's folder; the profile goes to ``out_dir / "profile"`` (an earlier one there is removed).
        window: ``(first, last)`` step numbers (:func:`profile_window`).
        warm: the step before ``first`` when this process runs it, else None.
    """

    def __init__(self, device: torch.device, out_dir: Path, window: tuple[int, int], warm: int | None = None):
        self.cuda = device.type == "cuda"
        self.folder = Path(out_dir) / "profile"
        self.first, self.last = window
        self.warm = warm
        self.stack: contextlib.ExitStack | None = None
        self.prof = None
        self.failed = False
        self.steps: list[int] = []
        self.marks: list[tuple[int, str]] = []  # (step, phase) in the order the markers were recorded
        self.syncs: dict[str, int] = {}  # "<phase> | <source line>" -> count
        self.summary: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.prof is not None

    @property
    def steps_slowed(self) -> range:
        """The steps the profile slows (the warm-up step, the profiled ones, and the next, which writes it): left
        out of :class:`StepTimes`' medians."""
        return range(self.warm if self.warm is not None else self.first, self.last + 2)

    def start(self, step: int) -> bool:
        """Step ``step`` begins: the window opens at ``warm`` (else ``first``), closes after ``last`` (the profile
        is written then). Returns True when this call wrote the profile (the caller's rates should skip the time)."""
        wrote = False
        if self.active and step > self.last:
            self._marker("start", step)  # the last profiled step's end
            self.close()
            wrote = True
        opens_at = self.warm if self.warm is not None else self.first
        if self.summary is None and not self.active and not self.failed and step == opens_at:
            self._open()
        if self.active:
            self.steps.append(step)
            self._marker("start", step)
        return wrote

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
        try:
            shutil.rmtree(self.folder, ignore_errors=True)  # an earlier process's profile (stream phase, resume)
            if self.cuda:
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}.*")
                shown = warnings.showwarning

                def show(message, category, filename, lineno, file=None, line=None):
                    if SYNC_MESSAGE not in str(message):
                        shown(message, category, filename, lineno, file, line)
                        return
                    try:
                        self._sync_seen()
                    except Exception:  # a diagnostic must not fail the operation that synchronised
                        self.syncs["<not attributed>"] = self.syncs.get("<not attributed>", 0) + 1

                warnings.showwarning = show
                previous = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
                stack.callback(torch.cuda.set_sync_debug_mode, previous)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = stack.enter_context(profile(activities=activities, record_shapes=False, with_stack=False))
        except Exception as exc:
            self.prof, self.failed = None, True
            with contextlib.suppress(Exception):
                stack.close()
            log.warning("train.profile_steps: the profiler did not start (%r); training goes on without it", exc)
            return
        self.stack = stack
        log.info("profiling steps %d-%d (train.profile_steps; warm-up step %s) into %s", self.first, self.last,
                 self.warm, self.folder)

    def _sync_seen(self) -> None:
        """Count a synchronising call by the phase in progress and its draftsmith source line: the innermost frame
        under the draftsmith package, else (a thread without one, e.g. the autograd engine's) the main thread's,
        else the innermost Python line."""
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in Path(f.filename).name]
        where = _our_frame(frames)
        if where is None and threading.current_thread() is not threading.main_thread():
            main = sys._current_frames().get(threading.main_thread().ident)
            where = _our_frame(traceback.extract_stack(main)) if main is not None else None
        if where is None and frames:
            where = frames[-1]
        line = f"{_short(where.filename)}:{where.lineno} {where.line or ''}".strip() if where else "<unknown>"
        after = f"after {self.marks[-1][1]}" if self.marks else "before the first step"
        key = f"{after} | {line}"
        self.syncs[key] = self.syncs.get(key, 0) + 1

    def close(self) -> dict[str, Any] | None:
        """End the window (if open), write the trace and the summary; returns the summary (None if nothing was
        profiled). Failures are logged, not raised: the profile must not stop a training run."""
        if not self.active:
            return self.summary
        stack, prof, self.stack, self.prof = self.stack, self.prof, None, None
        try:
            stack.close()
        except Exception as exc:
            log.warning("train.profile_steps: the profiler of steps %d-%d did not stop cleanly (%r)", self.first,
                        self.last, exc)
            self.summary = {"error": repr(exc)}
            return self.summary
        t0 = time.perf_counter()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._write_trace(prof)
        except Exception as exc:
            log.warning("train.profile_steps: the trace of steps %d-%d could not be written: %r", self.first,
                        self.last, exc)
        try:
            self.summary = summarize(prof.events(), self.marks, cuda=self.cuda, leave_out=(self.warm,))
            self.summary["syncs"] = dict(sorted(self.syncs.items(), key=lambda kv: -kv[1]))
            write_json(self.folder / "summary.json", self.summary)
            write_text(self.folder / "summary.txt", describe(self.summary))
        except Exception as exc:
            log.warning("train.profile_steps: the summary of steps %d-%d could not be made: %r", self.first,
                        self.last, exc)
            self.summary = {"error": repr(exc)}
            return self.summary
        if self.cuda and not self.summary["per_step"]["kernels"]:
            log.warning("train.profile_steps: no GPU kernel in the trace of steps %d-%d (CUPTI recorded nothing: "
                        "another profiler attached?)", self.first, self.last)
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


PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # .../draftsmith


def _our_frame(frames) -> traceback.FrameSummary | None:
    """The innermost frame in the draftsmith package (this module aside)."""
    for f in reversed(frames):
        path = str(Path(f.filename).resolve()) if f.filename and not f.filename.startswith("<") else ""
        if path.startswith(PACKAGE_DIR + "/") and not path.endswith("train/profile.py"):
            return f
    return None


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


def _is_copy(event) -> bool:
    """A GPU memcpy / memset rather than a kernel (torch's ``activity_type``, else the name)."""
    kind = getattr(event, "activity_type", None)
    if isinstance(kind, str) and kind:
        return kind != "kernel"
    return event.name.startswith(("Memcpy", "Memset"))


def summarize(events, marks: list[tuple[int, str]], *, cuda: bool, leave_out=()) -> dict[str, Any]:
    """The profile's figures from ``torch.profiler``'s events and the phase markers (:class:`StepProfiler`).

    Each GPU kernel is placed in the phase in which it was launched: its CUDA runtime or driver call (the same
    correlation id) when the profile has one, else its own start. Copies and memsets (``Memcpy``, ``Memset``) are
    counted apart from kernels (the copy engines overlap the kernels); ``nccl`` kernels are kernels (they occupy
    the GPU's SMs). Host time: operators' self time on the thread that recorded the markers (the training loop)
    and on the autograd engine's threads (the backward), not the loader's. Times in ms; ``per_step`` entries are
    medians over the steps, ``phases`` and the top lists means per step. Steps in ``leave_out`` (the profiler's
    warm-up step) are not summarised.

    Returns:
        ``{"steps", "cuda", "per_step": {"wall_ms", "kernel_ms", "gpu_busy_ms", "kernels", "copy_ms"}, "phases":
        {phase: {"kernels", "kernel_ms", "host_op_ms", "top"}}, "top_kernels": [...], "top_host_ops": [...],
        "kernels_by_launch"}``; a phase's ``top``: its kernels with the most GPU time (on a GPU), else its operators
        with the most host self time; phases in the trainer's order.
    """
    from torch.autograd import DeviceType

    found: dict[int, float] = {}  # marker index -> time
    kernels, copies, host_ops = [], [], []
    runtime_start: dict[int, float] = {}
    loop_threads, autograd_threads = set(), set()
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name.startswith(MARK_PREFIX):
                k = int(e.name[len(MARK_PREFIX):])
                if k < len(marks):
                    found[k] = e.time_range.start
                    loop_threads.add(e.thread)
                continue
            if e.is_user_annotation:
                continue
            if e.name.startswith("autograd::engine"):
                autograd_threads.add(e.thread)
            if e.name.startswith("cu") and e.id:  # a runtime / driver call: its kernel shares the correlation id
                runtime_start.setdefault(e.id, e.time_range.start)
            host_ops.append(e)
        elif e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            (copies if _is_copy(e) else kernels).append(e)
    order = sorted(found)  # the markers, in the order the loop recorded them
    mark_at = [found[k] for k in order]
    mark_of = [marks[k] for k in order]
    skip = {s for s in leave_out if s is not None}
    steps = sorted({st for st, ph in mark_of if ph != "start"} - skip)  # the closing marker starts no step
    phase_order = list(dict.fromkeys(ph for _, ph in mark_of if ph != "start")) + ["between"]

    def phase_at(t_us: float) -> tuple[int, str] | None:
        """(step, phase) of a time: the phase whose end marker is the first at or after it (``between``: after
        a step's last phase, before the next step's start); None outside the summarised steps."""
        i = bisect.bisect_left(mark_at, t_us)
        if i == 0 or i >= len(mark_at):
            return None
        step, phase = mark_of[i]
        where = (mark_of[i - 1][0], "between") if phase == "start" else (step, phase)
        return None if where[0] in skip else where

    step_wall = {}
    for st in steps:
        times = [t for t, (s_, _) in zip(mark_at, mark_of) if s_ == st]
        nxt = [t for t, (s_, ph) in zip(mark_at, mark_of) if s_ == st + 1 and ph == "start"]
        step_wall[st] = ((nxt[0] if nxt else times[-1]) - times[0]) / 1e3
    phases: dict[str, dict[str, float]] = {}
    per_step: dict[int, dict[str, Any]] = {st: {"kernel_ms": 0.0, "kernels": 0, "spans": [], "copy_ms": 0.0}
                                           for st in steps}
    by_launch = 0
    top_k: dict[str, list[float]] = {}
    in_phase: dict[str, dict[str, list[float]]] = {}  # phase -> kernel (GPU) or operator (CPU) -> [count, ms]

    def new_phase() -> dict[str, float]:
        return {"kernels": 0, "kernel_ms": 0.0, "host_op_ms": 0.0}

    for k, is_copy in [(k, False) for k in kernels] + [(c, True) for c in copies]:
        t = runtime_start.get(k.id)
        by_launch += t is not None and not is_copy
        where = phase_at(t if t is not None else k.time_range.start)
        if where is None:
            continue
        step, phase = where
        ms = (k.time_range.end - k.time_range.start) / 1e3
        if is_copy:
            per_step[step]["copy_ms"] += ms
            continue
        ph = phases.setdefault(phase, new_phase())
        ph["kernels"] += 1
        ph["kernel_ms"] += ms
        rec = per_step[step]
        rec["kernel_ms"] += ms
        rec["kernels"] += 1
        rec["spans"].append((k.time_range.start, k.time_range.end))
        for top in (top_k.setdefault(k.name, [0, 0.0]), in_phase.setdefault(phase, {}).setdefault(k.name, [0, 0.0])):
            top[0] += 1
            top[1] += ms
    top_h: dict[str, list[float]] = {}
    for e in host_ops:
        if e.thread not in loop_threads and e.thread not in autograd_threads:
            continue
        where = phase_at(e.time_range.start)
        if where is None:
            continue
        ms = e.self_cpu_time_total / 1e3
        phases.setdefault(where[1], new_phase())["host_op_ms"] += ms
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

    def med(xs):
        return round(statistics.median(xs), 3) if xs else None

    return {
        "steps": steps, "cuda": bool(cuda),
        "per_step": {"wall_ms": med([step_wall[st] for st in steps]),
                     "kernel_ms": med([per_step[st]["kernel_ms"] for st in steps]) if cuda else None,
                     "gpu_busy_ms": med([_union_ms(per_step[st]["spans"]) for st in steps]) if cuda else None,
                     "kernels": med([per_step[st]["kernels"] for st in steps]) if cuda else None,
                     "copy_ms": med([per_step[st]["copy_ms"] for st in steps]) if cuda else None},
        "phases": {ph: {"kernels": round(v["kernels"] / n, 1), "kernel_ms": round(v["kernel_ms"] / n, 3),
                        "host_op_ms": round(v["host_op_ms"] / n, 3), "top": ranked(in_phase.get(ph, {}), PHASE_TOP)}
                   for ph, v in sorted(phases.items(), key=lambda kv: phase_order.index(kv[0])
                                       if kv[0] in phase_order else len(phase_order))},
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
