"""Stream mode (``docs/stream.md``): one phase of the global plan, :func:`train_phase`, and the run's end,
:func:`train_final`.

A phase trains optimizer steps ``[first_step, end_step)`` of the :class:`~draftsmith.batch_plan.StreamPlan` on the
features of its slice, with :class:`~draftsmith.train.trainer.Trainer`'s loop: the plan, the learning rate, the
anchors and the checkpoints are the whole run's, so the phases one after the other train what one run over all the
features would. Every phase of a run shares one run fingerprint, so one checkpoint folder: phase p starts from the
checkpoint phase p - 1 ended with (or, killed, from its own newest one), ends with a checkpoint at ``end_step``
and writes its marker (:data:`PHASE_FORMAT`, the rule's output). The end of the run loads the last checkpoint,
computes the final held-out metrics and writes ``trained/`` as offline training does.

Checkpoints of a phase record where they come from (``state.json`` ``"phase"``: the phase, its steps, the sha256 of
the ``state.json`` it started from and the digest of its slice's chunk files), so a rerun of a phase never resumes
from checkpoints a previous run of it left that descend from another start or were trained on other features. A
finished phase records its marker (:func:`~draftsmith.train.checkpoint.mark_finished`); when Snakemake reruns it (the
marker is gone: ``--forcerun``) it trains again from its first step, while a killed phase (no record) resumes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.batch_plan import Phase, StreamPlan
from draftsmith.drafter_config import drafter_config_dict
from draftsmith.features import FeatureIndex, index_content_sha256
from draftsmith.io import read_json, write_json
from draftsmith.train.checkpoint import (
    checkpoint_steps,
    mark_finished,
    restore,
    run_fingerprint,
    state_sha256,
    verify_checkpoint,
)
from draftsmith.train.distributed import barrier, setup_device
from draftsmith.train.metrics import peak_memory_gib
from draftsmith.train.plan import FEATURE_FIELDS, FeatureMeta, TrainData, plan_stream_data
from draftsmith.train.settings import StreamOptions, TrainPhaseSettings, TrainSettings
from draftsmith.train.trainer import Trainer

log = logging.getLogger("draftsmith.train")

PHASE_FORMAT = "draftsmith.train_phase/1"


def train_phase(phase: int, index_path: str | os.PathLike, heldout_path: str | os.PathLike | None,
                tokenized_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                settings: TrainPhaseSettings, *, marker_path: str | os.PathLike | None = None,
                previous: str | os.PathLike | None = None, expected: Mapping[str, Any] | None = None,
                threads: int | None = None, stop_after_steps: int | None = None) -> dict[str, Any]:
    """Train phase ``phase`` of a stream-mode run: steps ``[first_step, end_step)`` of the global plan.

    Resumes from the newest checkpoint of this phase in ``[first_step, end_step]`` trained on this slice's content
    (a killed phase; at ``end_step`` nothing is left to train) or else the checkpoint at ``first_step`` (the previous
    phase's end; none for phase 0's step 0). Before training it verifies the chunk sha256 of the slice (every chunk
    from ``first_step``, the chunks changed since this run verified them on a resume) and of the held-out features
    (those this run has not verified: :meth:`~draftsmith.train.trainer.Trainer.verify_features`); a finished phase
    whose marker is gone (Snakemake reruns it) verifies its slice, then removes its checkpoints after ``first_step``
    and trains again; checkpoints at
    ``end_step``; keeps the checkpoints at the first steps of this and the previous phase out
    of ``train.keep_checkpoints``' pruning (a rerun of this phase starts from the first); writes the marker.

    Args:
        phase: p, the phase number (0-based).
        index_path: the slice's ``index.json`` (merge's index over the slice's shards; holds the phase's samples).
        heldout_path: the held-out features (``extract_heldout``'s folder or its ``index.json``); None or a folder
            without an index when no held-out samples are kept (``stream.heldout_samples`` 0, an empty split).
        tokenized_path: the tokenized train parquet (its ``num_tokens`` decide the plan).
        target_dir: the target's HF folder. out_dir: ``results/drafter`` (checkpoints, tensorboard, phases).
        settings: the ``train``, ``drafter`` and ``stream`` keys (:class:`TrainPhaseSettings`).
        marker_path: where the marker goes (default ``<out_dir>/phases/phase-{p}.json``).
        previous: phase p - 1's marker, checked against this phase (fingerprint, steps, its checkpoint).
        expected: phase p's record of the stream plan (``{"first_step", "end_step", "samples"}``, any of them),
            checked against the plan recomputed here.
        threads: CPU threads for all processes together.
        stop_after_steps: stop (after checkpointing) once this many steps of the run are done, without a marker.

    Returns:
        The marker (also written, atomically), or ``{"stopped_at", "end_step"}`` when ``stop_after_steps``
        stopped the phase early.

    Raises:
        ValueError: the world size is not ``train.gpus``' (the plan is cut for it); the phase does not exist or
            differs from ``expected``; the slice or held-out index lacks a sample the phase reads (or its length
            differs from the tokenized row's); a slice chunk without a sha256 or whose file does not match it; the
            previous marker is of another run fingerprint or ends elsewhere; no checkpoint at ``first_step`` (or not
            the one the previous marker names); the plan is impossible.
    """
    t_start = time.time()
    cfg = settings.train
    device, ranks = setup_device(threads)
    world = max(1, int(cfg.gpus))
    if ranks.world != world:
        raise ValueError(f"phase {phase} runs on {ranks.world} process(es), but the global plan is cut for "
                         f"train.gpus = {cfg.gpus} ({world} process(es)): run it with as many processes")

    # -- data: the global plan from the tokenized rows, this phase's slice of the features, the held-out features
    index = FeatureIndex(index_path)
    features = FeatureMeta.of(index)
    data = plan_stream_data(tokenized_path, cfg, settings.stream, world, features=features, index=index,
                            heldout_index=open_heldout(heldout_path, features))
    current = select_phase(data.plan, phase, expected)
    check_samples(index, current.samples, data.lengths, f"phase {phase}'s slice")
    check_heldout(data, heldout_path)
    prev = read_marker(previous) if previous is not None and phase > 0 else None

    # -- model, then the checkpoint this phase starts from
    run = Trainer(data, target_dir, out_dir, settings, device, ranks)
    fingerprint = run_fingerprint(drafter_config_dict(run.config), cfg, data.features.meta, world,
                                  data.plan_identity, start=run.start_digest)
    run.use_checkpoints(fingerprint)
    content = index_content_sha256(index.meta, index.path)
    # the slice is verified before a finished phase that is rerun loses its checkpoints; a fresh phase hashes every
    # chunk of its slice, a resumed one those changed since this run verified them, and the held-out features once
    rerun = run.rerun_of_finished(f"phase-{phase}")
    if rerun:
        run.verify_features(index, full=True, rerun=True)
    run.restart_finished(f"phase-{phase}", steps=range(current.first_step + 1, current.end_step + 1))
    start_step, start_sha, resumed = resume_phase(run, data.plan, current, prev, previous, content)
    if start_step < current.end_step:
        fresh = start_step == current.first_step
        if not rerun:
            run.verify_features(index, full=fresh, resuming=None if fresh else start_step)
        if data.heldout_index is not None:
            run.verify_features(data.heldout_index, full=False, resuming=None if fresh else start_step)
    run.start(start_step, f"phase {phase} of {len(data.plan.phases)}: steps {current.first_step}.."
                          f"{current.end_step - 1}")

    # -- the loop over the phase's steps; checkpoints record their lineage; the phase boundaries are kept
    end_step = current.end_step if stop_after_steps is None else min(current.end_step, stop_after_steps)
    lineage = {"index": phase, "first_step": current.first_step, "end_step": current.end_step,
               "start_state_sha256": start_sha, "features_sha256": content}
    protect = {current.first_step} | ({data.plan.phases[phase - 1].first_step} if phase > 0 else set())
    try:
        if start_step < end_step:
            run.train_steps(start_step, end_step, protect=protect,
                            extra=lambda: {"phase": lineage, "last_train": run.last})
        elif ranks.main:
            log.info("phase %d: its checkpoint at step %d is there already (an earlier run of it): nothing to train",
                     phase, start_step)
        if end_step < current.end_step:
            return {"stopped_at": end_step, "end_step": current.end_step}
        if not run.last:
            run.last = dict(resumed.get("last_train") or {})

        # -- the marker: where the phase ended, what it measured
        wall_s = time.time() - t_start
        peak = peak_memory_gib(device, run.memory.run_peak if run.memory is not None else 0)
        ckpt = run.ckpt_dir / f"step-{current.end_step:08d}"
        marker = {
            "format": PHASE_FORMAT, "phase": phase, "phases": len(data.plan.phases),
            "pass": current.pass_index, "slice": current.slice_index,
            "first_step": current.first_step, "end_step": current.end_step, "total_steps": data.plan.total_steps,
            "samples": len(current.samples),
            "checkpoint": {"path": ckpt.relative_to(run.out_dir).as_posix(), "step": current.end_step,
                           "state_sha256": state_sha256(ckpt)},
            "fingerprint": fingerprint, "stream": settings.stream.to_dict(), "features": data.features.meta,
            "features_sha256": content,
            "labels": settings.train.labels if data.use_target_tokens else "data", "world_size": world,
            "device": str(device),
            "resumed_from_step": start_step, "last_train": run.last, "heldout": run.evals[-1] if run.evals else None,
            "rates": {k: run.last[k] for k in ("tokens_per_s", "window_tokens_per_s", "model_tflops_per_gpu")
                      if k in run.last},
            "peak_memory_gib": peak, "run_peak_memory_gib": _max_each(peak, (prev or {}).get("run_peak_memory_gib")),
            "memory_by_phase_gib": run.memory.phases if run.memory is not None else None,
            "step_phases_ms": run.phase_summary_now(),
            "wall_s": wall_s, "run_wall_s": wall_s + float((prev or {}).get("run_wall_s", 0.0)),
        }
        if ranks.main:
            path = Path(marker_path) if marker_path else run.out_dir / "phases" / f"phase-{phase}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, marker)
            mark_finished(run.ckpt_dir, f"phase-{phase}", ckpt, path)
            log.info("phase %d done: steps %d..%d, checkpoint %s; marker %s", phase, current.first_step,
                     current.end_step - 1, ckpt, path)
        barrier()
        return marker
    finally:
        run.close()


def train_final(marker_path: str | os.PathLike, heldout_path: str | os.PathLike | None,
                tokenized_path: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                settings: TrainSettings, *, threads: int | None = None) -> dict[str, Any]:
    """The end of a stream-mode run: the final checkpoint (the last phase's marker names it), the final held-out
    metrics, and ``<out_dir>/trained/`` (weights, config.json, trainer_state.json with the history of the
    checkpoints' state) as offline training writes it.

    The ``stream`` keys come from the marker (rule ``train`` reads no ``stream`` section); ``settings`` are rule
    ``train``'s. trainer_state.json also holds ``"stream"``: the slicing and the phases.

    Raises:
        ValueError: the marker is not the plan's last phase, its run fingerprint is not the one these settings and
            data give, or its checkpoint is missing or not the one it names; held-out features missing or short.
    """
    t_start = time.time()
    cfg = settings.train
    device, ranks = setup_device(threads)
    marker = read_marker(marker_path)
    stream = StreamOptions.from_mapping(marker["stream"])
    world = max(1, int(cfg.gpus))

    # -- data: the plan (for the run's summary and fingerprint), the held-out features
    features = FeatureMeta(str(marker_path), dict(marker["features"]))
    heldout_index = open_heldout(heldout_path, features)
    data = plan_stream_data(tokenized_path, cfg, stream, world, features=features, heldout_index=heldout_index)
    check_heldout(data, heldout_path)
    last = data.plan.phases[-1]
    if (marker["phase"], marker["end_step"]) != (last.index, last.end_step):
        raise ValueError(f"{marker_path}: phase {marker['phase']} ends at step {marker['end_step']}, but the plan's "
                         f"last phase is {last.index}, ending at step {last.end_step}: give the last phase's marker")

    # -- model: the final checkpoint's weights
    run = Trainer(data, target_dir, out_dir, settings, device, ranks)
    fingerprint = run_fingerprint(drafter_config_dict(run.config), cfg, features.meta, world, data.plan_identity,
                                  start=run.start_digest)
    if fingerprint != marker["fingerprint"]:
        raise ValueError(f"{marker_path}: the phases trained run {marker['fingerprint'][:12]}, but these settings and "
                         f"data give run {fingerprint[:12]}: the settings or the data changed after the phases ran")
    run.use_checkpoints(fingerprint)
    path = run.out_dir / marker["checkpoint"]["path"]
    state = verify_checkpoint(path)
    if state is None or state_sha256(path) != marker["checkpoint"]["state_sha256"]:
        raise ValueError(f"{path}: the final checkpoint {marker_path} names is missing, incomplete or another one "
                         f"(state sha256 {marker['checkpoint']['state_sha256'][:12]}); rerun the last phase")
    step, run.history = restore(path, state, fingerprint, run.model, None, device)
    log.info("final checkpoint %s (step %d of %d)", path, step, data.plan.total_steps)
    if data.heldout_index is not None:  # what the final metrics read: those changed since the phases verified them
        run.verify_features(data.heldout_index, full=False)
    run.start(step, f"{len(data.plan.phases)} phases")
    try:
        return run.final_outputs(t_start, resumed_from_step=int(marker["resumed_from_step"]), earlier=marker,
                                 extra={"stream": dict(stream.to_dict(), phases=len(data.plan.phases))})
    finally:
        run.close()


# ---------------------------------------------------------------------------------------------------------------
# checks


def select_phase(plan: StreamPlan, phase: int, expected: Mapping[str, Any] | None) -> Phase:
    """Phase ``phase`` of the plan, checked against ``expected`` (the stream plan's record of it).

    Raises:
        ValueError: no such phase; a field of ``expected`` differs (both values named).
    """
    if not 0 <= phase < len(plan.phases):
        raise ValueError(f"phase {phase}: the plan has {len(plan.phases)} phases (0..{len(plan.phases) - 1})")
    got = plan.phases[phase]
    for key in ("first_step", "end_step", "samples"):
        if expected is None or key not in expected:
            continue
        mine, theirs = getattr(got, key), expected[key]
        if key == "samples" and list(mine) != [int(s) for s in theirs]:
            extra = sorted(set(map(int, theirs)) - set(mine))[:3]
            lacking = sorted(set(mine) - set(map(int, theirs)))[:3]
            raise ValueError(f"phase {phase}: the plan recomputed from the tokenized rows and the settings reads "
                             f"{len(mine)} samples, the stream plan's record {len(theirs)} (only in the record: "
                             f"{extra}, only here: {lacking}); the data or the settings changed after stream_plan")
        if key != "samples" and int(mine) != int(theirs):
            raise ValueError(f"phase {phase}: the plan recomputed from the tokenized rows and the settings gives "
                             f"{key} {mine}, the stream plan's record {theirs}; the data or the settings changed "
                             "after stream_plan")
    return got


def check_samples(index: FeatureIndex, rows, lengths, what: str) -> None:
    """Every row of ``rows`` is in ``index`` with ``lengths[row]`` tokens.

    Raises:
        ValueError: rows missing (a few named, with the count) or of another length.
    """
    missing = [r for r in rows if not index.has_row(r)]
    if missing:
        raise ValueError(f"{index.path}: {what} needs {len(missing)} sample(s) this index does not hold (tokenized "
                         f"rows {missing[:5]}{', ...' if len(missing) > 5 else ''}); it holds "
                         f"{len(index.samples)}")
    for r in rows:
        if index.ref(r).num_tokens != lengths[r]:
            raise ValueError(f"{index.path}: tokenized row {r} has {index.ref(r).num_tokens} tokens of features but "
                             f"{lengths[r]} tokens in the tokenized parquet: features of other data")


def open_heldout(path: str | os.PathLike | None, features: FeatureMeta) -> FeatureIndex | None:
    """The held-out features' index: ``path`` is its ``index.json`` or the folder holding it; None when ``path``
    is None or a folder without one. Its :data:`~draftsmith.train.plan.FEATURE_FIELDS` must be the run's.

    Raises:
        ValueError: the held-out features were extracted otherwise (the field named with both values).
    """
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        if not (path / "index.json").is_file():
            return None
        path = path / "index.json"
    index = FeatureIndex(path)
    for key in FEATURE_FIELDS:
        if index.meta.get(key) != features.meta.get(key):
            raise ValueError(f"{path}: the held-out features' {key} {index.meta.get(key)!r} differs from "
                             f"{features.meta.get(key)!r} of {features.path}")
    return index


def check_heldout(data: TrainData, heldout_path: str | os.PathLike | None) -> None:
    """The held-out samples kept have features in ``data.heldout_index`` (when there are any).

    Raises:
        ValueError: held-out samples but no held-out index, or one that lacks some of them.
    """
    if not data.heldout_ids:
        data.heldout_index = None
        return
    if data.heldout_index is None:
        raise ValueError(f"{len(data.heldout_ids)} held-out samples are kept (train.eval_fraction's split, at most "
                         "stream.heldout_samples), but there are no held-out features "
                         f"({heldout_path or 'none given'})")
    check_samples(data.heldout_index, data.heldout_ids, data.lengths, "the held-out metrics")


def phase_record(plan_path: str | os.PathLike, phase: int) -> dict[str, Any] | None:
    """Phase ``phase``'s record in the stream plan (``results/stream/plan.json``: ``"phases"``, a list in phase
    order of ``{"first_step", "end_step", "samples", ...}``), or None when the plan lists no phases."""
    phases = read_json(plan_path).get("phases")
    if not isinstance(phases, list):
        return None
    if not 0 <= phase < len(phases):
        raise ValueError(f"{plan_path}: phase {phase} is not among its {len(phases)} phases")
    return phases[phase]


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """A phase's marker (:data:`PHASE_FORMAT`).

    Raises:
        ValueError: another format.
    """
    marker = read_json(path)
    if marker.get("format") != PHASE_FORMAT:
        raise ValueError(f"{path}: format is {marker.get('format')!r}, expected {PHASE_FORMAT!r}")
    return marker


# ---------------------------------------------------------------------------------------------------------------
# resume


def resume_phase(run: Trainer, plan: StreamPlan, phase: Phase, prev: dict | None,
                 prev_path: str | os.PathLike | None, features_sha256: str) -> tuple[int, str | None, dict]:
    """Load the checkpoint phase ``phase`` starts from into ``run`` (weights, optimizer, RNG, history).

    The newest checkpoint of this run in ``(first_step, end_step]`` that descends from the checkpoint at
    ``first_step`` and was trained on the same slice (its ``"phase"`` record: this phase, the same start, the same
    ``features_sha256``, :func:`~draftsmith.features.index_content_sha256`), else the checkpoint at ``first_step``
    (phase 0 at step 0: none, a fresh start). ``prev``, the previous phase's marker, must be of this run, end at
    ``first_step`` and name the checkpoint there.

    Returns:
        ``(start step, sha256 of the start checkpoint's state.json or None, the loaded checkpoint's state)``.

    Raises:
        ValueError: ``prev`` of another run fingerprint or ending at another step (both named); no valid
            checkpoint at ``first_step`` (the checkpoints there named), or not the one ``prev`` names.
    """
    p, first, end = phase.index, phase.first_step, phase.end_step
    if prev is not None:
        if prev.get("fingerprint") != run.fingerprint:
            raise ValueError(f"{prev_path}: phase {prev.get('phase')} trained run {str(prev.get('fingerprint'))[:12]}, "
                             f"but phase {p}'s settings and data give run {run.fingerprint[:12]}: rerun the phases "
                             "before it (their settings or data changed)")
        if (prev.get("phase"), prev.get("end_step")) != (p - 1, first):
            raise ValueError(f"{prev_path}: phase {prev.get('phase')} ends at step {prev.get('end_step')}, but phase "
                             f"{p} starts at step {first} after phase {p - 1}")
    found = checkpoint_steps(run.ckpt_dir)
    start_sha, chosen = None, None
    if first > 0:
        state = verify_checkpoint(found[first]) if first in found else None
        if state is None:
            raise ValueError(f"phase {p} trains steps {first}..{end - 1} from the checkpoint at step {first} (phase "
                             f"{p - 1}'s end), but {run.ckpt_dir} has no valid one there (checkpoints at steps "
                             f"{list(found) or 'none'}): run phase {p - 1} first")
        start_sha = state_sha256(found[first])
        if prev is not None and prev["checkpoint"]["state_sha256"] != start_sha:
            raise ValueError(f"{found[first]}: its state sha256 {start_sha[:12]} is not the "
                             f"{prev['checkpoint']['state_sha256'][:12]} phase {p - 1}'s marker {prev_path} names: "
                             f"the checkpoint was written again after that phase; rerun phase {p - 1}")
        chosen = (found[first], state)
    for step in sorted((s for s in found if first < s <= end), reverse=True):
        try:
            origin = read_json(found[step] / "state.json").get("phase") or {}
        except (FileNotFoundError, ValueError):
            continue
        if (origin.get("index"), origin.get("start_state_sha256"), origin.get("features_sha256")) != (
                p, start_sha, features_sha256):
            log.info("phase %d: %s descends from another start or slice content (an earlier run of the phases); "
                     "not resumed", p, found[step])
            continue
        state = verify_checkpoint(found[step])
        if state is not None:
            chosen = (found[step], state)
            break
    if chosen is None:
        log.info("phase %d: starting fresh at step 0", p)
        return 0, None, {}
    step, run.history = restore(chosen[0], chosen[1], run.fingerprint, run.model, run.optimizer, run.device)
    how = (f"starting from phase {p - 1}'s end checkpoint" if step == first
           else "resuming interrupted phase from" if step < end else "its end checkpoint is there:")
    log.info("phase %d: %s %s (step %d; the phase trains steps %d..%d of %d)", p, how, chosen[0], step, first, end - 1,
             plan.total_steps)
    return step, start_sha, chosen[1]


def _max_each(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    """Elementwise max of two per-rank lists (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return [max(x, y) for x, y in zip(a, b)]
