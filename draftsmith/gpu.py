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

Two ways to use it::

    python -m draftsmith.gpu --gpus 2 -- torchrun --nproc-per-node 2 -m draftsmith.train ...

    from draftsmith.gpu import lease_gpus
    devices = lease_gpus(1)   # before torch initialises CUDA; sets CUDA_VISIBLE_DEVICES

On a machine without GPUs the pool is empty: the lease logs a warning and the job runs on the CPU
(``CUDA_VISIBLE_DEVICES=""``).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

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


def lease_gpus(n: int, *, logger: logging.Logger | None = None, job: str | None = None,
               record: str | os.PathLike | None = None) -> list[str]:
    """Lease ``n`` GPUs for the rest of this process and export ``CUDA_VISIBLE_DEVICES``.

    Call before anything initialises CUDA. Returns the device ids (``[]`` on a CPU-only machine,
    after logging a warning: the job then runs on the CPU). With ``record`` (the workflow passes
    :data:`LEASE_LOG`), the lease and its release at process exit are appended there under ``job``'s name
    (:func:`record_lease`; a killed process leaves no release line).
    """
    logger = logger or log
    t0 = time.monotonic()
    lease = acquire(n)
    waited = time.monotonic() - t0
    _HELD.append(lease)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(lease.devices)
    if n > 0 and not lease.devices:
        logger.warning("no GPU found (CUDA_VISIBLE_DEVICES unset and no nvidia-smi devices): "
                       "this GPU job runs on the CPU")
    else:
        logger.info("leased GPU(s) %s after waiting %.1f s", ",".join(lease.devices) or "none", waited)
    if record is not None and n > 0:
        import atexit

        name, record = job or os.path.basename(sys.argv[0]), os.path.abspath(record)
        record_lease(record, "leased", name, lease.devices, waited)
        held_from = time.monotonic()
        atexit.register(lambda: record_lease(record, "released", name, lease.devices, time.monotonic() - held_from))
    return lease.devices


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
        log.warning("no GPU found: running %s on the CPU", cmd[0])
    else:
        log.info("leased GPU(s) %s for %s", env["CUDA_VISIBLE_DEVICES"] or "none", cmd[0])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)  # the lock fds are inheritable: the command now holds the lease


if __name__ == "__main__":
    sys.exit(main())
