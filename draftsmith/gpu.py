"""Node-local GPU leases for Snakemake jobs.

Snakemake 9 only *counts* ``resources: gpu=N``; it never tells a job which devices it got. Picking
``shard % ngpus`` collides and "least busy GPU" races, so every GPU job leases device ids from a
node-local pool of lock files instead:

* one ``flock`` file per device (``gpu-<id>.lock``) in ``DRAFTSMITH_GPU_LOCK_DIR``
  (default ``/tmp/draftsmith-gpu-locks-<uid>``, i.e. on local disk, one pool per node and user);
* a pool mutex (``pool.lock``) held while a lease is being assembled, so an N-GPU lease is atomic:
  it gets all N devices or none, and two multi-GPU jobs can never deadlock holding halves;
* the pool is ``CUDA_VISIBLE_DEVICES`` when set (SLURM sets it per allocation) and the devices listed
  by ``nvidia-smi -L`` otherwise;
* the lock file descriptors are inherited by the job (``exec`` into the command, or held by the
  current process for in-process leases), so the lease lives exactly as long as the job's processes
  and the kernel frees it the moment they exit, killed or not.

A job's own processes (torchrun and its trainers, evaluate's decoding workers) are started with :func:`spawn`, so
that none outlives the job and none runs on a device the job no longer holds:

* each child gets the job's lock fds (``pass_fds``): it holds the lease too, and the devices stay leased until the
  last holder exits (an orphaned child keeps its devices, so the next job can never be given them);
* each child runs in its own session (process group); at exit, and on SIGTERM / SIGINT (handlers :func:`spawn`
  installs), the job ends every child and every descendant it can find (``/proc``): SIGTERM, then SIGKILL after
  :data:`END_GRACE_S` seconds (:func:`end_children`);
* a job killed with SIGKILL runs no handler: on Linux each child asked the kernel for SIGKILL when the job dies
  (``prctl(PR_SET_PDEATHSIG)`` through ctypes, before ``exec``), and torchrun's trainers ask the same of torchrun
  (:func:`die_with_parent`, which ``python -m draftsmith.train`` calls under torchrun: torchrun starts them in
  sessions of their own, without the lock fds). ``PR_SET_PDEATHSIG`` fires when the *thread* that started the
  child exits: :func:`spawn` is called from the main thread. Elsewhere than Linux only the handlers apply.

GPU rules that get no usable device stop, naming why (:func:`check_devices`), unless the rule asks for none
(``gpus: 0``) or the config allows the CPU (``gpu.cpu_fallback``, the CPU default's setting).

Two ways to use it::

    python -m draftsmith.gpu --gpus 2 -- torchrun --nproc-per-node 2 -m draftsmith.train ...

    from draftsmith.gpu import lease_gpus
    devices = lease_gpus(1)   # before torch initialises CUDA; sets CUDA_VISIBLE_DEVICES

With ``python -m draftsmith.gpu`` a machine without GPUs gives an empty pool: the command runs on the CPU
(``CUDA_VISIBLE_DEVICES=""``) after a warning.
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from draftsmith.settings import SectionSettings

log = logging.getLogger("draftsmith.gpu")

_HELD: list["Lease"] = []  # in-process leases stay alive for the life of the process


class GpuLeaseError(RuntimeError):
    """A lease that can never be granted (more devices asked for than the pool has)."""


@dataclass
class Lease:
    """Devices held by this process. ``fds`` are open, ``flock``-ed and inheritable."""

    devices: list[str]
    fds: list[int] = field(default_factory=list)

    def release(self) -> None:
        """Release early (normally the kernel does it when the process exits)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def lock_dir() -> str:
    """Folder of the lock files: ``$DRAFTSMITH_GPU_LOCK_DIR`` or ``/tmp/draftsmith-gpu-locks-<uid>``."""
    return os.environ.get("DRAFTSMITH_GPU_LOCK_DIR") or f"/tmp/draftsmith-gpu-locks-{os.getuid()}"


