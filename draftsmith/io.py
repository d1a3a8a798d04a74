"""Small I/O helpers shared by every stage: atomic writes, checksums, JSON, logging, input errors.

Every file a stage writes goes through :func:`atomic_path` (write to a temporary name in the same
folder, fsync, then ``os.replace``), so a killed job never leaves a half-written file under its
final name; a full disk there raises :class:`DiskFullError` naming the file and the free bytes.

Every stage reads its input files inside :func:`reading`, which turns a library's decode error (pyarrow's
``ArrowInvalid`` of a truncated parquet, safetensors' ``SafetensorError`` of a truncated chunk, an ``OSError``)
into one :class:`InputError` naming the file, what was expected and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


class InputError(ValueError):
    """An input file that cannot be read or decoded, or whose content breaks its contract.

    The message is ``"<file>[: row r][: field f]: <problem>; expected <what>; <what to do>"``; the parts are kept
    as attributes (``path``, ``row``, ``field``, ``problem``, ``expected``, ``action``) for callers and tests.
    """

    def __init__(self, path: str | os.PathLike, problem: str, *, row: int | str | None = None,
                 field: str | None = None, expected: str = "", action: str = ""):
        self.path, self.row, self.field = str(path), row, field
        self.problem, self.expected, self.action = problem, expected, action
        where = str(path) + (f": row {row}" if row is not None else "") + (f": field {field!r}" if field else "")
        message = f"{where}: {problem}"
        if expected:
            message += f"; expected {expected}"
        if action:
            message += f"; {action}"
        super().__init__(message)


class DiskFullError(OSError):
    """A write that ran out of disk (``ENOSPC``): the message names the file and the free bytes left."""


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder (its entries: a rename into it survives a crash); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _decode_errors() -> tuple[type[BaseException], ...]:
    """The exception types of the libraries that read our inputs (imported here only when they are there)."""
    kinds: list[type[BaseException]] = [OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError]
    with contextlib.suppress(ImportError):
        import pyarrow

        kinds.append(pyarrow.ArrowException)
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        kinds.append(SafetensorError)
    return tuple(kinds)


@contextlib.contextmanager
def reading(path: str | os.PathLike, expected: str, action: str = "") -> Iterator[None]:
    """Read ``path`` inside this block: a library's I/O or decode error becomes an :class:`InputError` naming it.

    Converted: ``OSError`` (a missing file stays ``FileNotFoundError``, with the path), ``EOFError``,
    ``UnicodeDecodeError``, ``json.JSONDecodeError``, pyarrow's ``ArrowException`` (``ArrowInvalid`` of a
    truncated parquet), safetensors' ``SafetensorError`` (a truncated chunk). Errors of our own, which name the
    file already (``ValueError``, ``KeyError``, :class:`InputError`), pass through.

    Args:
        expected: what the file should be (``"a tokenized parquet written by rule tokenize"``).
        action: what to do about it (default: rerun the stage that writes it after deleting the file).
    Raises:
        InputError: see above (the original error chained as its cause).
        FileNotFoundError: the file does not exist.
    """
    try:
        yield
    except InputError:
        raise
    except FileNotFoundError as exc:
        if str(path) in str(exc):
            raise
        raise FileNotFoundError(exc.errno, f"{path}: {exc.strerror or exc}", str(path)) from exc
    except _decode_errors() as exc:
        raise InputError(path, f"cannot be read ({type(exc).__name__}: {exc})", expected=expected,
                         action=action or "the file is damaged or truncated: delete it and rerun the stage "
                                           "that writes it") from exc


#: How libraries word ``ENOSPC`` when they do not raise an ``OSError`` with its errno: the C library's text (pyarrow's
#: ``OSError``, whose errno is None) and Rust's ``io::Error`` (safetensors' ``SafetensorError: Error while
#: serializing: I/O error: No space left on device (os error 28)``).
DISK_FULL_TEXTS = ("No space left on device", f"(os error {errno.ENOSPC})")


def is_disk_full(exc: BaseException) -> bool:
    """An ``ENOSPC`` error: an ``OSError`` with that errno, or any error whose message says it
    (:data:`DISK_FULL_TEXTS`: pyarrow's I/O errors, safetensors' ``SafetensorError``, which is no ``OSError``)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    return any(t in text for t in DISK_FULL_TEXTS)


