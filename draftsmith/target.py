"""The target model: loading, its decoder layers, and capture of the tapped layers with hooks.

Layer-id semantics (fixed for the whole project, the convention of the official DFlash code, SpecForge
and vLLM's ``dflash_config``): **id i = output of decoder layer i = HF ``output_hidden_states[i + 1]``**.
For the last layer (i = L - 1) Hugging Face returns the output *after* the final norm, so
:class:`LayerCapture` applies the final norm to that one layer too.

Hooks are used instead of ``output_hidden_states=True`` because (a) they keep only the tapped layers
(more tokens/s and far less activation memory: docs/measurements.md) and (b) the list-valued
``output_hidden_states`` changed meaning between transformers 5.17 and 5.23.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from draftsmith.io import check_model_folder
from draftsmith.target_layers import validate_layer_ids

log = logging.getLogger("draftsmith.target")

HYBRID_MODEL_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StopForward(Exception):
    """Raised by the deepest tapped layer's hook to skip the rest of the forward pass."""


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def default_device() -> torch.device:
    """``cuda`` when a (leased) GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def text_config(config):
    """The text (decoder) config of a possibly multimodal config (Qwen3.5 ``text_config``)."""
    return getattr(config, "text_config", None) or config


def target_dims(target_dir: str | os.PathLike, *, trust_remote_code: bool = False) -> tuple[int, int, int]:
    """``(num_target_layers L, hidden_size H, vocab_size V)`` from the target's config.json only."""
    from transformers import AutoConfig

    folder = check_model_folder(target_dir)
    cfg = text_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code))
    return int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.vocab_size)


def is_hybrid(config) -> bool:
    """True for targets mixing Gated DeltaNet (linear attention) and full-attention layers."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None) or []
    return cfg.model_type in HYBRID_MODEL_TYPES or "linear_attention" in types


def fla_available() -> bool:
    """Whether flash-linear-attention's kernels can be imported (GPU + triton only)."""
    return importlib.util.find_spec("fla") is not None


def load_target(path: str | os.PathLike, *, dtype: str = "auto", device: torch.device | str | None = None,
                attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                require_fla: bool = False) -> nn.Module:
    """Load a target as ``AutoModelForCausalLM`` from a local folder, in eval mode, on ``device``.

    ``from_pretrained`` then ``.to(device)``: as fast as ``device_map={"": device}`` but with a host resident set a
    small fraction of the weights' size, where ``device_map`` peaks near the weights' size (bench/bench_load_target.py,
    docs/measurements.md): eight shard jobs start together on an 8-GPU node, so the host memory of a load counts
    eight times.

    Qwen3.5 / 3.6 checkpoints (``Qwen3_5ForConditionalGeneration``) load text-only this way.
    For hybrid GDN targets without flash-linear-attention a loud warning is logged (the torch
    fallback is much slower), or ``RuntimeError`` is raised when ``require_fla``.

    Raises:
        FileNotFoundError / ValueError: see :func:`check_model_folder`.
        RuntimeError: ``require_fla`` and a hybrid target without flash-linear-attention; or a hybrid target
            on a non-CUDA device while flash-linear-attention is installed (transformers would call its
            CUDA-only Triton kernels).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = check_model_folder(path)
    device = torch.device(device) if device is not None else default_device()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    hybrid, has_fla = is_hybrid(config), fla_available()
    if hybrid and has_fla and device.type != "cuda":
        # transformers then calls fla's Triton kernels whatever the device, which fail deep inside Triton
        # ("Pointer argument ... cannot be accessed from Triton (cpu tensor?)"); say it here instead
        raise RuntimeError(f"target {folder} is a hybrid Gated DeltaNet model and flash-linear-attention is "
                           f"installed, so transformers runs its GDN layers with Triton kernels that need a CUDA "
                           f"device, but the target is to run on {device}: run on a GPU, or use an environment "
                           "without flash-linear-attention for CPU runs")
    if hybrid and not has_fla:
        msg = (f"target {folder} is a hybrid Gated DeltaNet model but flash-linear-attention is not "
               "installed: its GDN layers run a torch fallback 1.7-2.3x slower "
               "(pip install 'draftsmith[fla]' on a GPU machine)")
        if require_fla:
            raise RuntimeError(msg)
        log.warning("!" * 20 + " " + msg)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=resolve_dtype(dtype, device), attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def _decoder_part(model: nn.Module, name: str, what: str):
    """Attribute ``name`` of the target's decoder (``model.get_decoder()``); ValueError naming ``what``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    part = getattr(decoder, name, None)
    if part is None:
        raise ValueError(f"cannot find the {what} of {type(model).__name__}")
    return part


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, in order (``model.get_decoder().layers``)."""
    return _decoder_part(model, "layers", "decoder layers")


def final_norm(model: nn.Module) -> nn.Module:
    """The target's final norm (applied by HF to ``output_hidden_states[L]``)."""
    return _decoder_part(model, "norm", "final norm")