def device_pool() -> list[str]:
    """Device ids this node may hand out, in order.

    ``CUDA_VISIBLE_DEVICES`` wins when set (an empty value means no GPU); otherwise the indices
    printed by ``nvidia-smi -L``; otherwise an empty list.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def _open_lock(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    os.set_inheritable(fd, True)
    return fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def acquire(n: int, *, pool: list[str] | None = None, poll_s: float = 0.2,
            timeout_s: float | None = None) -> Lease:
    """Lease ``n`` devices from the node pool, all or nothing, waiting until they are free.

    Args:
        n: number of devices (>= 0).
        pool: device ids to lease from; default :func:`device_pool`.
        poll_s: seconds between attempts while the pool is busy.
        timeout_s: give up after this many seconds (``None`` waits forever).

    Returns:
        A :class:`Lease` whose inheritable fds hold the device locks; ``devices == []`` when the
        pool is empty (no GPU on this machine: the caller runs on the CPU).

    Raises:
        GpuLeaseError: ``n`` exceeds the pool size (it could never be granted).
        TimeoutError: ``timeout_s`` passed before ``n`` devices were free together.
    """
    if n < 0:
        raise GpuLeaseError(f"cannot lease a negative number of GPUs ({n})")
    pool = device_pool() if pool is None else pool
    if n == 0 or not pool:
        return Lease(devices=[])
    if n > len(pool):
        raise GpuLeaseError(
            f"this job asks for {n} GPUs but the node's pool has {len(pool)} "
            f"({', '.join(pool)}; from "
            f"{'CUDA_VISIBLE_DEVICES' if 'CUDA_VISIBLE_DEVICES' in os.environ else 'nvidia-smi -L'})"
        )
    folder = lock_dir()
    os.makedirs(folder, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        mutex = os.open(os.path.join(folder, "pool.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)
            got: list[tuple[str, int]] = []
            for dev in pool:
                fd = _open_lock(os.path.join(folder, f"gpu-{dev}.lock"))
                if _try_lock(fd):
                    got.append((dev, fd))
                    if len(got) == n:
                        break
                else:
                    os.close(fd)
            if len(got) == n:
                lease = Lease(devices=[d for d, _ in got], fds=[fd for _, fd in got])
                return lease
            for _, fd in got:  # not enough free devices: take none
                os.close(fd)
        finally:
            os.close(mutex)  # closing the fd drops the pool mutex
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {n} free GPUs among {pool} after {timeout_s} s")
        time.sleep(poll_s)


#: Where the workflow's GPU jobs record their leases (relative to the working directory): one line when a job
#: gets its devices, one when it releases them, so a run's log shows which GPU ran which job and when.
LEASE_LOG = "logs/gpu-leases.tsv"
_LEASE_LOG_HEADER = "time_utc\tevent\tjob\tgpus\thost\tpid\tseconds\n"


def record_lease(path: str | os.PathLike, event: str, job: str, devices: list[str], seconds: float) -> None:
    """Append one line to the lease log ``path`` (TSV with a header; created with its folder): ``event`` is
    ``leased`` (``seconds`` = time waited for free devices) or ``released`` (``seconds`` = time held). One
    ``O_APPEND`` write per line, so concurrent jobs on the node never interleave within a line."""
    import socket
    from datetime import datetime, timezone

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = "\t".join([datetime.now(timezone.utc).isoformat(timespec="milliseconds"), event, job,
                      ",".join(devices) or "cpu", socket.gethostname(), str(os.getpid()), f"{seconds:.1f}"]) + "\n"
    try:  # the job that creates the file writes the header (O_EXCL: exactly one of several starting at once)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666)
        line = _LEASE_LOG_HEADER + line
    except FileExistsError:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class GpuOptions(SectionSettings):
    """The ``gpu`` section, which every GPU rule reads: ``cpu_fallback`` (run on the CPU, with a warning, when no
    GPU is usable, instead of stopping; :func:`lease_gpus`)."""

    SECTION: ClassVar[str] = "gpu"
    cpu_fallback: bool


class GpuUnavailableError(RuntimeError):
    """A job asks for GPUs and gets none it can use (no device in the pool, torch built without CUDA, devices
    torch cannot see), and the config does not allow the CPU."""


def _no_pool_reason() -> str:
    """Why :func:`device_pool` is empty, in words."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return f"CUDA_VISIBLE_DEVICES is {env!r}, which names no device"
    if shutil.which("nvidia-smi") is None:
        return "CUDA_VISIBLE_DEVICES is not set and there is no nvidia-smi on the PATH (no NVIDIA driver)"
    return "CUDA_VISIBLE_DEVICES is not set and nvidia-smi -L lists no GPU"