#: What :func:`reading` says a stage's parquet inputs should be.
CURATED_PARQUET = "a curated parquet written by rule curate (columns id, source, messages, tools)"
TOKENIZED_PARQUET = ("a tokenized parquet written by rule tokenize (columns id, source, input_ids, loss_mask, "
                     "num_tokens)")


def disk_full(path: str | os.PathLike, exc: BaseException) -> DiskFullError:
    """The :class:`DiskFullError` of a write to ``path`` that raised ``exc`` (:func:`is_disk_full`: an ``OSError``,
    a ``SafetensorError``...): the file, the free bytes of its file system (``shutil.disk_usage``) and what to do.
    Its ``errno`` is ``ENOSPC`` and its ``filename`` ``path``."""
    folder = Path(path).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free on {folder}"
    except OSError:
        free = "free space unknown"
    return DiskFullError(errno.ENOSPC, f"no space left on device writing {path} ({free}); free disk space or "
                                       f"point the run at a larger disk, then rerun (finished outputs are kept)",
                         str(path))


# -- temporaries: their names, and those of dead writers -----------------------------------------------------

log = logging.getLogger("draftsmith.io")

#: This host's name as temporaries carry it: the short host name, other characters than ``[A-Za-z0-9_-]`` as ``-``.
HOST = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]) or "host"
#: The writer mark in a temporary's name: ``.tmp``, ``.tmp-<pid>`` (older checkpoints) or ``.tmp-<pid>@<host>``,
#: followed by a dot (a kept extension) or the end of the name.
_TMP_MARK = re.compile(r"\.tmp(?:-(?P<pid>\d+)(?:@(?P<host>[A-Za-z0-9_-]+))?)?(?=\.|$)")
#: Slack (seconds) between a process's start time as /proc gives it (boot time in whole seconds) and a file's mtime.
_START_SLACK_S = 2.0


def writer_mark() -> str:
    """``tmp-<pid>@<host>``: what every temporary this process writes carries in its name (``.<mark>``), so a later
    run tells a dead writer's leftovers from a live one's (:func:`remove_dead_temporaries`)."""
    return f"tmp-{os.getpid()}@{HOST}"


def temporary_dir(beside: str | os.PathLike, *, kind: str = "") -> Path:
    """A new temporary folder beside ``beside`` (in its parent folder), named ``.<name>.[<kind>-]<random>.<mark>``
    (:func:`writer_mark`); the caller renames it into place or removes it."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{beside.name}.{kind + '-' if kind else ''}", suffix=f".{writer_mark()}",
                                 dir=beside.parent))


def _process_start(pid: int) -> float | None:
    """When process ``pid`` of this host started (epoch seconds, from /proc, to about a second); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime, in clock ticks since boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


#: When this process started (the run's start for :func:`remove_dead_temporaries`' age rule).
PROCESS_START = _process_start(os.getpid()) or time.time()


