"""The target's own multi-token-prediction (MTP) head as a reference drafter: Qwen3.5 / Qwen3.6 / Qwen3-Next.

Those checkpoints ship an MTP head beside the decoder (``mtp.*`` tensors; Qwen3.6-27B: 15 BF16 tensors, 811 MB), and
vLLM / SGLang serve it as a speculative decoder for free: it is the number a DFlash drafter has to beat. Transformers
drops ``mtp.*`` when it loads the model (``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``), so this module reads
them from the target folder's safetensors itself (:func:`mtp_status`, :func:`load_mtp_head`).

**The head** (vLLM ``model_executor/models/qwen3_5_mtp.py`` ``Qwen3_5MultiTokenPredictor`` and ``qwen3_next_mtp.py``,
SGLang ``qwen3_5_mtp.py``, speculators ``models/mtp/``; docs/mtp/README.md): ``mtp.fc.weight [H, 2H]``,
``mtp.pre_fc_norm_embedding.weight [H]``, ``mtp.pre_fc_norm_hidden.weight [H]``, one full-attention decoder layer of
the target's own family ``mtp.layers.0.*`` (Qwen3.5: the gated attention, ``q_proj`` of ``2 x heads x head_dim``
rows; Qwen3-Next: a mixture-of-experts MLP) and ``mtp.norm.weight [H]``; the input embedding and the LM head are the
target's. The norms are the target's class (Gemma-style ``x / rms(x) * (1 + w)`` on Qwen3.5 / Qwen3-Next). One
application of the head, for a row at position ``i``::

    x   = fc(cat[pre_fc_norm_embedding(embed(token_{i+1})), pre_fc_norm_hidden(h_i)])    # embedding first
    out = norm(layer(x, rotary position i, the layer's own K/V cache))                    # [H], after mtp.norm
    logits = lm_head(out)                                                                 # predicts token_{i+2}

**Which hidden state, and the pairing** (vLLM's EAGLE / MTP proposer, ``v1/spec_decode``: the target's token ids
shifted left by one with the sampled token last, the target's positions and hidden states unchanged): row ``i``
pairs ``h_i``, the target's hidden state at position ``i`` **after its final norm** (what ``Qwen3_5Model.forward``
returns; the pre-norm state never fails, it only lowers acceptance: LightLLM PR #1402, Qwen3.5-0.8B, accept length
1.804 -> 2.738 after switching to post-norm; llama.cpp PR #24025), with the embedding of the token *after* position
``i``, at rotary position ``i``. In draftsmith's decoding loop (:func:`draftsmith.evaluate.decode.speculative_generate`)
``start`` is the position of the last committed token, which the target has not consumed yet: the target holds
``h_0 .. h_{start-1}`` (the post-norm features of layer ``L - 1``, :class:`draftsmith.target.LayerCapture`), and the
rows ``0 .. start - 1`` pair them with ``token_1 .. token_start``, all committed.

**Drafts.** Draft 1 (the token at ``start + 1``) is the argmax of the row at ``start - 1``. Draft ``k > 1`` applies
the layer again (layer ``(k - 1) mod num_layers``, vLLM's ``spec_step_idx % num_mtp_layers``; Qwen3.5 / 3.6 have one
layer) to its own output after ``mtp.norm`` paired with the embedding of draft ``k - 1``, at rotary position
``start + k - 2`` (vLLM advances the position by one per step). Drafts are the argmax at every temperature: vLLM drafts
MTP tokens greedily; rejection sampling treats them as deterministic proposals, which keeps the output distributed
as the target's (Leviathan et al. 2023, Alg. 1 with a one-hot q).

**The layer's K/V cache holds one entry per committed position**, as the engines' does: after the prefill the layer
runs over the prompt's rows ``0 .. P - 1`` (whose last row drafts), and after each verify forward over the rows of the
positions it committed (the last of them drafts): one forward of ``accepted + 1`` rows, then ``k - 1`` one-row
forwards for the later drafts. The entries the draft steps write (positions ``start .. start + k - 2``) are
speculative: they are cropped when the next forward writes the committed rows over them. Here the K/V live in fixed
buffers indexed by position (:class:`PositionKVCache`), and a query at position ``p`` sees keys ``<= p`` only, so an
entry past the committed length is never visible before it is overwritten: cropping is the committed length.
``tests/test_evaluate.py`` holds the drafts equal to a cache-free recomputation from scratch after every verify step,
with accepted, partly accepted and rejected drafts.

**The target's own state** is rolled back as for DFlash (GDN snapshot and replay, :mod:`draftsmith.evaluate.cache`,
:mod:`draftsmith.evaluate.static`). On a GPU with the static target, a drafting step (the committed rows, padded to
``k + 1``, then ``k - 1`` one-row steps and the argmaxes) is one captured CUDA graph per ``k``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.evaluate.decode import Proposer, output_head
from draftsmith.hybrid_cache import cache_kwargs, layer_types
from draftsmith.target import decoder_layers, final_norm, num_layers, text_config, without_cudnn_attention

log = logging.getLogger("draftsmith.evaluate")

#: the prefix of the head's tensors in the target checkpoint
MTP_PREFIX = "mtp."
#: transformers' fused expert parameters (``[experts, 2 x inter, H]`` and ``[experts, H, inter]``) and the per-expert
#: checkpoint tensors they are merged from (Qwen3-Next; ``conversion_mapping.py``, ``qwen2_moe``: gate rows first)
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclasses.dataclass(frozen=True)
class MTPStatus:
    """Whether a target folder carries an MTP head evaluate can decode with, read without loading the target.

    Attributes:
        available: True when the checkpoint holds a complete, well-formed ``mtp.*`` set.
        reason: why there is no MTP column (empty when available).
        num_layers: MTP decoder layers (``mtp_num_hidden_layers``; 1 on Qwen3.5 / 3.6 / Qwen3-Next).
        tensors: the ``mtp.*`` tensor count.
        num_bytes: their size on disk (header sizes), bytes.
    """

    available: bool
    reason: str = ""
    num_layers: int = 0
    tensors: int = 0
    num_bytes: int = 0

    def to_dict(self) -> dict:
        """The report's ``run.mtp`` entry (JSON)."""
        return dataclasses.asdict(self)