def unusable_reason(devices: list[str]) -> str | None:
    """Why torch cannot run on ``devices`` (leased ids, already exported as ``CUDA_VISIBLE_DEVICES``), or None
    when it can: torch built without CUDA, or fewer devices visible to torch than leased (ids the driver does not
    know, or a driver that does not start). Imports torch; counts devices (``torch.cuda.device_count``) without
    creating a CUDA context, so CUDA still starts later on exactly these devices."""
    if not devices:
        return _no_pool_reason()
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None) although "
                f"CUDA_VISIBLE_DEVICES={','.join(devices)}: install a CUDA build of torch")
    seen = torch.cuda.device_count()
    if seen < len(devices):
        return (f"CUDA_VISIBLE_DEVICES={','.join(devices)} but torch sees {seen} CUDA device(s) "
                f"(ids the driver does not know, or a driver that does not start)")
    return None


def lease_gpus(n: int, *, logger: logging.Logger | None = None, job: str | None = None,
               record: str | os.PathLike | None = None, cpu_fallback: bool = False,
               gpus_key: str | None = None) -> list[str]:
    """Lease ``n`` GPUs for the rest of this process and export ``CUDA_VISIBLE_DEVICES``; stop when the job
    cannot use them.

    Call before anything initialises CUDA. Returns the device ids; ``[]`` for ``n == 0`` (the config asks for the
    CPU: ``CUDA_VISIBLE_DEVICES=""``). With ``record`` (the workflow passes :data:`LEASE_LOG`), the lease and its
    release at process exit are appended there under ``job``'s name (:func:`record_lease`; a killed process
    leaves no release line). Processes the job starts with :func:`spawn` hold the lease too.

    Args:
        cpu_fallback: ``gpu.cpu_fallback``: with no usable GPU, log a warning with the reason and run on the CPU
            (devices leased are kept, unused) instead of stopping.
        gpus_key: the config key that sets ``n`` (``train.gpus``), named by the error as a way to the CPU; ``None``
            for jobs that always ask for one GPU (extraction), whose error names ``gpu.cpu_fallback`` only.

    Raises:
        GpuUnavailableError: ``n > 0``, no usable GPU (:func:`unusable_reason` says why: an empty pool, torch built
            without CUDA, devices torch cannot see) and not ``cpu_fallback``; the message names the reason and
            the ways to run on the CPU on purpose.
        GpuLeaseError: ``n`` exceeds the pool.
    """
    logger = logger or log
    t0 = time.monotonic()
    lease = acquire(n)
    waited = time.monotonic() - t0
    _HELD.append(lease)
    empty_pool = _no_pool_reason() if n > 0 and not lease.devices else None  # before the export below
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(lease.devices)
    if n > 0:
        reason = empty_pool or unusable_reason(lease.devices)
        if reason is not None and not cpu_fallback:
            lease.release()
            name = job or os.path.basename(sys.argv[0])
            ways = (f"{gpus_key}: 0, or gpu.cpu_fallback: true (the CPU default's)" if gpus_key else
                    f"gpu.cpu_fallback: true (the CPU default's; {name} always asks for one GPU)")
            raise GpuUnavailableError(f"{name} asks for {n} GPU(s) but can use none: {reason}. Run on the CPU on "
                                      f"purpose with {ways}")
        if reason is not None:
            logger.warning("no usable GPU (%s): this GPU job runs on the CPU (gpu.cpu_fallback)", reason)
        else:
            logger.info("leased GPU(s) %s after waiting %.1f s", ",".join(lease.devices), waited)
    else:
        logger.info("no GPU asked for (gpus: 0): this job runs on the CPU")
    if record is not None and n > 0:
        name, record = job or os.path.basename(sys.argv[0]), os.path.abspath(record)
        record_lease(record, "leased", name, lease.devices, waited)
        held_from = time.monotonic()
        atexit.register(lambda: record_lease(record, "released", name, lease.devices, time.monotonic() - held_from))
    return lease.devices