def num_layers(model_or_config) -> int:
    """Number of decoder layers L of a target model or config."""
    config = getattr(model_or_config, "config", model_or_config)
    return int(text_config(config).num_hidden_layers)


class LayerCapture:
    """Forward hooks that keep the outputs of the tapped decoder layers.

    After a forward, ``features()`` returns ``[batch, seq, len(layer_ids) * hidden]`` (the target's
    dtype), the tapped outputs concatenated in ``layer_ids`` order: exactly
    ``cat([output_hidden_states[i + 1] for i in layer_ids], -1)``. With ``stop_after_deepest`` the
    forward is cut short after the deepest tapped layer (use :meth:`run`); do not combine that with
    a KV cache that later layers must fill.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, stop_after_deepest: bool = False):
        self.model = model
        self.layer_ids = validate_layer_ids(list(layer_ids), num_layers(model))
        self.stop_after_deepest = stop_after_deepest
        self._layers = decoder_layers(model)
        self._norm = final_norm(model)
        self._last = len(self._layers) - 1
        self._deepest = max(self.layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if layer_id == self._last:
                hidden = self._norm(hidden)
            self._out[layer_id] = hidden
            if self.stop_after_deepest and layer_id == self._deepest:
                raise StopForward
        return hook

    def __enter__(self) -> "LayerCapture":
        for i in sorted(set(self.layer_ids)):
            self._handles.append(self._layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        self._out.clear()

    def features(self) -> torch.Tensor:
        """``[batch, seq, n * hidden]`` features of the last forward. Raises if a layer did not run."""
        missing = [i for i in self.layer_ids if i not in self._out]
        if missing:
            raise RuntimeError(f"tapped layers {missing} produced no output in the last forward")
        return torch.cat([self._out[i] for i in self.layer_ids], dim=-1)

    def run(self, forward, *args, **kwargs):
        """Call ``forward(*args, **kwargs)`` swallowing :class:`StopForward`; returns its output or None."""
        self.clear()
        try:
            return forward(*args, **kwargs)
        except StopForward:
            return None


@contextmanager
def capture_layers(model: nn.Module, layer_ids: list[int], *, stop_after_deepest: bool = False
                   ) -> Iterator[LayerCapture]:
    """Context manager form of :class:`LayerCapture`."""
    cap = LayerCapture(model, layer_ids, stop_after_deepest=stop_after_deepest)
    with cap:
        yield cap


# --------------------------------------------------------------------------------------------------
# Attention kernels of the stages that run the target with a KV cache


def without_cudnn_attention():
    """Context manager: SDPA may use flash, memory-efficient or math kernels, not cuDNN's.

    Decoding changes the key length every step (a growing KV cache, a new prompt length), and PyTorch's cuDNN SDPA
    backend (chosen first on Hopper in torch 2.11) builds an execution plan for every new shape, milliseconds of CPU
    per attention call that dominated a DFlash drafter step (docs/measurements.md). The other kernels need no
    per-shape plan. Scoped (``torch.nn.attention.sdpa_kernel``), so training and extraction keep cuDNN.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


