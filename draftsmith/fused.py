"""Fused kernels for the target's forward pass during extraction (GPU).

Profiling the hidden-state extraction of a Qwen3.5-27B-shaped target (bench/bench_extract.py ``--profile``,
docs/measurements.md) put little more than half of the GPU time in GEMMs: most of the rest went to small
elementwise kernels around them (RMSNorm in float32 as a chain of 6-9 kernels, SiLU and the gate product of the
MLPs, dtype copies) and the depthwise causal conv1d of the Gated DeltaNet layers, which transformers runs as a
torch fallback (``F.conv1d`` on a transposed view, then slice, SiLU and three layout copies) unless the
``causal_conv1d`` CUDA package is installed. This module removes that overhead without changing the model's code:

* :func:`compile_elementwise` compiles (``torch.compile``, inductor) the ``forward`` of every norm and
  MLP module of the target -- the model's own code, so the same formula, fused into one or two kernels.
  One compiled function per module class, shared by all its instances (parameters are graph inputs),
  automatic dynamic shapes (the first batch compiles static, the first new shape recompiles with the
  batch and sequence dims symbolic).
* :func:`fla_causal_conv1d` routes transformers' ``causal_conv1d_fn`` of the GDN modeling files to
  flash-linear-attention's Triton ``causal_conv1d``, which reads the strided layout directly.

Both are scoped (:func:`fused_target` is a context manager that undoes them) and only change rounding:
the same float32 arithmetic in a different kernel order. On float32 tiny targets the fused features
equal the eager ones within 1e-5 (tests/test_fused.py); the GPU figures are in docs/measurements.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import time
import types
from collections import Counter
from typing import Iterator

import torch
from torch import nn

from draftsmith.target import fla_available

log = logging.getLogger("draftsmith.fused")

# module classes whose forward is a pure elementwise / reduction chain (plus the MLP's own GEMMs)
FUSED_CLASS_SUFFIXES = ("RMSNorm", "RMSNormGated", "LayerNorm", "MLP")
# transformers' modeling files that call a module-level ``causal_conv1d_fn(x [B, D, T], weight [D, W], ...)``
CONV1D_FN = "causal_conv1d_fn"


def _fusable(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith(FUSED_CLASS_SUFFIXES)


def compile_elementwise(model: nn.Module, *, dynamic: bool | None = None) -> Counter:
    """Compile the ``forward`` of the target's norm and MLP modules in place, one function per class.

    Matches transformers classes whose name ends with one of :data:`FUSED_CLASS_SUFFIXES` (e.g.
    ``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``, ``LlamaMLP``). Each instance's ``forward`` becomes the
    class's compiled ``forward`` bound to it; :func:`restore_elementwise` undoes it. Compilation happens
    lazily on the first call (seconds per class, more on a large model's first batch).

    Args:
        model: the target (any device; inductor needs a C compiler on CPU, Triton on CUDA).
        dynamic: passed to ``torch.compile``; ``None`` = automatic dynamic shapes.
    Returns:
        ``Counter`` of class name -> instances compiled.
    """
    compiled: dict[type, object] = {}
    counts: Counter = Counter()
    for module in model.modules():
        if not _fusable(module) or "forward" in module.__dict__:
            continue
        cls = type(module)
        if cls not in compiled:
            # emulate_precision_casts: round where eager rounds (e.g. Qwen3.5's gated norm casts to bf16
            # between float32 steps), so a bf16 target gives eager's features, not more precise ones
            compiled[cls] = torch.compile(cls.forward, dynamic=dynamic,
                                          options={"emulate_precision_casts": True})
        module.forward = types.MethodType(compiled[cls], module)
        module._draftsmith_compiled = True
        counts[cls.__name__] += 1
    if counts:
        # a class compiles once per input rank / layout / dtype, then once more with dynamic batch and
        # sequence dims (Qwen3.5's RMSNorm: hidden states, strided q and contiguous k heads -> ~6 entries);
        # past the limit dynamo silently runs eager, so leave room for models that reuse a class more
        dynamo_config = torch._dynamo.config
        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    return counts


def restore_elementwise(model: nn.Module) -> None:
    """Undo :func:`compile_elementwise` (the modules call their class's eager ``forward`` again)."""
    for module in model.modules():
        if module.__dict__.pop("_draftsmith_compiled", False):
            module.__dict__.pop("forward", None)


def _conv1d_modules(model: nn.Module) -> list[types.ModuleType]:
    """The modeling modules of ``model``'s submodules that define ``causal_conv1d_fn``."""
    found = []
    for module in model.modules():
        mod = sys.modules.get(type(module).__module__)
        if mod is not None and callable(getattr(mod, CONV1D_FN, None)) and mod not in found:
            found.append(mod)
    return found


def fla_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` contract on flash-linear-attention's Triton kernel.

    Args:
        hidden_states: ``[B, D, T]`` (usually a transposed view of a contiguous ``[B, T, D]``), CUDA.
        weight: ``[D, W]`` depthwise kernel; bias ``[D]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
    Returns:
        ``[B, D, T]`` in the input dtype: ``y[b, d, t] = act(bias[d] + sum_k weight[d, k] x[b, d, t - W + 1 + k])``
        with zeros before t = 0 (causal; right padding never reaches a real position).
    Raises:
        NotImplementedError: packed sequences (``seq_idx`` / ``cu_seqlens``), which this path does not take.
    """
    from fla.modules.causal_conv1d import causal_conv1d

    if any(kwargs.get(k) is not None for k in ("seq_idx", "cu_seqlens", "cu_seq_lens_q")):
        raise NotImplementedError("fla_conv1d_fn: packed sequences are not supported")
    out, _ = causal_conv1d(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
    return out.transpose(1, 2)


@contextlib.contextmanager
def fla_causal_conv1d(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, transformers' GDN layers of ``model`` use :func:`fla_conv1d_fn` for their conv1d.

    Patches the module-level ``causal_conv1d_fn`` of each modeling file ``model`` uses (Qwen3.5, Qwen3-Next,
    ...), and restores it on exit. Yields the patched module names (empty when flash-linear-attention
    or CUDA is missing, or when the ``causal_conv1d`` package is installed: transformers then already
    runs that CUDA kernel).
    """
    mods = _conv1d_modules(model)
    device = next(model.parameters()).device
    usable = (mods and device.type == "cuda" and fla_available()
              and importlib.util.find_spec("causal_conv1d") is None)
    if not usable:
        yield []
        return
    saved = [(m, getattr(m, CONV1D_FN)) for m in mods]
    try:
        for m, _ in saved:
            setattr(m, CONV1D_FN, fla_conv1d_fn)
        yield [m.__name__ for m in mods]
    finally:
        for m, fn in saved:
            setattr(m, CONV1D_FN, fn)


def resolve_fuse(setting: bool | str, device: torch.device | str) -> bool:
    """``extract.fuse``: ``"auto"`` = on for CUDA targets only; booleans are taken as given.

    Raises:
        ValueError: any other value.
    """
    if setting == "auto":
        return torch.device(device).type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"extract.fuse must be true, false or 'auto', not {setting!r}")


@contextlib.contextmanager
def fused_target(model: nn.Module, enabled: bool = True) -> Iterator[dict]:
    """Context manager: the target with compiled norms / MLPs and fla's conv1d, restored on exit.

    Yields a report ``{"compiled": {class: instances}, "conv1d": [patched modules], "enabled": bool}``
    (logged once). Compilation happens on the first forward inside the block; if it fails, dynamo logs the
    error and that module runs eagerly (``torch._dynamo.config.suppress_errors`` inside the block).
    """
    if not enabled:
        yield {"enabled": False, "compiled": {}, "conv1d": []}
        return
    t0 = time.perf_counter()
    counts = compile_elementwise(model)
    # a compiler failure (no C compiler, a Triton / inductor bug on some shape) must not kill a shard job:
    # dynamo then logs it and runs that function eagerly
    suppress = torch._dynamo.config.suppress_errors
    torch._dynamo.config.suppress_errors = True
    try:
        with fla_causal_conv1d(model) as conv:
            report = {"enabled": True, "compiled": dict(counts), "conv1d": conv}
            log.info("fused target forward: torch.compile of %s; conv1d via flash-linear-attention in %s "
                     "(set up in %.2f s; kernels compile on the first batches)",
                     dict(counts) or "nothing", conv or "no module", time.perf_counter() - t0)
            yield report
    finally:
        torch._dynamo.config.suppress_errors = suppress
        restore_elementwise(model)