# -- the job's processes: they hold its lease and end with it (module docstring) ---------------------------------

#: Seconds between the SIGTERM and the SIGKILL with which a job ends its processes.
END_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_CHILDREN: list[subprocess.Popen] = []
_HANDLERS: list[int] = []  # signals whose handler is installed


def _prctl():
    """libc's ``prctl`` through ctypes on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``);
    when the parent is already gone (this process was reparented before the request), send it now. ``python -m
    draftsmith.train`` calls it under torchrun, whose trainers would otherwise outlive a killed torchrun. Returns
    False where the kernel offers no such request (not Linux)."""
    prctl = _prctl()
    parent = os.getppid()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)
    return True


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, their children, ...), read from ``/proc`` (Linux; ``[]``
    elsewhere). Processes already reparented away from the tree are not found: :func:`die_with_parent` ends
    those."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        if os.path.isdir("/proc/self"):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _signal_all(procs: list[subprocess.Popen], others: list[int], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)  # its session's process group (it leads it: start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
    for pid in others:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_children(grace_s: float | None = None) -> list[int]:
    """End every process this job started with :func:`spawn` and every descendant of theirs: SIGTERM to each
    child's process group and each descendant, then SIGKILL to whatever still runs after ``grace_s`` seconds
    (default :data:`END_GRACE_S`); reap the children. Returns the pids that were running. Runs at exit and on
    SIGTERM / SIGINT once :func:`spawn` was called."""
    grace_s = END_GRACE_S if grace_s is None else grace_s
    procs = [p for p in _CHILDREN if p.poll() is None]  # not reaped: their pids are still theirs
    others = sorted({d for p in procs for d in descendants(p.pid)})
    running = [p.pid for p in procs] + others
    if not running:
        return []
    log.warning("ending this job's processes %s (SIGTERM, SIGKILL after %.0f s)", running, grace_s)
    _signal_all(procs, others, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) and not any(_alive(pid) for pid in others):
            break
        time.sleep(0.05)
    else:
        _signal_all(procs, [pid for pid in others if _alive(pid)], signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("process %d did not exit after SIGKILL", proc.pid)
    return running


def _on_signal(signum: int, frame) -> None:
    end_children()
    raise SystemExit(128 + signum)  # unwinds the job (atexit runs: the lease log's release line)


def _install_handlers() -> None:
    if _HANDLERS:
        return
    atexit.register(end_children)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)
            _HANDLERS.append(sig)
    else:
        _HANDLERS.append(0)


