"""Checkpoints: the run fingerprint that names their folder, atomic writes, verified reads, resume, and the record of
a finished run.

A checkpoint is ``<out>/checkpoints/run-<fingerprint[:12]>/step-XXXXXXXX/`` (the layout is described in
:mod:`draftsmith.train`): :func:`save_checkpoint` assembles it under a temporary name, fsyncs and renames it into
place, then replaces ``latest.json``; :func:`load_latest_checkpoint` returns the newest one whose files match their
recorded sha256; :func:`resume` loads its weights, optimizer state and RNG states into a run.

A run (or a stream-mode phase) that wrote its output records it in ``finished-<name>.json`` beside its checkpoints
(:func:`mark_finished`). Its checkpoints are points to resume from only while that output is in place: Snakemake
removes a job's outputs before it runs the job, so a finished run whose output is gone is being rerun (``--forcerun``,
or an input that changed without changing the fingerprint) and starts fresh (:func:`read_finished`,
:func:`remove_checkpoints`); an interrupted run has no record and resumes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.features import index_content_sha256
from draftsmith.io import (
    DiskFullError,
    disk_full,
    fsync_dir,
    holds_lock,
    is_disk_full,
    read_json,
    remove_dead_temporaries,
    sha256_file,
    write_json,
    writer_mark,
)
from draftsmith.modeling import DFlashDraftModel
from draftsmith.train.settings import CADENCE_KEYS, TrainOptions

log = logging.getLogger("draftsmith.train")

CHECKPOINT_FORMAT = "draftsmith.checkpoint/1"
FINISHED_FORMAT = "draftsmith.finished/1"


#: The index metadata every slice of a stream-mode run shares (a slice's sample and token counts are its own).
SHARED_FEATURE_KEYS = ("layer_ids", "target_fingerprint", "tokenizer_fingerprint", "storage_dtype")


def run_fingerprint(drafter_config: dict, settings: TrainOptions, index_meta: dict, world: int,
                    plan_identity: dict | None = None, *, start: str | None = None) -> str:
    """sha256 (hex) of everything that decides the training trajectory: the drafter's config dict, the ``train``
    keys except :data:`~draftsmith.train.settings.CADENCE_KEYS` (save / eval / log cadence; the GPU count enters as
    ``world``) and, for a DFlash drafter, ``selector_loss_weight`` and ``selector_stop_gradient`` (DFlash2 only),
    and the recipe keys added later at the value that trains as before (:data:`LATER_RECIPE_KEYS`), the features'
    identity and the world size.

    Offline (``plan_identity`` None) the features' identity is the index's sample and token counts, layer ids,
    target and tokenizer fingerprints, storage dtype and content: the digest of its chunk files' sha256
    (:func:`draftsmith.features.index_content_sha256`), so features rewritten with the same counts are another run.
    In stream mode it is :data:`SHARED_FEATURE_KEYS` only, and ``plan_identity`` (the ``stream`` keys and a hash of
    the tokenized rows' lengths: what decides the global plan) joins the payload, so every phase of a run has the
    same fingerprint, whatever its slice holds (a phase's checkpoints record its slice's content instead:
    :func:`draftsmith.train.phases.resume_phase`).

    Soft labels (``train.labels: target_topk``) add the features' ``target_top_k``, so that in stream mode too another
    k is another run. A DFlash2 drafter under Muon adds the optimizer's split
    (:data:`~draftsmith.train.model.MUON_EXCLUDED_NAMES`: its codebooks on AdamW since 2026-12-04), so a run
    checkpointed with them on Muon starts afresh instead of failing to load its optimizer state.

    ``start`` (``drafter.init_from``'s :func:`draftsmith.warm_start.start_digest`: the sha256 of its files) joins the
    payload when the run starts from a drafter folder, so another start, or the same folder with other weights, trains
    a fresh run; a run from random weights keeps the fingerprint it always had.

    Raises:
        ValueError: offline, a chunk of the index without a sha256.
    """
    keys = SHARED_FEATURE_KEYS if plan_identity is not None else ("num_samples", "num_tokens", *SHARED_FEATURE_KEYS)
    train = {k: v for k, v in sorted(settings.to_dict().items()) if k not in CADENCE_KEYS}
    dflash2 = "DFlash2DraftModel" in (drafter_config.get("architectures") or [])
    if not dflash2:
        for key in ("selector_loss_weight", "selector_stop_gradient"):  # no selector: a DFlash run keeps its
            train.pop(key, None)  # fingerprint
    for key, (before, uses) in LATER_RECIPE_KEYS.items():  # the earlier recipe keeps its fingerprint (and resumes)
        if train.get(key, before) == before:
            for name in (key, *uses):
                train.pop(name, None)
    payload = {
        "drafter": drafter_config,
        "train": train,
        "features": {k: index_meta.get(k) for k in keys},
        "world_size": world,
    }
    if train.get("labels") == "target_topk":  # the soft labels' k (offline the content digest holds it too)
        payload["target_top_k"] = index_meta.get("target_top_k")
    if dflash2 and train.get("optimizer") == "muon":
        # the selector's codebooks left Muon for AdamW (MUON_EXCLUDED_NAMES): a run before holds another split
        payload["muon_split"] = "codebooks-adamw"
    if start is not None:
        payload["start"] = start
    if plan_identity is not None:
        payload["plan"] = plan_identity
    else:
        payload["features"]["content_sha256"] = index_content_sha256(index_meta)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


#: train keys added after runs existed: key -> (the value that trains as before, the keys only its other values
#: read); a run at that value leaves them out of its fingerprint
LATER_RECIPE_KEYS: dict[str, tuple[object, tuple[str, ...]]] = {
    "loss_weighting": ("exp", ("dpace_alpha",)),
    "optimizer": ("adamw", ("muon_lr", "muon_weight_decay")),
    "selector_stop_gradient": (True, ()),
    "labels_topk": (None, ()),
}


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer ``state_dict`` into safetensors-able tensors (``state.<param>.<name>``) and JSON."""
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{pid}.{name}"] = t.detach().contiguous().cpu()
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Inverse of :func:`optimizer_tensors`."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(ckpt_dir: Path, step: int, model: DFlashDraftModel, opt: torch.optim.Optimizer,
                    state: dict, keep: int = 2, protect: Collection[int] = ()) -> Path:
    """Write ``ckpt_dir/step-XXXXXXXX/`` atomically, point ``latest.json`` at it, keep the newest ``keep``.

    ``state`` (JSON) gets the sha256 of every tensor file; ``state.json`` is written last inside the
    temporary folder, which is then renamed into place. Pruning never removes the checkpoint just written nor those
    at the steps in ``protect`` (stream mode's phase boundaries, which a rerun of a phase starts from).

    A save that fails (a full disk, an interrupt) removes its temporary folder before the error propagates; the
    checkpoints written before stay as they were.

    Raises:
        DiskFullError: the disk filled up (the file being written and the free bytes named).
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".step-{step:08d}.{writer_mark()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    name = ""
    try:
        opt_tensors, opt_meta = optimizer_tensors(opt)
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                rng[f"torch_cuda_{i}"] = s
        files = {"model.safetensors": model.trainable_state_dict(), "optimizer.safetensors": opt_tensors,
                 "rng.safetensors": rng}
        hashes = {}
        for name, tensors in files.items():
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            hashes[name] = sha256_file(tmp / name)
        name = "state.json"
        full = dict(state, format=CHECKPOINT_FORMAT, step=step, files=hashes, optimizer=opt_meta)
        write_json(tmp / "state.json", full)
        for name in list(files) + ["state.json"]:
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        name = ""
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # named under its final name (state.json's DiskFullError named the temporary one)
            cause = exc.__cause__ if isinstance(exc, DiskFullError) and exc.__cause__ is not None else exc
            raise disk_full(final / name if name else final, cause) from cause
        raise
    fsync_dir(ckpt_dir)
    write_json(ckpt_dir / "latest.json", {"step": step, "path": final.name})
    done = sorted(p for p in ckpt_dir.glob("step-*") if p.is_dir())
    kept = {final.name} | {f"step-{s:08d}" for s in protect}
    for old in done[:-keep] if keep > 0 else []:
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return final


def remove_dead_saves(checkpoints: Path) -> int:
    """Remove the temporary folders of checkpoint saves whose writer died (``run-*/.step-N.tmp-<pid>@<host>``,
    :func:`draftsmith.io.remove_dead_temporaries`) in every run folder under ``checkpoints`` (the folder holding the
    ``run-*`` folders); the log names each with its bytes. A process that holds ``checkpoints``' writer lock
    (:func:`draftsmith.io.lock_folder`) is its only writer: every other save's folder is dead. Returns the bytes
    removed."""
    only = holds_lock(checkpoints) if checkpoints.is_dir() else False
    removed = 0
    for run in sorted(checkpoints.glob("run-*")) if checkpoints.is_dir() else []:
        gone, _ = remove_dead_temporaries(run, [".step-"], only_writer=only, what=f"checkpoints {run}")
        removed += sum(t.bytes for t in gone)
    return removed


def verify_checkpoint(path: Path) -> dict | None:
    """``state.json`` of a complete checkpoint folder whose files match their recorded sha256, else None."""
    try:
        state = read_json(path / "state.json")
    except (FileNotFoundError, ValueError):
        return None
    if state.get("format") != CHECKPOINT_FORMAT:
        return None
    for name, digest in (state.get("files") or {}).items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            log.warning("checkpoint %s: %s is missing or does not match its sha256; ignoring it", path, name)
            return None
    return state


def load_latest_checkpoint(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest verified checkpoint: ``latest.json``'s target when valid, else the newest valid
    ``step-*`` folder (temporary ``.step-*`` folders of killed writers are ignored)."""
    if not ckpt_dir.is_dir():
        return None
    candidates = []
    latest = ckpt_dir / "latest.json"
    if latest.is_file():
        try:
            candidates.append(ckpt_dir / read_json(latest)["path"])
        except (ValueError, KeyError):
            log.warning("%s is unreadable; scanning the step folders", latest)
    candidates += sorted((p for p in ckpt_dir.glob("step-*") if p.is_dir()), reverse=True)
    for path in candidates:
        state = verify_checkpoint(path)
        if state is not None:
            return path, state
    return None


def checkpoint_steps(ckpt_dir: Path) -> dict[int, Path]:
    """``{step: folder}`` of the ``step-*`` folders in ``ckpt_dir`` (not verified; ``{}`` when there is none)."""
    if not ckpt_dir.is_dir():
        return {}
    out = {}
    for path in ckpt_dir.glob("step-*"):
        if path.is_dir() and path.name[5:].isdigit():
            out[int(path.name[5:])] = path
    return dict(sorted(out.items()))


def state_sha256(path: Path) -> str:
    """sha256 of a checkpoint's ``state.json``: it names the checkpoint (the tensor files' hashes are inside)."""
    return sha256_file(path / "state.json")


def restore(path: Path, state: dict, fingerprint: str, model: DFlashDraftModel,
            optimizer: torch.optim.Optimizer | None, device: torch.device) -> tuple[int, list]:
    """Load a verified checkpoint (:func:`verify_checkpoint`'s ``state``) into a run: weights, optimizer state
    (unless ``optimizer`` is None) and RNG states; returns ``(its step, its eval history)``.

    Raises:
        ValueError: the checkpoint's fingerprint is not ``fingerprint`` (its folder was edited by hand).
    """
    if state.get("fingerprint") != fingerprint:
        raise ValueError(f"{path}: its run fingerprint {state.get('fingerprint', '?')[:12]} does not match "
                         f"the folder's {fingerprint[:12]}; the checkpoint folder was edited by hand")
    model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(device)))
    if optimizer is not None:
        load_optimizer_tensors(optimizer, load_file(str(path / "optimizer.safetensors"), device=str(device)),
                               state["optimizer"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and f"torch_cuda_{device.index or 0}" in rng:
        torch.cuda.set_rng_state(rng[f"torch_cuda_{device.index or 0}"], device)
    return int(state["step"]), list(state.get("history", []))


def resume(ckpt_dir: Path, fingerprint: str, model: DFlashDraftModel, optimizer: torch.optim.Optimizer,
           device: torch.device, total_steps: int) -> tuple[int, list, dict]:
    """Load the newest valid checkpoint of this run (weights, optimizer, RNG); ``(start step, eval history, its
    state.json)`` (the state carries what the run measured up to it: ``last_train``, ``memory_by_phase_gib``),
    ``(0, [], {})`` when there is none. The caller removes the checkpoints of a finished run that is rerun first
    (:func:`read_finished`).

    Raises:
        ValueError: the checkpoint's fingerprint is not the folder's (edited by hand).
    """
    found = load_latest_checkpoint(ckpt_dir)
    if found is None:
        return 0, [], {}
    path, state = found
    step, history = restore(path, state, fingerprint, model, optimizer, device)
    if step < total_steps:
        log.info("resuming interrupted run from step %d of %d (%s)", step, total_steps, path)
    return step, history, state


# ---------------------------------------------------------------------------------------------------------------
# the chunk files a run verified

VERIFIED_FORMAT = "draftsmith.verified-chunks/1"


def verified_path(ckpt_dir: Path) -> Path:
    """The record of the chunk files a run verified: ``ckpt_dir/verified-chunks.json``."""
    return ckpt_dir / "verified-chunks.json"


def read_verified(ckpt_dir: Path) -> dict[str, dict]:
    """The chunk files this run verified (:data:`VERIFIED_FORMAT`): ``{resolved path: {"sha256", "bytes",
    "mtime_ns"}}`` as they were when hashed; ``{}`` when there is no record or it is unreadable (everything is hashed
    again)."""
    path = verified_path(ckpt_dir)
    if not path.is_file():
        return {}
    try:
        doc = read_json(path)
    except ValueError:
        log.warning("%s is unreadable: every chunk file is hashed again", path)
        return {}
    chunks = doc.get("chunks") if isinstance(doc, dict) and doc.get("format") == VERIFIED_FORMAT else None
    return dict(chunks) if isinstance(chunks, dict) else {}


def chunks_to_verify(index, record: dict[str, dict], *, full: bool) -> tuple[list[int], dict[str, dict]]:
    """Which chunk files of ``index`` (a :class:`~draftsmith.features.FeatureIndex`) must be hashed: all with
    ``full``, else those whose sha256 in the index, size or ``mtime_ns`` differ from ``record``'s entry (a file
    rewritten, or not yet verified by this run). Returns ``(their chunk numbers, the record entry of every chunk as
    it is now)``; the entries are taken before hashing, so a file changed while it is hashed differs next time."""
    todo, entries = [], {}
    for ci, file in enumerate(index.files):
        stat = file.stat()
        entry = {"sha256": index.meta["chunks"][ci]["sha256"], "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        key = str(file.resolve())
        entries[key] = entry
        if full or {k: (record.get(key) or {}).get(k) for k in entry} != entry:
            todo.append(ci)
    return todo, entries


def record_verified(ckpt_dir: Path, record: dict[str, dict], entries: dict[str, dict]) -> None:
    """Write the record (atomically): ``record`` with ``entries`` (chunks just verified or found unchanged) added;
    entries of files that no longer exist (a stream-mode slice deleted after its phase) are dropped."""
    chunks = {k: v for k, v in {**record, **entries}.items() if Path(k).is_file()}
    write_json(verified_path(ckpt_dir), {"format": VERIFIED_FORMAT, "chunks": dict(sorted(chunks.items()))})


# ---------------------------------------------------------------------------------------------------------------
# finished runs


def other_runs(ckpt_dir: Path) -> dict[str, int]:
    """The ``run-*`` folders beside ``ckpt_dir`` (runs of other settings or data) and the bytes each holds, by name."""
    parent = Path(ckpt_dir).parent
    if not parent.is_dir():
        return {}
    return {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            for p in sorted(parent.glob("run-*")) if p.is_dir() and p != Path(ckpt_dir)}


def finished_path(ckpt_dir: Path, name: str) -> Path:
    """Where the record of a finished ``name`` lives: ``ckpt_dir/finished-<name>.json``."""
    return ckpt_dir / f"finished-{name}.json"


def mark_finished(ckpt_dir: Path, name: str, checkpoint: Path, output: Path) -> None:
    """Record (atomically, :data:`FINISHED_FORMAT`) that ``name`` (``"run"``, ``"phase-<p>"``) finished: the
    checkpoint it ended with (folder name, ``state.json`` sha256) and the output it wrote last (its path relative to
    ``ckpt_dir`` and its sha256). Written after the output."""
    write_json(finished_path(ckpt_dir, name), {
        "format": FINISHED_FORMAT, "name": name, "checkpoint": checkpoint.name,
        "step": int(read_json(checkpoint / "state.json")["step"]), "state_sha256": state_sha256(checkpoint),
        "output": os.path.relpath(output, ckpt_dir), "output_sha256": sha256_file(output)})


def read_finished(ckpt_dir: Path, name: str) -> tuple[dict | None, bool]:
    """``(the record of a finished name or None, whether its output is in place)``: in place when the file it
    names exists with the recorded sha256. A record whose output is gone or another file means the job is rerun
    (Snakemake removes a job's outputs before running it); an unreadable record counts as one whose output is gone.
    """
    path = finished_path(ckpt_dir, name)
    if not path.is_file():
        return None, False
    try:
        record = read_json(path)
        output = ckpt_dir / record["output"]
        return record, output.is_file() and sha256_file(output) == record["output_sha256"]
    except (ValueError, KeyError, TypeError):
        log.warning("%s is unreadable: taken as a finished run whose output is gone", path)
        return {"step": "?", "output": "?"}, False


def remove_checkpoints(ckpt_dir: Path, name: str, steps: Collection[int] | None = None) -> list[int]:
    """Remove the checkpoints of a finished ``name`` that is rerun: the step folders at ``steps`` (None: all),
    ``latest.json`` when it names one of them, then the record (last: a kill in between leaves the record, so the
    next start removes the rest). Returns the steps removed."""
    removed = []
    latest = ckpt_dir / "latest.json"
    for step, path in checkpoint_steps(ckpt_dir).items():
        if steps is None or step in steps:
            if latest.is_file():
                try:
                    if read_json(latest).get("path") == path.name:
                        latest.unlink()
                except ValueError:
                    latest.unlink()
            shutil.rmtree(path)
            removed.append(step)
    fsync_dir(ckpt_dir)
    finished_path(ckpt_dir, name).unlink(missing_ok=True)
    return removed