class MTPHead(nn.Module):
    """The head's own modules, built from the target's classes: ``fc`` (Linear ``2H -> H``, no bias), the two
    pre-fc norms and ``norm`` (the target's final-norm class: Gemma-style ``1 + w`` on Qwen3.5), and ``layers``:
    ``num_layers`` decoder layers of the target's own full-attention decoder-layer class (``Qwen3_5DecoderLayer``,
    ``Qwen3NextDecoderLayer``) on a copy of its text config whose ``layer_types`` are all ``full_attention``. The state
    dict holds exactly these (names without the ``mtp.`` prefix); the embedding, LM head and rotary embedding are the
    target's, held by :class:`MTPDrafter`.

    Args:
        target: the target model (any device, ``meta`` included: only its classes and config are read).
        num_layers: MTP decoder layers.

    Raises:
        ValueError: a target without a full-attention decoder layer to copy.
    """

    def __init__(self, target: nn.Module, num_layers: int = 1):
        super().__init__()
        tcfg = text_config(target.config)
        types = layer_types(tcfg)
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if not full:
            raise ValueError(f"{type(target).__name__} has no full_attention decoder layer whose class the MTP layer "
                             f"could take (layer types {sorted(set(types))})")
        layer_class = type(decoder_layers(target)[full[0]])
        norm_class = type(final_norm(target))
        cfg = copy.deepcopy(tcfg)
        cfg.num_hidden_layers = int(num_layers)
        cfg.layer_types = ["full_attention"] * int(num_layers)
        self.config = cfg
        hidden, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden, eps=eps)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(int(num_layers)))
        self.norm = norm_class(hidden, eps=eps)