def spawn(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``cmd`` (``subprocess.Popen(cmd, **popen_kwargs)``) as a process of this job, one that cannot outlive
    it: it inherits the lock fds of this process's leases (it holds the lease too), runs in a session of its own,
    gets SIGKILL from the kernel if this process dies (Linux ``PR_SET_PDEATHSIG``, set before ``exec``; call from
    the main thread, as that signal follows the thread that started it), and is ended with its descendants at
    exit and on SIGTERM / SIGINT (:func:`end_children`; handlers installed on the first call)."""
    _install_handlers()
    fds = tuple(fd for lease in _HELD for fd in lease.fds) + tuple(popen_kwargs.pop("pass_fds", ()))
    prctl, parent = _prctl(), os.getpid()

    def in_child() -> None:  # after fork, before exec
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the job died in between: the request above came too late
            os._exit(1)

    proc = subprocess.Popen(cmd, pass_fds=fds, start_new_session=True, preexec_fn=in_child, **popen_kwargs)
    _CHILDREN.append(proc)
    return proc


def capture_graph(device, run, failures: dict, key, what: str, reset=lambda: None,
                  logger: logging.Logger | None = None):
    """``run()`` captured as a CUDA graph on ``device`` (a ``torch.device``): two warm-up runs on a side stream first
    (``torch.cuda.graphs`` requires them; Triton autotuning happens there), ``reset()`` before each run and before
    the capture (outside it: what ``reset`` does is not recorded, and the capture itself executes nothing, so the
    state afterwards is what ``reset`` made). Returns ``(graph, run()'s output tensors from the capture)``; on
    failure records ``failures[key]``, logs once to ``logger`` that ``what`` runs eagerly (the traceback at DEBUG
    level), calls ``reset()`` and returns None. Shared by evaluate's static decoding and regenerate's decode step.
    """
    import torch

    logger = logger or log
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                reset()
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        reset()
        with torch.cuda.graph(graph):
            out = run()
    except Exception as exc:  # what cannot be captured runs eagerly
        failures[key] = f"{type(exc).__name__}: {exc}"
        logger.warning("CUDA graph capture of %s failed (%s): it runs eagerly", what, failures[key])
        logger.debug("CUDA graph capture of %s failed", what, exc_info=True)
        torch.cuda.synchronize(device)
        reset()
        return None
    return graph, out


def log_peak_memory(logger: logging.Logger | None = None) -> dict[str, float]:
    """Log (and return, GiB by device) the peak GPU memory torch allocated in this process on each visible
    device (``torch.cuda.max_memory_allocated``) and that device's total. Nothing when torch never used CUDA
    here (torch is not imported by this module: the lease runs before it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    peaks = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2 ** 30 for i in range(torch.cuda.device_count())}
    totals = [torch.cuda.get_device_properties(i).total_memory / 2 ** 30 for i in range(torch.cuda.device_count())]
    (logger or log).info("peak GPU memory: %s", ", ".join(f"{d} {p:.1f} GiB of {t:.0f}"
                                                         for (d, p), t in zip(peaks.items(), totals)))
    return peaks


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.gpu --gpus N -- CMD ...``: lease N GPUs, then exec CMD holding them."""
    parser = argparse.ArgumentParser(prog="python -m draftsmith.gpu", description=main.__doc__)
    parser.add_argument("--gpus", type=int, required=True, help="devices to lease")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait at most")
    parser.add_argument("--cpu-fallback", action="store_true",
                        help="with no GPU in the pool, run CMD on the CPU (a warning) instead of stopping")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("no command given after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        lease = acquire(args.gpus, timeout_s=args.timeout)
    except (GpuLeaseError, TimeoutError) as exc:
        print(f"draftsmith.gpu: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(lease.devices),
               DRAFTSMITH_GPU_LEASE=",".join(lease.devices) or "cpu")
    if args.gpus > 0 and not lease.devices:
        if not args.cpu_fallback:
            print(f"draftsmith.gpu: {cmd[0]} asks for {args.gpus} GPU(s) but the pool has none: "
                  f"{_no_pool_reason()} (--cpu-fallback runs it on the CPU)", file=sys.stderr)
            return 2
        log.warning("no GPU found (%s): running %s on the CPU", _no_pool_reason(), cmd[0])
    else:
        log.info("leased GPU(s) %s for %s", env["CUDA_VISIBLE_DEVICES"] or "none", cmd[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)  # the lock fds are inheritable: the command now holds the lease


if __name__ == "__main__":
    sys.exit(main())
