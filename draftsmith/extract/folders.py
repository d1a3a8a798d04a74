"""Where a shard job writes: the staging folder renamed into place when complete, and what every shard of the plan
still has to write (the disk check of :func:`draftsmith.extract.shard.extract_shard` counts all shards: they run at
once).

A staged shard (stream mode's ``extract_slice`` / ``extract_heldout``) is written in a staging folder outside the
rule's ``directory()`` output, so a killed job's chunks survive Snakemake deleting that output, and is renamed onto
the output once its manifest is written (:func:`open_staging`, :func:`publish`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from draftsmith.disk import projected_bytes
from draftsmith.features import PROGRESS_FORMAT
from draftsmith.io import fsync_dir, read_json

log = logging.getLogger("draftsmith.extract")


# --------------------------------------------------------------------------------------------------
# staging


def _device_of(path: Path) -> int:
    """``st_dev`` of the file system holding ``path`` (its nearest existing parent)."""
    while not path.exists():
        path = path.parent
    return path.stat().st_dev


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and next(path.iterdir(), None) is None


def open_staging(staging: Path, out: Path) -> Path:
    """The folder a staged shard is written in: ``staging``, after checking it can be renamed onto ``out``, and
    holding ``out``'s files when ``out`` holds some and ``staging`` does not (a rerun resumes from them).

    Raises:
        ValueError: ``staging`` and ``out`` are on different file systems.
        RuntimeError: both hold files.
    """
    staging, out = staging.absolute(), out.absolute()
    if _device_of(staging) != _device_of(out):
        raise ValueError(f"staging folder {staging} and output folder {out} are on different file systems: the "
                         "finished shard is renamed into place, which needs one file system")
    if out.exists() and not _is_empty_dir(out):
        if staging.exists() and not _is_empty_dir(staging):
            raise RuntimeError(f"{out} and its staging folder {staging} both hold files: remove the one that is "
                               "not wanted")
        staging.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            staging.rmdir()
        log.info("%s holds files and %s does not: moving them back to resume from them", out, staging)
        os.replace(out, staging)
    return staging


def publish(staging: Path, out: Path) -> None:
    """Rename the finished ``staging`` folder onto ``out`` (absent or an empty folder), durably.

    Raises:
        RuntimeError: ``out`` holds files (something wrote there while the shard ran).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not _is_empty_dir(out):
        raise RuntimeError(f"cannot rename the finished shard {staging} onto {out}: {out} holds files")
    os.replace(staging, out)
    fsync_dir(out.parent)
    log.info("renamed the finished shard %s -> %s", staging, out)
    for parent in (staging.parent, staging.parent.parent):  # the phase's staging folder, then .staging, once empty
        if parent.name.startswith(".staging") or parent.parent.name.startswith(".staging"):
            try:
                parent.rmdir()
            except OSError:  # another shard's folder is still there
                break


# --------------------------------------------------------------------------------------------------
# every shard's bytes still to write


def shard_folders(num_shards: int, out: Path, staging_dir: str | os.PathLike | None,
               given: Sequence[str | os.PathLike | Sequence[str | os.PathLike]] | None) -> list[list[Path]]:
    """Per shard of the plan, the folders its chunks may be in: ``given`` (one entry per shard, a folder or a list
    of folders), else ``<out>/../shard-{j}`` and, when staged, ``<staging_dir>/../shard-{j}``.

    Raises:
        ValueError: ``given`` does not have one entry per shard.
    """
    if given is None:
        return [[out.parent / f"shard-{j}"] + ([Path(staging_dir).parent / f"shard-{j}"] if staging_dir else [])
                for j in range(num_shards)]
    if len(given) != num_shards:
        raise ValueError(f"shard_dirs has {len(given)} entries for a plan of {num_shards} shards")
    return [[Path(d)] if isinstance(d, (str, os.PathLike)) else [Path(x) for x in d] for d in given]


def finished_bytes(folders: list[Path], rows: set[int]) -> int:
    """Bytes of a shard's finished chunks on disk: the chunks its ``progress.json`` records whose file has the
    recorded size and whose rows are the shard's (the largest total over its folders)."""
    best = 0
    for folder in folders:
        try:
            prog = read_json(folder / "progress.json")
        except (OSError, ValueError):
            continue
        if not isinstance(prog, dict) or prog.get("format") != PROGRESS_FORMAT:
            continue
        total = 0
        for rec in prog.get("chunks", []):
            try:
                ok = (folder / rec["file"]).stat().st_size == rec["bytes"] and rows.issuperset(rec["rows"])
            except (OSError, KeyError, TypeError):
                ok = False
            total += int(rec["bytes"]) if ok else 0
        best = max(best, total)
    return best


def bytes_left(plan: dict, shard: int, own_left: int, dirs: list[list[Path]], *, storage: str, want_tt: bool,
               chunk_tokens: int, target_topk: int = 0) -> dict[int, int]:
    """Bytes every shard of ``plan`` still has to write: ``own_left`` for ``shard``; for another shard its projected
    bytes (:func:`draftsmith.disk.projected_bytes`, chunks of ``chunk_tokens``, the target's top ``target_topk``)
    minus its finished chunks on disk in ``dirs[j]`` (:func:`finished_bytes`), at least 0."""
    n_layers, hidden = len(plan["layer_ids"]), int(plan["hidden_size"])
    left = {shard: own_left}
    for spec in plan["shards"]:
        j, tokens = int(spec["shard"]), int(spec["num_tokens"])
        if j == shard:
            continue
        n_chunks = -(-tokens // int(chunk_tokens))
        projected = projected_bytes(tokens, len(spec["rows"]), n_layers, hidden, storage, want_tt, n_chunks,
                                    target_topk=target_topk)
        left[j] = max(0, projected - finished_bytes(dirs[j], set(spec["rows"])))
    return left