def checkpoint_shapes(head: MTPHead, fused_experts: bool = True) -> dict[str, tuple[int, ...]]:
    """``{checkpoint tensor name: shape}`` of a complete ``mtp.*`` set for ``head`` (``mtp.fc.weight`` ...).
    Fused expert parameters (Qwen3-Next's MoE layer) are named as transformers holds them when ``fused_experts``,
    else as one tensor per expert and projection (``mtp.layers.0.mlp.experts.<e>.gate_proj.weight``), how Qwen3-Next
    checkpoints store them."""
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in head.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if not fused_experts and ".experts." in f".{name}" and leaf in FUSED_EXPERTS and tensor.dim() == 3:
            base = name[: -len(leaf)]
            experts, rows = int(tensor.shape[0]), int(tensor.shape[1])
            parts = FUSED_EXPERTS[leaf]
            for e in range(experts):
                for part in parts:
                    out[f"{MTP_PREFIX}{base}{e}.{part}.weight"] = (rows // len(parts), int(tensor.shape[2]))
        else:
            out[MTP_PREFIX + name] = tuple(int(s) for s in tensor.shape)
    return out


def mtp_tensors(target_dir: str | os.PathLike) -> dict[str, tuple[Path, tuple[int, ...], int]]:
    """The ``mtp.*`` tensors of a target folder, read from the safetensors headers only: ``{name: (file, shape,
    bytes)}`` (empty when there are none).

    Raises:
        FileNotFoundError: the folder holds no safetensors weights.
    """
    from safetensors import safe_open

    from draftsmith.target import weight_files

    files = weight_files(Path(target_dir))
    out: dict[str, tuple[Path, tuple[int, ...], int]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name.startswith(MTP_PREFIX):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as fh:
            for name in names:
                sl = fh.get_slice(name)
                shape = tuple(int(s) for s in sl.get_shape())
                size = 1
                for s in shape:
                    size *= s
                out[name] = (path, shape, size * _dtype_bytes(sl.get_dtype()))
    return out


def _dtype_bytes(name: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(str(name), 1)


def config_mtp_layers(config) -> int | None:
    """``mtp_num_hidden_layers`` of a target config (its text config first), or None when it names none."""
    for cfg in (text_config(config), config):
        value = getattr(cfg, "mtp_num_hidden_layers", None)
        if value is not None:
            return int(value)
    return None


def check_mtp_tensors(found: dict[str, tuple[int, ...]], head: MTPHead, where: str = "the target") -> bool:
    """Check a checkpoint's ``mtp.*`` set against the head it must fill, exactly: every tensor present with its shape,
    none extra. Fused expert parameters may come fused or per expert (:func:`checkpoint_shapes`).

    Args:
        found: ``{name: shape}`` of the checkpoint's ``mtp.*`` tensors.
        head: the head (on any device, ``meta`` included).
        where: the folder, for the messages.

    Returns:
        True when the experts come fused (or there are none), False when per expert.

    Raises:
        ValueError: naming the first missing tensor, the first unexpected one, or a tensor whose shape differs from
            what the target's layer class has (with both shapes).
    """
    fused = checkpoint_shapes(head, fused_experts=True)
    per_expert = checkpoint_shapes(head, fused_experts=False)
    expected = fused
    if fused != per_expert and not set(fused) - set(per_expert) <= set(found):
        expected = per_expert
    missing = sorted(set(expected) - set(found), key=_natural)
    if missing:
        raise ValueError(f"{where}: the MTP head's tensor {missing[0]} is missing from the checkpoint "
                         f"({len(missing)} of its {len(expected)} mtp.* tensors missing"
                         + (f": {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}" if len(missing) > 1
                            else "") + "); a checkpoint saved by transformers drops mtp.*: copy the original "
                         "checkpoint's mtp.* tensors (their safetensors shards and index entries) back")
    extra = sorted(set(found) - set(expected), key=_natural)
    if extra:
        raise ValueError(f"{where}: unexpected MTP tensor {extra[0]} ({len(extra)} not part of a "
                         f"{len(head.layers)}-layer head of {type(head.layers[0]).__name__}); "
                         "mtp_num_hidden_layers or the checkpoint is wrong")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ValueError(f"{where}: MTP tensor {name} has shape {list(found[name])}, but the target's "
                             f"{type(head.layers[0]).__name__} needs {list(shape)}")
    return expected is fused


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def mtp_status(target_dir: str | os.PathLike, *, trust_remote_code: bool = False) -> MTPStatus:
    """Whether ``target_dir`` carries a usable MTP head, from its ``config.json`` and safetensors headers (the target
    is built on the ``meta`` device for the expected shapes; no weight is read).

    Returns:
        :class:`MTPStatus`; ``available`` False with the reason when the checkpoint has no ``mtp.*`` tensor.

    Raises:
        ValueError: a malformed ``mtp.*`` set (:func:`check_mtp_tensors`: naming the missing, unexpected or misshapen
            tensor), or one whose layers the target family cannot build.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        found = mtp_tensors(target_dir)
    except FileNotFoundError as err:
        return MTPStatus(False, f"{err}: the MTP head is read from safetensors")
    if not found:
        return MTPStatus(False, "the target checkpoint has no mtp.* tensors (models without an MTP head, and "
                                "checkpoints re-saved by transformers, which drops them)")
    config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    layers = config_mtp_layers(config)
    indices = {int(m.group(1)) for name in found if (m := re.match(r"mtp\.layers\.(\d+)\.", name))}
    if layers is None:
        layers = max(indices) + 1 if indices else 1
    if layers < 1:
        return MTPStatus(False, f"mtp_num_hidden_layers is {layers} in {target_dir}/config.json")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        head = MTPHead(meta, layers)
    check_mtp_tensors({n: s for n, (_, s, _) in found.items()}, head, str(target_dir))
    return MTPStatus(True, "", layers, len(found), sum(b for _, _, b in found.values()))


def load_mtp_head(target_dir: str | os.PathLike, target: nn.Module, num_layers: int | None = None) -> MTPHead:
    """The target's MTP head with its checkpoint weights, on the target's device and in its dtype, in eval mode.

    Args:
        target_dir: the target folder (its ``mtp.*`` safetensors).
        target: the loaded target (its classes, device and dtype).
        num_layers: MTP layers (default: ``mtp_num_hidden_layers``, else counted from the tensors).

    Raises:
        ValueError: no ``mtp.*`` tensors, or a malformed set (:func:`check_mtp_tensors`).
    """
    from safetensors import safe_open

    found = mtp_tensors(target_dir)
    if not found:
        raise ValueError(f"{target_dir}: the checkpoint has no mtp.* tensors")
    if num_layers is None:
        num_layers = config_mtp_layers(target.config)
    if num_layers is None:
        num_layers = 1 + max(int(m.group(1)) for n in found if (m := re.match(r"mtp\.layers\.(\d+)\.", n)))
    weight = target.get_input_embeddings().weight
    with torch.device("meta"):  # the check first: nothing is allocated for a set that is refused
        fused = check_mtp_tensors({n: s for n, (_, s, _) in found.items()}, MTPHead(target, num_layers),
                                  str(target_dir))
    with torch.device(weight.device):
        head = MTPHead(target, num_layers).to(weight.dtype)
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, (path, _, _) in found.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as fh:
            for name in names:
                tensors[name[len(MTP_PREFIX):]] = fh.get_tensor(name)
    state = {}
    for name, meta_tensor in head.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if not fused and leaf in FUSED_EXPERTS and meta_tensor.dim() == 3 and ".experts." in f".{name}":
            base = name[: -len(leaf)]
            state[name] = torch.stack([torch.cat([tensors[f"{base}{e}.{part}.weight"] for part in FUSED_EXPERTS[leaf]])
                                       for e in range(meta_tensor.shape[0])])
        else:
            state[name] = tensors[name]
    head.load_state_dict(state, strict=True)
    return head.eval()


class PositionKVCache:
    """The MTP layers' K/V in fixed buffers indexed by position: what transformers' attention layers take as their
    cache argument (``update(key_states, value_states, layer_idx, ...)``, the whole buffers returned).

    Each forward writes its rows' keys and values at :attr:`positions` (set before the call) and attends over the
    whole buffer with a mask that shows a query at position ``p`` the keys ``<= p``. Stale entries past the committed
    length (the speculative draft steps', padded rows') are invisible and are overwritten before any query could see
    them. Keys ``[1, kv_heads, capacity, head_dim]`` per layer, in the head's dtype.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None

    def ensure(self, capacity: int) -> bool:
        """Room for positions ``0 .. capacity - 1`` (a multiple of 16 keys, as SDPA's memory-efficient kernel wants);
        grows the buffers keeping their content. Returns whether they were (re)allocated."""
        capacity = -(-int(capacity) // 16) * 16
        if capacity <= self.capacity:
            return False
        shape = (1, self.kv_heads, capacity, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self.keys + self.values, new_k + new_v):
            new[:, :, : old.shape[2]].copy_(old)
        self.keys, self.values, self.capacity = new_k, new_v, capacity
        return True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states`` / ``value_states [1, kv_heads, w, head_dim]`` at :attr:`positions` ``[w]``; returns
        the layer's whole buffers."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.positions, key_states.to(keys.dtype))
        values.index_copy_(2, self.positions, value_states.to(values.dtype))
        return keys, values

    def mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[1, 1, w, capacity]``: 0 where key index ``<=`` the query's position, the dtype's
        minimum elsewhere."""
        hidden = torch.arange(self.capacity, device=self.device)[None, :] > positions[:, None]
        return torch.zeros(hidden.shape, dtype=dtype, device=self.device).masked_fill_(
            hidden, torch.finfo(dtype).min)[None, None]


class MTPDrafter:
    """The MTP head drafting ``k`` tokens per step for batch-1 speculative decoding (the module docstring gives the
    algorithm, its sources and the K/V cache's semantics).

    Args:
        head: :func:`load_mtp_head`'s head (on the target's device and dtype).
        target: the target: its input embedding ``[V, H]``, LM head and rotary embedding are shared.
        cuda_graphs: on CUDA, capture each ``k``'s drafting step (committed rows padded to ``k + 1``, the ``k - 1``
            later steps, the argmaxes) as one CUDA graph; a step with more rows (after the prefill) runs eagerly.

    Raises:
        ValueError: a head whose width differs from the target's.
    """

    def __init__(self, head: MTPHead, target: nn.Module, *, cuda_graphs: bool = False):
        self.head = head
        self.embed_weight = target.get_input_embeddings().weight
        if self.embed_weight.shape[1] != head.fc.out_features:
            raise ValueError(f"MTP head width {head.fc.out_features} != target hidden size "
                             f"{self.embed_weight.shape[1]}")
        self.lm_head = output_head(target)
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        self.rotary = decoder.rotary_emb
        #: Qwen3.5's rotary embedding is multimodal (M-RoPE): text positions go in as three equal rows
        self.mrope = getattr(self.rotary, "mrope_section", None) is not None
        self.device, self.dtype = self.embed_weight.device, self.embed_weight.dtype
        attn = head.layers[0].self_attn
        self.cache = PositionKVCache(len(head.layers), int(head.config.num_key_value_heads), int(attn.head_dim),
                                     self.dtype, self.device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[int, tuple] = {}
        self.graph_failures: dict[int, str] = {}
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        #: the last target layer, whose (post-norm) features the head reads
        self.layer_id = num_layers(target) - 1

    # -- the head's pieces ---------------------------------------------------------------------------------
    def _combine(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``fc(cat[pre_fc_norm_embedding(embed(tokens)), pre_fc_norm_hidden(hidden)])``: ``tokens [1, w]`` int64,
        ``hidden [1, w, H]`` -> ``[1, w, H]``."""
        head = self.head
        embedded = F.embedding(tokens, self.embed_weight)
        return head.fc(torch.cat([head.pre_fc_norm_embedding(embedded),
                                  head.pre_fc_norm_hidden(hidden.to(self.dtype))], dim=-1))

    def _layer(self, index: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """MTP layer ``index`` over ``x [1, w, H]`` at ``positions [w]`` (writing their K/V), then ``mtp.norm``."""
        layer = self.head.layers[index]
        pos = positions[None]
        cos, sin = self.rotary(x, pos[None].expand(3, 1, -1) if self.mrope else pos)
        self.cache.positions = positions
        out = layer(x, position_embeddings=(cos, sin), attention_mask=self.cache.mask(positions, x.dtype),
                    position_ids=pos, **cache_kwargs(layer, self.cache))
        return self.head.norm(out[0] if isinstance(out, tuple) else out)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[1, V]`` of ``hidden [1, 1, H]``."""
        head = self.lm_head
        return (head(hidden) if isinstance(head, nn.Module) else F.linear(hidden, head))[:, -1]

    def _select(self, logits: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The draft ``[1]`` int64 from the logits ``[1, V]`` of the row at ``position [1]`` (which predicts the token
        at ``position + 2``): the argmax."""
        return torch.argmax(logits, dim=-1)

    def _chain(self, hidden: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor,
               k: int) -> torch.Tensor:
        """``k`` drafts ``[k]`` int64: the rows ``hidden [1, w, H]`` / ``tokens [1, w]`` at positions ``start [1] +
        0 .. w - 1`` through layer 0 (writing their K/V), the row ``last [1]`` drafting, then ``k - 1`` recursive
        steps. Only device tensors and fixed shapes: the whole chain is one CUDA graph per ``(w, k)``."""
        width = hidden.shape[1]
        positions = start + torch.arange(width, device=hidden.device)
        out = self._layer(0, self._combine(tokens, hidden), positions).index_select(1, last)  # [1, 1, H]
        position = start + last
        token = self._select(self._logits(out), position)
        drafts = [token]
        for step in range(1, k):
            position = position + 1
            out = self._layer(step % len(self.head.layers), self._combine(token[None], out), position)
            token = self._select(self._logits(out), position)
            drafts.append(token)
        return torch.cat(drafts)

    # -- the proposer's call --------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int, k: int) -> torch.Tensor:
        """``k`` drafts ``[k]`` int64 after the committed rows ``hidden [1, n, H]`` (the target's post-norm states at
        positions ``start .. start + n - 1``) paired with ``tokens [n]`` (the committed tokens at ``start + 1 .. start
        + n``): the tokens at positions ``start + n + 1 .. start + n + k``. Each row's K/V are written at its position,
        over whatever an earlier step's drafts left there. The returned tensor may be overwritten by the next call.

        Raises:
            ValueError: ``k < 1``, or ``hidden`` and ``tokens`` of different lengths.
        """
        n = int(hidden.shape[1])
        if k < 1 or tokens.shape[-1] != n or n < 1:
            raise ValueError(f"cannot draft {k} tokens from {n} rows and {tokens.shape[-1]} tokens")
        width = k + 1
        if self.cache.ensure(start + max(n, width) + k + 1):
            self._graphs.clear()  # the captured graphs read the old buffers
        with without_cudnn_attention():
            if not self.cuda_graphs or n > width or k in self.graph_failures:
                return self._chain(hidden, tokens.reshape(1, n), torch.tensor([start], device=self.device),
                                   torch.tensor([n - 1], device=self.device), k)
            hid_buf, tok_buf, start_buf, last_buf = self._inputs(k)
            hid_buf[:, :n].copy_(hidden)
            tok_buf[0, :n].copy_(tokens.reshape(n))
            start_buf.fill_(start)
            last_buf.fill_(n - 1)
            graph = self._graphs.get(k) or self._capture(k)
            if graph is None:
                return self._chain(hid_buf, tok_buf, start_buf, last_buf, k)
            graph[0].replay()
            return graph[1]

    def _inputs(self, k: int) -> tuple[torch.Tensor, ...]:
        """The fixed input buffers of ``k``'s graph: rows ``[1, k + 1, H]``, tokens ``[1, k + 1]``, start, last
        ``[1]`` (rows past the real ones are padding: finite, at positions no earlier query can see)."""
        if k not in self._buffers:
            width, hidden = k + 1, self.embed_weight.shape[1]
            self._buffers[k] = (torch.zeros((1, width, hidden), dtype=self.dtype, device=self.device),
                                torch.zeros((1, width), dtype=torch.long, device=self.device),
                                torch.zeros(1, dtype=torch.long, device=self.device),
                                torch.zeros(1, dtype=torch.long, device=self.device))
        return self._buffers[k]

    def _capture(self, k: int):
        """Capture ``k``'s drafting step (:func:`draftsmith.gpu.capture_graph`; its warm-ups write the very K/V the
        real step writes). On failure that ``k`` drafts eagerly from then on (logged once)."""
        from draftsmith.gpu import capture_graph

        buffers = self._inputs(k)
        captured = capture_graph(self.device, lambda: self._chain(*buffers, k), self.graph_failures, k,
                                 f"the {k}-token MTP drafting step", logger=log)
        if captured is not None:
            self._graphs[k] = captured
        return captured


class MTPProposer(Proposer):
    """The target's MTP head as a :class:`~draftsmith.evaluate.decode.Proposer`: ``num_speculative_tokens`` drafts a
    step (:class:`MTPDrafter`; several proposers, one per ``k``, may share one drafter: decodes run one at a time).

    Reads the post-norm features of the target's last layer (``layer_ids = [L - 1]``, which
    :class:`~draftsmith.target.LayerCapture` normalises as Hugging Face's last ``output_hidden_states`` entry) of the
    committed positions not yet fed to the head (:meth:`commit`), and pairs row ``i`` with the committed token
    ``i + 1``. Drafts are deterministic (argmax) at every temperature.

    Raises:
        ValueError: ``num_speculative_tokens < 1``.
    """

    needs_features = True
    name = "mtp"

    def __init__(self, drafter: MTPDrafter, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.drafter = drafter
        self.max_drafts = int(num_speculative_tokens)
        self.layer_ids = [drafter.layer_id]
        self.pending: torch.Tensor | None = None

    def reset(self, prompt_ids, features):
        self.pending = features

    def propose(self, tokens, start, num_drafts, sampling, generator):
        n = self.pending.shape[1]  # the rows of positions start - n .. start - 1
        drafts = self.drafter.draft(self.pending, tokens[start - n + 1:start + 1], start - n, self.max_drafts)
        return drafts[:num_drafts].clone(), None

    def commit(self, features):
        self.pending = features
