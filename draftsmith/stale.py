"""Never a stale drafter: outputs made from a stage's previous outputs go when the stage runs again.

Snakemake remakes a job's consumers when the job runs, but remakes a job whose outputs are missing only when one of
its consumers must run (a missing intermediate is not remade: snakemake issues #1978, #2011), and it records a failed
job's params as if it had finished (snakemake PR #3237). So a rerun of ``train`` (a changed ``train.lr``) that is
interrupted leaves ``trained/`` missing (Snakemake removes a job's outputs before it runs it), ``train``'s recorded
params equal to the new ones, and ``final/`` and the evaluation report of the previous configuration in place: the
next ``snakemake`` reports "Nothing to be done" over the old drafter. The same holds for every stage and what follows
it (an interrupted tokenize under the old features, an interrupted extraction shard under the old index).

Two guards, both reading Snakemake's own records of the jobs that wrote each output (``.snakemake/metadata/``: the
rule and its input files; ``.snakemake/incomplete/``: jobs started and not finished):

* :func:`invalidate_consumers`: every stage's script calls it first. The declared outputs made, directly or through
  other outputs, from the outputs this job is about to replace are removed (each named in the log), as Snakemake
  itself would remove them before remaking them later in the same run. A job interrupted after that leaves them
  missing, and the next run remakes the whole chain: an interrupted ``train`` resumes from its checkpoint, then
  ``export`` and ``evaluate`` run again.
* :func:`check_no_stale_outputs`: when the workflow is planned. An output made from a file whose job was started
  after it and did not finish (a job killed before its script began, or a run made before this guard existed) stops
  Snakemake, naming the outputs to remove.

Only declared outputs are removed (never resumable state: feature chunks, checkpoints, regenerate parts, evaluate's
partial results), only relative paths inside the working directory, and never through an edge that orders two jobs
without one reading the other's content (:data:`ORDER_ONLY_INPUTS`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import shutil
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from draftsmith.io import FolderLockedError, folder_lock_holder

#: Snakemake's folder of records, relative to the working directory.
PERSISTENCE_DIR = ".snakemake"
#: The folder training writes while it runs, under its writer lock (draftsmith.train; :func:`check_no_live_writer`).
CHECKPOINTS = "results/drafter/checkpoints"

#: rule -> input path prefixes it reads for ordering only: regenerate waits for the disk check before regeneration
#: (an ``ancient()`` input); a stream-mode slice waits for the marker of phase p - ``stream.slices_on_disk`` (its disk
#: token). A rerun of disk_plan or of that phase does not change what these jobs write.
ORDER_ONLY_INPUTS: Mapping[str, tuple[str, ...]] = {
    "regenerate_shard": ("results/stream/disk-plan.json",),
    "extract_slice": ("results/drafter/phases/",),
}


class StaleOutputsError(RuntimeError):
    """Outputs made from files whose jobs were started again after them and did not finish (the message names the
    outputs, the job and when it started, and the command that removes them)."""


@dataclass(frozen=True)
class Record:
    """Snakemake's record of the job that last wrote (or tried to write) one output file.

    Attributes:
        path: the output, as its rule names it (relative to the working directory, normalised).
        rule: the rule of that job ("?" when only an incomplete marker is left).
        inputs: the job's input files, normalised.
        started: when that job started, seconds since the epoch (the later of the record's start time and the
            incomplete marker's, when a job was started again and never finished).
    """

    path: str
    rule: str
    inputs: tuple[str, ...]
    started: float


def _decode(relative: Path) -> str | None:
    """The key (output path) of a record file: Snakemake's FilePersistence names it by the url-safe base64 of the
    path, split into folders of at most NAME_MAX - 1 characters, every folder but the last prefixed by "@"."""
    parts = [p[1:] if p.startswith("@") else p for p in relative.parts]
    try:
        return base64.urlsafe_b64decode("".join(parts).encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _record_files(folder: Path) -> Iterable[tuple[str, Path]]:
    if not folder.is_dir():
        return
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            key = _decode(path.relative_to(folder))
            if key is not None:
                yield key, path


def read_records(root: str | os.PathLike = PERSISTENCE_DIR) -> dict[str, Record]:
    """Snakemake's records of the outputs of this working directory, by normalised output path: ``{}`` when there are
    none (a fresh project, or another persistence backend than Snakemake's default, the file one). A record that
    cannot be read is left out."""
    root = Path(root)
    records: dict[str, Record] = {}
    for key, path in _record_files(root / "metadata"):
        try:
            data = json.loads(path.read_text())
            started = float(data.get("starttime") or 0.0)
            inputs = tuple(os.path.normpath(str(i)) for i in data.get("input") or ())
        except (OSError, ValueError, TypeError):
            continue
        key = os.path.normpath(key)
        records[key] = Record(key, str(data.get("rule") or "?"), inputs, started)
    for key, path in _record_files(root / "incomplete"):  # started, not finished: killed with Snakemake itself
        key = os.path.normpath(key)
        try:
            started = path.stat().st_mtime
        except OSError:
            continue
        old = records.get(key)
        if old is None:
            records[key] = Record(key, "?", (), started)
        elif started > old.started:
            records[key] = Record(key, old.rule, old.inputs, started)
    return records


def consumers(records: Mapping[str, Record]) -> dict[str, list[str]]:
    """``{file: the outputs whose job read it}``, without the :data:`ORDER_ONLY_INPUTS` edges."""
    out: dict[str, list[str]] = {}
    for record in records.values():
        skip = ORDER_ONLY_INPUTS.get(record.rule, ())
        for path in record.inputs:
            if not (skip and path.startswith(skip)):
                out.setdefault(path, []).append(record.path)
    return out


def _inside(path: str) -> bool:
    """A relative path that stays inside the working directory (the only kind this module ever removes)."""
    return not os.path.isabs(path) and path != ".." and not path.startswith(".." + os.sep)


def made_from(paths: Iterable[str], graph: Mapping[str, list[str]]) -> list[str]:
    """The outputs made from ``paths``, directly or through other outputs (breadth first; ``paths`` themselves
    excluded), whether they exist or not. Deterministic: ``paths`` and each file's consumers are visited in sorted
    order, whatever the process's string hash seed."""
    start = sorted({os.path.normpath(str(p)) for p in paths})
    seen, order, queue = set(start), [], deque(start)
    while queue:
        for nxt in sorted(graph.get(queue.popleft(), ())):
            if nxt not in seen:
                seen.add(nxt)
                order.append(nxt)
                queue.append(nxt)
    return order


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def invalidate_consumers(outputs: Iterable[str], log: logging.Logger | None = None, *,
                         root: str | os.PathLike = PERSISTENCE_DIR) -> list[str]:
    """Remove the outputs made from ``outputs`` (this job's declared outputs, which it is about to replace), directly
    or transitively, per Snakemake's records; each removal is logged as a warning. Called first by every stage's
    script (``invalidate_consumers(snakemake.output, log)``), before anything that can take long or fail.

    Only existing, relative paths inside the working directory are removed; a path that cannot be removed is
    logged and left (the check at planning names it later).

    Returns:
        The paths removed, in the order of the chain (nearest consumers first).
    """
    log = log or logging.getLogger("draftsmith")
    outputs = [str(o) for o in outputs]
    removed = []
    for path in made_from(outputs, consumers(read_records(root))):
        if not _inside(path) or not os.path.lexists(path):
            continue
        try:
            _remove(path)
        except OSError as exc:
            log.warning("could not remove %s, made from the outputs this job replaces: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.warning("removed %d output(s) made from the previous %s (Snakemake remakes them after this job; if it "
                    "is interrupted, the next run does): %s", len(removed), ", ".join(sorted(outputs)),
                    ", ".join(removed))
    return removed


@dataclass(frozen=True)
class Stale:
    """An output made before the job that writes one of its inputs was started again without finishing."""

    output: str
    source: str  # the missing input it was made from
    rule: str  # the rule that writes the source
    started: float  # when that rule's job was started again


def stale_outputs(root: str | os.PathLike = PERSISTENCE_DIR,
                  records: Mapping[str, Record] | None = None) -> list[Stale]:
    """Existing outputs made from a missing file whose job was started after they were written and did not finish
    (or was killed with Snakemake), and everything made from them: Snakemake would not remake them. Empty for a
    project that never ran or has no such file. Outputs of another working directory (absolute paths) are left out.
    ``records``: :func:`read_records` of ``root``, when the caller has them.
    """
    records = read_records(root) if records is None else records
    graph = consumers(records)
    found: dict[str, Stale] = {}
    for source, record in records.items():
        if os.path.lexists(source):
            continue
        for output in graph.get(source, ()):
            try:
                made = os.lstat(output).st_mtime
            except OSError:
                continue
            if made < record.started and _inside(output):
                for path in [output, *made_from([output], graph)]:
                    if path not in found and _inside(path) and os.path.lexists(path):
                        found[path] = Stale(path, source, record.rule, record.started)
    return list(found.values())


def check_no_stale_outputs(root: str | os.PathLike = PERSISTENCE_DIR) -> None:
    """Stop planning when :func:`stale_outputs` finds any (the workflow calls it when it is parsed).

    Raises:
        StaleOutputsError: naming each stale output, the file it was made from, the rule started again and when,
            and the ``rm`` command after which Snakemake reruns that rule and what follows it.
    """
    records = read_records(root)
    stale = stale_outputs(root, records)
    if not stale:
        return
    lines, by_rule = [], {}
    for s in stale:  # per rule: the missing outputs of its jobs (all, not only those a stale output read)
        sources, outputs, started = by_rule.get(s.rule, (set(), [], 0.0))
        sources |= {r.path for r in records.values() if r.rule == s.rule and not os.path.lexists(r.path)}
        by_rule[s.rule] = (sources | {s.source}, outputs + [s.output], max(started, s.started))
    for rule, (sources, outputs, started) in by_rule.items():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        lines.append(f"  rule {rule} was started again at {when} and did not finish: {', '.join(sorted(sources))} "
                     f"{'is' if len(sources) == 1 else 'are'} missing, and these outputs made from them are the "
                     f"previous run's: {', '.join(sorted(outputs))}")
    raise StaleOutputsError(
        "stale outputs: Snakemake does not remake a missing file whose consumers exist, so it would keep results "
        "made before the last (interrupted or failed) run of the rule that writes their inputs:\n" + "\n".join(lines)
        + "\nRemove them, then run snakemake again: it reruns those rules and what follows them (an interrupted "
        "training resumes from its checkpoint):\n  rm -r "
        + " ".join(shlex.quote(p) for p in sorted({s.output for s in stale})))


def check_no_live_writer(folder: str | os.PathLike = CHECKPOINTS) -> None:
    """Stop a run (not a dry run: the workflow calls it when it is parsed) while a live training process writes
    ``folder``: Snakemake would remove the outputs of any train job it runs before that job found the folder locked,
    the other run's finished ``trained/`` included. (Two Snakemake runs of one project already exclude each other
    unless ``--nolock``; this covers that and a ``python -m draftsmith.train`` started by hand.)

    Raises:
        FolderLockedError: naming the folder, the holder's pid and host, and what to do.
    """
    holder = folder_lock_holder(folder)
    if holder is not None:
        raise FolderLockedError(
            f"{folder} is written by a running training: pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} (since {holder.get('started_utc', '?')}). A run now would remove outputs it "
            "writes; wait for it or end it (snakemake -n still shows the plan)")