GROUPED_SDPA = "draftsmith_grouped_sdpa"


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Grouped-query SDPA with a mask, without repeating K/V: transformers' attention-interface signature.

    ``query [B, Hq, q, D]``, ``key`` / ``value [B, Hkv, L, D]``, ``attention_mask [B, 1, q, L]`` (additive or bool)
    -> ``[B, q, Hq, D]``. With a mask, transformers' ``sdpa`` repeats each K/V head ``Hq / Hkv`` times (SDPA's
    ``enable_gqa`` would fall back to the math kernel): on a static cache that copies the whole cache every layer
    and step (most of a batched decode step's time on a static cache: docs/measurements.md). Here the
    ``g = Hq / Hkv`` query heads that share a K/V head become ``g x q`` query rows of that head (query head h uses
    K/V head h // g, as ``repeat_kv``), so SDPA reads each cached K/V once. Same dot products as ``sdpa``.
    """
    if attention_mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    grouped = query.reshape(b, hkv, g * q, d)
    mask = attention_mask[:, :, None].expand(b, attention_mask.shape[1], g, q, attention_mask.shape[-1])
    mask = mask.reshape(b, attention_mask.shape[1], g * q, attention_mask.shape[-1])
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch an SDPA target to :func:`grouped_sdpa_attention` (registered with transformers once); returns
    whether it did (other implementations, e.g. flash-attention, are left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", GROUPED_SDPA):
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(GROUPED_SDPA)
    return True


# --------------------------------------------------------------------------------------------------
# The target's input embedding and LM head, read by key without loading the target (train, export)

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight", "model.model.embed_tokens.weight",
              "embed_tokens.weight", "transformer.wte.weight")
HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def weight_files(target_dir: Path) -> dict[str, Path]:
    """Map every tensor name of a target folder to its safetensors file (sharded or not)."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        return {k: target_dir / v for k, v in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target_dir}: no *.safetensors weights (only safetensors targets are read)")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                out[key] = path
    return out


def load_target_embeddings_and_head(target_dir: str | os.PathLike, dtype: torch.dtype | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head weights, read by key without loading the target.

    Handles plain causal LMs (``model.embed_tokens.weight``, ``lm_head.weight``), Qwen3.5 / 3.6 multimodal
    checkpoints (``model.language_model.embed_tokens.weight``), and tied embeddings (no LM head tensor and
    ``tie_word_embeddings`` true, or simply no head tensor: the embedding is the head).

    Returns:
        ``(embed_weight [V, H], lm_head_weight [V, H])`` in the stored dtype (or ``dtype``); the same tensor
        object twice when tied.

    Raises:
        FileNotFoundError: no safetensors weights in the folder.
        KeyError: no embedding tensor under any known name (the message lists the names tried).
        ValueError: the head and embedding shapes disagree.
    """
    target_dir = Path(target_dir)
    files = weight_files(target_dir)

    def read(key: str) -> torch.Tensor:
        with safe_open(str(files[key]), framework="pt") as fh:
            t = fh.get_tensor(key)
        return t.to(dtype) if dtype is not None else t

    embed_key = next((k for k in EMBED_KEYS if k in files), None)
    if embed_key is None:
        cands = [k for k in files if k.endswith("embed_tokens.weight") and "visual" not in k and "mtp" not in k]
        embed_key = cands[0] if len(cands) == 1 else None
    if embed_key is None:
        raise KeyError(f"{target_dir}: no input embedding tensor (tried {', '.join(EMBED_KEYS)})")
    embed = read(embed_key)
    head_key = next((k for k in HEAD_KEYS if k in files), None)
    tied = False
    config_path = target_dir / "config.json"
    if config_path.is_file():
        with open(config_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        tied = bool(cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings", False)))
    if head_key is None:
        if not tied:
            log.warning("%s: no LM head tensor although tie_word_embeddings is not set; using the input "
                        "embedding as the head", target_dir)
        return embed, embed
    head = read(head_key)
    if head.shape != embed.shape:
        raise ValueError(f"{target_dir}: {head_key} {tuple(head.shape)} and {embed_key} {tuple(embed.shape)} differ")
    return embed, head