def _pid_is_writer(pid: int, mtime: float) -> bool:
    """Whether a live process ``pid`` of this host may have written a file last modified at ``mtime``: it exists
    and it did not start after that (a pid reused by a later process is not the writer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    started = _process_start(pid)
    return started is None or started <= mtime + _START_SLACK_S


@dataclass(frozen=True)
class Temporary:
    """A temporary file or folder left beside a stage's outputs (:func:`find_temporaries`).

    Attributes:
        path: the file or folder. bytes: what it holds (a folder: its files).
        pid, host: its writer as its name says (None when the name does not say).
        state: ``"dead"`` (its writer is gone: removed), ``"live"`` (its writer runs, or it was written since this
            process started: being written, left alone) or ``"stale"`` (written before this process started by a
            writer that cannot be told from here, another host's or a name without a pid: kept and named).
        why: the reason, for the log (``"pid 123 is not running on node1"``).
    """

    path: Path
    bytes: int
    pid: int | None
    host: str | None
    state: str
    why: str

    @property
    def dead(self) -> bool:
        return self.state == "dead"


def _size(path: Path) -> int:
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        return path.lstat().st_size
    except OSError:  # removed meanwhile
        return 0


def _judge(path: Path, *, started: float, only_writer: bool, by_age: bool) -> Temporary | None:
    marks = list(_TMP_MARK.finditer(path.name))
    pid = int(marks[-1]["pid"]) if marks and marks[-1]["pid"] else None
    host = marks[-1]["host"] if marks else None
    try:
        mtime = path.lstat().st_mtime
    except FileNotFoundError:
        return None
    writer = f"pid {pid} on {host or 'an unnamed host'}" if pid is not None else "an unnamed writer"
    if pid == os.getpid() and host in (None, HOST):
        state, why = "live", "written by this process"
    elif only_writer:
        state, why = "dead", "this process is its folder's only writer"
    elif pid is not None and host == HOST:
        alive = _pid_is_writer(pid, mtime)
        state, why = ("live", f"pid {pid} runs on {HOST}") if alive else ("dead", f"pid {pid} is not running on {HOST}")
    elif mtime >= started:
        state, why = "live", f"{writer}, written since this run started"
    elif by_age:
        state, why = "dead", f"older than this run's start{f' (writer pid {pid} on {host})' if pid else ''}"
    else:
        state, why = "stale", f"{writer}, not known to be gone, last written before this run started"
    return Temporary(path, _size(path), pid, host, state, why)


def find_temporaries(folder: str | os.PathLike, prefixes: Iterable[str] | None = None, *, recursive: bool = False,
                     only_writer: bool = False, by_age: bool = True, started: float | None = None
                     ) -> list[Temporary]:
    """The temporaries in ``folder`` (sorted by path), each judged dead, live or stale (:class:`Temporary`).

    A temporary is a name starting with one of ``prefixes`` (e.g. ``".train.parquet."``, ``".step-"``) that holds a
    writer mark (``.tmp``, ``.tmp-<pid>``, ``.tmp-<pid>@<host>``), or any of the given ``prefixes`` when one ends in
    ``-`` and the name has no mark (older spool folders); with ``prefixes`` None, any name starting with ``.`` that
    holds a mark. ``recursive`` looks in subfolders too (not inside temporary folders).

    In this order: this process's own is live; with ``only_writer`` every other one is dead (no other process writes
    there: the caller holds the folder's writer lock, :func:`lock_folder`, or is the one job Snakemake runs for that
    output folder); one whose name gives a pid of this host is dead when that pid is not running, or runs a process
    started after the file was last written (a reused pid), else live; one whose writer cannot be told (another
    host's, or a name without a pid) is live when written since ``started`` (default: this process's start,
    :data:`PROCESS_START`), else dead with ``by_age`` and stale without. Callers pass ``by_age=False`` where other
    jobs may write beside (a disk check over the whole results folder): only a pid known dead counts there.
    """
    folder = Path(folder)
    started = PROCESS_START if started is None else started
    wanted = tuple(prefixes) if prefixes is not None else None
    found: list[Temporary] = []

    def scan(where: Path) -> None:
        try:
            entries = list(os.scandir(where))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            name = entry.name
            if wanted is None:
                hit = name.startswith(".") and _TMP_MARK.search(name) is not None
            else:
                hit = any(name.startswith(p) and (_TMP_MARK.search(name[len(p):]) is not None or p.endswith("-"))
                          for p in wanted)
            if hit:
                judged = _judge(Path(entry.path), started=started, only_writer=only_writer, by_age=by_age)
                if judged is not None:
                    found.append(judged)
            elif recursive and entry.is_dir(follow_symlinks=False):
                scan(Path(entry.path))

    scan(folder)
    return sorted(found, key=lambda t: str(t.path))


def remove_dead_temporaries(folder: str | os.PathLike, prefixes: Iterable[str] | None = None, *,
                            recursive: bool = False, only_writer: bool = False, by_age: bool = True,
                            started: float | None = None, what: str = "") -> tuple[list[Temporary], list[Temporary]]:
    """Remove the temporaries of dead writers in ``folder`` (:func:`find_temporaries`, same arguments) and log how many,
    their names and bytes (a warning on the ``draftsmith.io`` logger: the job's log); name the stale ones, which are
    kept, in the log too (live ones are being written: left alone). ``what`` names the stage or folder in the
    messages.

    Returns:
        ``(removed, stale)``: the temporaries removed, and those kept that may be a dead writer's (a disk check
        counts their bytes, :func:`temporaries_note`).
    """
    removed, stale = [], []
    for t in find_temporaries(folder, prefixes, recursive=recursive, only_writer=only_writer, by_age=by_age,
                              started=started):
        if t.state == "stale":
            stale.append(t)
        if not t.dead:
            continue
        try:
            if t.path.is_dir() and not t.path.is_symlink():
                shutil.rmtree(t.path)
            else:
                t.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove %s (%s)", t.path, exc)
            stale.append(t)
            continue
        removed.append(t)
    label = f"{what}: " if what else ""
    if removed:
        log.warning("%sremoved %d temporary file(s) of dead writers, %.3f GB: %s", label, len(removed),
                    sum(t.bytes for t in removed) / 1e9, "; ".join(f"{t.path} ({t.bytes:,} bytes, {t.why})"
                                                                   for t in removed))
    if stale:
        log.warning("%skept %d temporary file(s) whose writer may still run, %.3f GB: %s", label, len(stale),
                    sum(t.bytes for t in stale) / 1e9, "; ".join(f"{t.path} ({t.bytes:,} bytes, {t.why})"
                                                                 for t in stale))
    return removed, stale


def temporaries_note(kept: Iterable[Temporary], *, shown: int = 3) -> str:
    """What a disk check adds to its message about temporaries it could not remove: ``""`` when none, else
    ``" N temporary file(s) whose writer may still run hold X GB (a, b, ...): delete them if no run writes
    them."``"""
    kept = list(kept)
    if not kept:
        return ""
    names = ", ".join(str(t.path) for t in kept[:shown]) + (", ..." if len(kept) > shown else "")
    return (f" {len(kept)} temporary file(s) whose writer may still run hold {sum(t.bytes for t in kept) / 1e9:.3f}"
            f" GB ({names}): delete them if no run writes them.")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` if the block succeeds.

    The temporary file (``.<name>.<random>.tmp-<pid>@<host><suffix>``, :func:`writer_mark`) is removed when the block
    raises; those an earlier writer of ``path`` left when it was killed are removed first
    (:func:`remove_dead_temporaries`). ``suffix`` keeps an extension some writers insist on (e.g. ``.parquet``).

    Raises:
        DiskFullError: the disk filled up while writing or renaming (``ENOSPC``): the file and the free bytes named.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path.parent, [f".{path.name}."], what=f"writing {path}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{writer_mark()}{suffix}", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise disk_full(path, exc) from exc
        raise


def save_pretrained_atomic(model: Any, folder: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(folder, **kwargs)`` (a transformers model: ``config.json``, ``model.safetensors``),
    written into a temporary folder beside ``folder`` and each file renamed into ``folder`` only once all are
    written and synced: a save killed midway leaves ``folder``'s earlier files, never a half-written weight file;
    the temporary folder is removed whatever happens (and those of earlier writers killed meanwhile, first:
    :func:`remove_dead_temporaries`). Other files in ``folder`` are kept.

    Raises:
        DiskFullError: the disk filled up while writing (``ENOSPC``): the folder and the free bytes named.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(folder.parent, [f".{folder.name}."], what=f"writing {folder}")
    tmp = temporary_dir(folder)
    try:
        model.save_pretrained(tmp, **kwargs)
        files = sorted(f for f in tmp.iterdir() if f.is_file())
        for f in files:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        folder.mkdir(exist_ok=True)
        for f in files:
            os.replace(f, folder / f.name)
        fsync_dir(folder)
    except BaseException as exc:
        if is_disk_full(exc):  # named under its final name: the temporary folder is removed below
            written = Path(exc.filename) if isinstance(exc, DiskFullError) and exc.filename else None
            name = written.name if written is not None and written.parent == tmp else "model.safetensors"
            cause = exc.__cause__ if isinstance(exc, DiskFullError) and exc.__cause__ is not None else exc
            raise disk_full(folder / name, cause) from cause
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented UTF-8 JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n",
                       encoding="utf-8")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` as UTF-8, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; a parse error names the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def json_list(value: Any, field: str) -> list | None:
    """A list given as itself or as a JSON string (a parquet column, a config value); ``None`` or a blank string
    gives ``None``.

    Raises:
        ValueError: not valid JSON, or not a list (the message names ``field``).
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"field {field}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, list):
        raise ValueError(f"field {field}: expected a JSON list, got {type(value).__name__}")
    return value


class FolderLockedError(RuntimeError):
    """Another live process writes the folder (:func:`lock_folder`); the message names its pid and host."""


#: Folder locks this process holds (path -> fd): kept open for the life of the process.
_FOLDER_LOCKS: dict[str, int] = {}


def lock_folder(folder: str | os.PathLike, *, name: str = "writer.lock", what: str = "folder") -> Path:
    """Make this process the only writer of ``folder``: ``<folder>/<name>`` (created with the folder), ``flock``-ed
    exclusively without waiting, and rewritten to hold this process's pid, host and start time as JSON. The lock
    lasts as long as this process: the kernel drops it when the process exits, killed or not (the file stays; the
    next writer rewrites it). Locking a folder this process already holds does nothing. On a network file system
    the lock is as good as its ``flock`` (NFS v4: held across hosts). Returns the lock file's path.

    Raises:
        FolderLockedError: another process holds the lock; the message names ``what``, the folder, the holder's
            pid and host (as it wrote them) and the lock file.
    """
    folder = Path(folder)
    key = str(folder.resolve())
    path = folder / name
    if key in _FOLDER_LOCKS:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        raise FolderLockedError(
            f"{what} {folder} is written by another run: pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} holds {path}. Two writers would mix their files: wait for it or end it "
            "(the lock goes with its process)") from None
    from datetime import datetime, timezone

    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _FOLDER_LOCKS[key] = fd
    return path


def folder_lock_holder(folder: str | os.PathLike, *, name: str = "writer.lock") -> dict | None:
    """Who holds ``folder``'s writer lock (:func:`lock_folder`), without taking it: the holder's record (``pid``,
    ``host``, ``started_utc``; ``{}`` when unreadable) while a live process holds it, None when none does or the
    folder has no lock file."""
    try:
        fd = os.open(Path(folder) / name, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holds_lock(folder: str | os.PathLike) -> bool:
    """Whether this process holds ``folder``'s writer lock (:func:`lock_folder`)."""
    return str(Path(folder).resolve()) in _FOLDER_LOCKS


