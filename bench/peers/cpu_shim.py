"""Run a peer trainer's module on a machine without an accelerator, for the CPU smoke test only (never on the GPU).

speculators 0.9.0's trainer moves the model and every batch to ``local_rank`` (an int: the accelerator of that
index) and synchronises the accelerator when it times a step (``speculators/train/trainer.py``: ``setup_model``,
``train_epoch``, ``_StepTimer``) and autocasts on ``"cuda"``; on a CPU-only torch that raises "Cannot access
accelerator device when none is available". This shim maps an integer device to the CPU, makes accelerator
synchronisation a no-op and turns ``torch.autocast("cuda", ...)`` into ``torch.autocast("cpu", ...)`` (the same
bf16 autocast, on the CPU), then runs the module as ``python -m`` would. Nothing of the peer's code is changed or
copied. ``torch.optim.Muon``'s Newton-Schulz iterations run in float32 here, as draftsmith's trainer runs them off
the GPU (``draftsmith.train.muon.ShardedMuon``'s ``ns_dtype``): a CPU without bf16 instructions emulates the bf16
products (bench/bench_muon.py: 32.8x float32's time for the CPU default's matrices, 2026-12-05), and a CPU-scale
comparison should differ in neither speed nor precision there.

    python bench/peers/cpu_shim.py speculators.train --verifier-name-or-path ... (the trainer's flags)
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.optim import _muon

if torch.cuda.is_available():
    raise SystemExit("cpu_shim.py is for machines without a GPU: run the peer's module directly")


def _cpu(args, kwargs):
    args = tuple("cpu" if isinstance(a, int) and not isinstance(a, bool) else a for a in args)
    if isinstance(kwargs.get("device"), int):
        kwargs = dict(kwargs, device="cpu")
    return args, kwargs


_module_to, _tensor_to = nn.Module.to, torch.Tensor.to


def module_to(self, *args, **kwargs):
    args, kwargs = _cpu(args, kwargs)
    return _module_to(self, *args, **kwargs)


def tensor_to(self, *args, **kwargs):
    args, kwargs = _cpu(args, kwargs)
    return _tensor_to(self, *args, **kwargs)


class _Autocast(torch.autocast):
    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _draftsmith_muon():
    """draftsmith/train/muon.py loaded by its path (it imports torch only): the peer's Python has nothing else of
    this checkout on its path."""
    path = Path(__file__).resolve().parents[2] / "draftsmith" / "train" / "muon.py"
    spec = importlib.util.spec_from_file_location("draftsmith_muon", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_orthogonalize = _draftsmith_muon().orthogonalize


def _newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz (torch 2.13's signature) as draftsmith's orthogonalize in
    float32."""
    return _orthogonalize(grad, ns_coefficients, ns_steps, eps, torch.float32)


_muon._zeropower_via_newtonschulz = _newton_schulz_float32
nn.Module.to = module_to
torch.Tensor.to = tensor_to
torch.accelerator.synchronize = lambda *a, **k: None
torch.autocast = _Autocast

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
