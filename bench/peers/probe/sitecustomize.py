"""A passive step probe for the peer benchmark, the same for every trainer (draftsmith, speculators, SpecForge): on
``PYTHONPATH`` with ``PEERS_PROBE=<file>`` set, each Python process of the run appends one JSON line per optimizer
step to ``<file>.<pid>``:

``{"step": k, "t": seconds since the process started, "wall": unix time, "opt": optimizer class,
"opt_s": seconds in optimizer steps since the last record, "mem_alloc_gib": torch.cuda.max_memory_allocated,
"mem_reserved_gib": torch.cuda.max_memory_reserved}``

It registers torch's global optimizer step pre and post hooks (``torch.optim.optimizer.
register_optimizer_step_pre_hook`` / ``register_optimizer_step_post_hook``, public API) and, for the times,
synchronises the GPU before and after each optimizer step (every trainer here already synchronises each logged step;
the extra sync before the step waits for the backward pass, which the step needs anyway). A trainer with two
optimizers stepping together (speculators' Muon + AdamW) counts the optimizer that stepped first as the step; ``opt_s``
then holds the second optimizer's time of the step before and the first one's of this step, which in a steady run is
one step's optimizer time. Nothing else of the trainer is touched; without ``PEERS_PROBE`` this file does nothing.
"""

import os

_OUT = os.environ.get("PEERS_PROBE")

if _OUT:
    import atexit
    import json
    import time

    def _process_start() -> float:
        """The process's start as a unix time (Linux /proc), else now."""
        try:
            with open("/proc/self/stat") as fh:
                ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as fh:
                boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
            return boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, StopIteration, IndexError):
            return time.time()

    _START = _process_start()
    _state = {"first": None, "steps": 0, "fh": None, "installed": False, "t_pre": None, "opt_s": 0.0}

    def _write(record: dict) -> None:
        if _state["fh"] is None:
            _state["fh"] = open(f"{_OUT}.{os.getpid()}", "a", buffering=1)
            _state["fh"].write(json.dumps({"event": "start", "wall": _START, "pid": os.getpid(),
                                           "argv": __import__("sys").argv[:3]}) + "\n")
        _state["fh"].write(json.dumps(record) + "\n")

    def _cuda() -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _pre_hook(optimizer, args, kwargs) -> None:
        import torch

        if _cuda():
            torch.cuda.synchronize()
        _state["t_pre"] = time.time()

    def _hook(optimizer, args, kwargs) -> None:
        import torch

        key = id(optimizer)
        if _state["first"] is None:
            _state["first"] = key
        cuda = _cuda()
        if cuda:
            torch.cuda.synchronize()
        now = time.time()
        if _state["t_pre"] is not None:
            _state["opt_s"] += now - _state["t_pre"]
            _state["t_pre"] = None
        if key != _state["first"]:
            return
        _state["steps"] += 1
        opt_s, _state["opt_s"] = _state["opt_s"], 0.0
        _write({"step": _state["steps"], "t": now - _START, "wall": now, "opt": type(optimizer).__name__,
                "opt_s": opt_s,
                "mem_alloc_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
                "mem_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None})

    def _install() -> bool:
        """Register the hook once torch.optim is importable (torch imported by the trainer)."""
        if _state["installed"]:
            return True
        import sys

        if "torch" not in sys.modules:
            return False
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_pre_hook)
        register_optimizer_step_post_hook(_hook)
        _state["installed"] = True
        return True

    class _Finder:
        """Installs the hook at the first import after ``torch.optim.optimizer`` is loaded (a meta-path finder that
        never finds anything itself)."""

        def find_spec(self, name, path=None, target=None):
            if not _state["installed"] and "torch.optim.optimizer" in __import__("sys").modules:
                _install()
            return None

    import sys as _sys

    _sys.meta_path.insert(0, _Finder())

    def _close() -> None:
        _install()
        if _state["fh"] is not None:
            _write({"event": "exit", "t": time.time() - _START, "steps": _state["steps"]})
            _state["fh"].close()

    atexit.register(_close)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (an image's own, which this file shadows), if any."""
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain()
