"""Run a peer trainer's module on a machine without an accelerator, for the CPU smoke test only (never on the GPU).

speculators 0.9.0's trainer moves the model and every batch to ``local_rank`` (an int: the accelerator of that
index) and synchronises the accelerator when it times a step (``speculators/train/trainer.py``: ``setup_model``,
``train_epoch``, ``_StepTimer``) and autocasts on ``"cuda"``; on a CPU-only torch that raises "Cannot access
accelerator device when none is available". This shim maps an integer device to the CPU, makes accelerator
synchronisation a no-op and turns ``torch.autocast("cuda", ...)`` into ``torch.autocast("cpu", ...)`` (the same
bf16 autocast, on the CPU), then runs the module as ``python -m`` would. Nothing of the peer's code is changed or
copied.

    python bench/peers/cpu_shim.py speculators.train --verifier-name-or-path ... (the trainer's flags)
"""

from __future__ import annotations

import runpy
import sys

import torch
from torch import nn

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


nn.Module.to = module_to
torch.Tensor.to = tensor_to
torch.accelerator.synchronize = lambda *a, **k: None
torch.autocast = _Autocast

if __name__ == "__main__":
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