def sha256_file(path: str | os.PathLike, *, bufsize: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(bufsize):
            digest.update(block)
    return digest.hexdigest()


def setup_logging(log_file: str | os.PathLike | None = None, level: int = logging.INFO, *,
                  append: bool = False) -> logging.Logger:
    """Log to ``log_file`` (Snakemake's ``log:``; rewritten, or with ``append`` added to: a job's worker
    processes) and stderr; returns the ``draftsmith`` logger.

    An exception that ends the process is logged too, with its traceback (:func:`log_uncaught`), so a failed
    job's own log says why it failed, not only the console Snakemake ran it from.
    """
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="a" if append else "w", encoding="utf-8"))
    logging.basicConfig(level=level, handlers=handlers, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.excepthook = log_uncaught
    return logging.getLogger("draftsmith")


def log_uncaught(exc_type, exc, tb) -> None:
    """``sys.excepthook`` of the stage scripts: the uncaught exception and its traceback go to every logging
    handler (the job's log file and stderr), once. Ctrl-C keeps Python's default report."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("draftsmith").critical("the job failed: %s: %s", exc_type.__name__, exc,
                                             exc_info=(exc_type, exc, tb))


# -- target folders (no torch: Snakemake checks them while it builds the DAG) --------------------------------

def check_model_folder(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` is a local Hugging Face model folder.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: it exists but has no ``config.json`` or no weights.
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"target model folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder: no config.json in it")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"{folder} has a config.json but no *.safetensors weights")
    return folder


def target_fingerprint(target_dir: str | os.PathLike) -> str:
    """A cheap, deterministic fingerprint of a target folder (not a full content hash); shared by
    extract (manifests), regenerate and evaluate (resume keys).

    sha256 over ``config.json`` and, for every ``*.safetensors`` file (sorted by name), its name, size,
    and its first and last MiB (the header with every tensor's name, dtype, shape and offsets, plus
    weight bytes). Hashing tens of GB of weights per shard job would cost minutes.
    """
    folder = check_model_folder(target_dir)
    digest = hashlib.sha256()
    digest.update((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                digest.update(fh.read(1 << 20))
    return digest.hexdigest()
