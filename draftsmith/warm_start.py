"""``drafter.init_from``: train from a drafter folder (a released DFlash / DFlash2 drafter, one the official ``dflash``
package saved, or another draftsmith run's ``final/``) instead of random weights.

The folder is the drafter's shape. When the workflow is planned (the Snakefile, through
:func:`draftsmith.config.check_config`), :func:`resolve_init_from` reads its ``config.json`` and the header of its
``model.safetensors`` (no tensor is loaded, no torch imported) and:

* refuses a folder that is not a complete drafter: no ``config.json`` / ``model.safetensors``, ``architectures``
  naming neither ``DFlashDraftModel`` nor ``DFlash2DraftModel``, no explicit ``target_layer_ids``,
  ``mask_token_id`` or ``block_size``, or a tensor set that is not exactly the one its config implies (a missing
  tensor, an extra one -- attention sinks, an MTP head --, a wrong shape: every one named);
* compares every drafter key the folder decides (:data:`FOLDER_KEYS`) with the value the user's overlay gives it
  (:func:`overlay_keys`: the ``--configfile`` files and ``--config``, config.yaml excluded): a key set to another
  value is refused, naming the key, the file that sets it, its value and the folder's; a key left out (or set to
  null) takes the folder's value, which replaces config.yaml's or the schema's in the config every rule sees (so
  extraction taps the folder's layers, and the rules' params name the real shape). ``drafter.mask_token_id`` is the
  exception: it stays as the user set it (null: the folder's, which training takes from the folder), because an
  explicit value equal to the folder's is how a user confirms a mask token the target emits (below).

:func:`draftsmith.target_checks.target_setting_errors` then checks the folder against the target (when the target's
folder exists at planning, else in the first job that reads it): its taps inside the target's decoder layers and
``num_target_layers`` equal to them, ``hidden_size`` and the vocabulary equal to the target's, and a mask token that
is none of the target's eos / pad tokens (:func:`target_emitted_tokens`) unless ``drafter.mask_token_id`` confirms it.

Training (:mod:`draftsmith.train`) builds the drafter from the folder's ``config.json`` and loads its weights
(:func:`load_start_weights`: the same exact tensor set, cast to the training dtype: bf16 values cast to float32 are
exact), and its run fingerprint includes :func:`start_digest` (the sha256 of both files), so another start trains a
fresh run. Evaluate decodes every prompt with this drafter too (the report's before -> after).

Tensor names of the official package's ``DFlash2DraftModel.save_pretrained`` differ from the release format in two
places (its codebooks are ``nn.Embedding``: ``candidate_selector.{predecessor,successor}_codebook.weight``); they are
read as the release names (:data:`OFFICIAL_ALIASES`), and the reading says so.

Importing this module does not import torch or transformers (the workflow is planned without them).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.config import ConfigError
from draftsmith.target_layers import default_target_layer_ids

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
ARCHITECTURE_NAMES = {arch: name for name, arch in ARCHITECTURES.items()}
FULL, SLIDING = "full_attention", "sliding_attention"
#: the files of a start folder (the rule inputs of train and evaluate; their sha256 is :func:`start_digest`)
START_FILES = ("config.json", "model.safetensors")
#: the official package's save_pretrained spelling of a DFlash2 tensor -> the release format's (z-lab, draftsmith)
OFFICIAL_ALIASES = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                    for name in ("predecessor_codebook", "successor_codebook")}
#: names of a target's input embedding in its safetensors (the list of :data:`draftsmith.target.EMBED_KEYS`, which
#: imports torch; tests/test_warm_start.py holds the two equal)
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight", "model.model.embed_tokens.weight",
              "embed_tokens.weight", "transformer.wte.weight")
#: drafter config keys that apply to DFlash2 drafters only
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: the ``drafter`` keys the start folder decides, and where its ``config.json`` says each
FOLDER_KEYS = {
    "architecture": "architectures",
    "num_layers": "num_hidden_layers",
    "block_size": "dflash_config.block_size",
    "target_layer_ids": "dflash_config.target_layer_ids",
    "num_target_features": "len(dflash_config.target_layer_ids)",
    "mask_token_id": "dflash_config.mask_token_id",
    "layer_types": "layer_types",
    "sliding_window": "sliding_window",
    "is_causal": "is_causal",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rope_theta": "rope_theta",
    **{key: f"dflash_config.{key}" for key in DFLASH2_KEYS},
}


class InitFromError(ConfigError):
    """``drafter.init_from`` names a folder that cannot start this run (the message lists every reason)."""


# ---------------------------------------------------------------------------------------------------------------
# reading the folder (JSON and the safetensors header only)


def safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """The tensors of a safetensors file as its header lists them, ``{name: {"dtype", "shape", "data_offsets"}}``
    (``__metadata__`` left out), read without loading a tensor: 8 bytes of little-endian header length, then the
    JSON header.

    Raises:
        InitFromError: the file is missing, shorter than its header says, or the header is not a JSON object.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise InitFromError(f"{path}: {len(head)} bytes, not a safetensors file")
            (size,) = struct.unpack("<Q", head)
            if size > path.stat().st_size - 8:
                raise InitFromError(f"{path}: its header claims {size} bytes, more than the file holds: truncated?")
            header = json.loads(fh.read(size))
    except OSError as exc:
        raise InitFromError(f"{path}: cannot be read ({exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InitFromError(f"{path}: its safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InitFromError(f"{path}: its safetensors header is not a JSON object")
    return {k: v for k, v in header.items() if k != "__metadata__"}


@dataclass(frozen=True)
class StartDrafter:
    """A start folder as :func:`read_start` read it.

    Attributes:
        folder: the folder (``drafter.init_from``).
        config: its ``config.json``.
        tensors: ``{name: shape}`` from the safetensors header, official aliases read as the release names.
        dtypes: ``{name: safetensors dtype}`` (``BF16``, ``F32``...).
        aliases: ``{name in the file: name read}`` of the :data:`OFFICIAL_ALIASES` found.
    """

    folder: Path
    config: dict
    tensors: dict[str, tuple[int, ...]]
    dtypes: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.folder / "config.json"

    @property
    def architecture(self) -> str:
        """``dflash`` or ``dflash2`` (``drafter.architecture``'s values)."""
        names = self.config.get("architectures") or []
        return "dflash2" if "DFlash2DraftModel" in names else "dflash"

    def value(self, name: str, default: Any = None) -> Any:
        """A drafter field as the official package and vLLM read it: ``dflash_config[name]``, else ``config[name]``."""
        dflash = self.config.get("dflash_config") or {}
        if dflash.get(name) is not None:
            return dflash[name]
        return self.config.get(name, default)

    @property
    def layer_ids(self) -> list[int]:
        return [int(i) for i in self.value("target_layer_ids")]

    @property
    def mask_token_id(self) -> int:
        return int(self.value("mask_token_id"))

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def layer_types(self) -> list[str]:
        """Per layer ``full_attention`` / ``sliding_attention`` (a config without ``layer_types``: all full)."""
        types = self.config.get("layer_types")
        return list(types) if types else [FULL] * self.num_layers

    def causal_layers(self, is_causal: Any = "folder") -> list[bool]:
        """Which layers are causal inside the block (official semantics: top-level ``is_causal`` when set, else
        sliding layers are), with the folder's ``is_causal`` or the given one."""
        flag = self.config.get("is_causal") if is_causal == "folder" else is_causal
        return [t == SLIDING if flag is None else bool(flag) for t in self.layer_types]

    def drafter_keys(self) -> dict[str, Any]:
        """The ``drafter`` config keys this folder decides (:data:`FOLDER_KEYS`), as the config would spell them;
        the DFlash2 sizes only for a DFlash2 drafter."""
        cfg = self.config
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        types = self.layer_types
        out = {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "block_size": int(self.value("block_size")),
            "target_layer_ids": self.layer_ids,
            "num_target_features": len(self.layer_ids),
            "mask_token_id": self.mask_token_id,
            "layer_types": types,
            "sliding_window": int(cfg["sliding_window"]) if SLIDING in types and cfg.get("sliding_window") else None,
            "is_causal": cfg.get("is_causal"),
            "intermediate_size": int(cfg["intermediate_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            "rope_theta": None if theta is None else float(theta),
        }
        if self.architecture == "dflash2":
            out.update({key: int(self.value(key)) for key in DFLASH2_KEYS})
        return out


def read_start(folder: str | os.PathLike) -> StartDrafter:
    """Read a start folder's ``config.json`` and safetensors header (no tensor loaded).

    Raises:
        InitFromError: the folder or a file is missing; ``config.json`` is not a JSON object; ``architectures``
            names neither DFlash class; ``target_layer_ids``, ``mask_token_id``, ``block_size`` or a shape field
            (``hidden_size``, ``num_hidden_layers``, heads, ``intermediate_size``, ``vocab_size``; DFlash2: the
            ``conv_*`` / ``selector_*`` sizes) is not stated (each named, with where the official package reads it).
    """
    folder = Path(folder).expanduser()
    where = f"drafter.init_from: {folder}"
    if not folder.is_dir():
        raise InitFromError(f"{where} is not a folder (a DFlash drafter folder holds config.json and "
                            "model.safetensors)")
    missing = [name for name in START_FILES if not (folder / name).is_file()]
    if missing:
        sharded = sorted(p.name for p in folder.glob("*.safetensors"))
        hint = (f" (it holds {', '.join(sharded)}: merge the shards into one model.safetensors)"
                if sharded and "model.safetensors" in missing else "")
        raise InitFromError(f"{where} has no {' and no '.join(missing)}{hint}: a DFlash drafter folder holds "
                            "config.json and model.safetensors")
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InitFromError(f"drafter.init_from: {path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InitFromError(f"drafter.init_from: {path} holds a {type(config).__name__}, not a JSON object")
    names = config.get("architectures") or []
    if not set(names) & set(ARCHITECTURES):
        raise InitFromError(f"drafter.init_from: {path} has architectures {names}: neither DFlashDraftModel nor "
                            "DFlash2DraftModel (an EAGLE-3, MTP or other drafter cannot start a DFlash run)")
    start = StartDrafter(folder, config, {})
    errors = []
    for name in ("target_layer_ids", "mask_token_id", "block_size"):
        if start.value(name) is None:
            errors.append(f"dflash_config.{name} is not stated (a drafter must state it: serving engines that guess "
                          "it fail silently, SGLang #37475)")
    needed = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
    errors += [f"{name} is not stated" for name in needed if not isinstance(config.get(name), int)]
    if start.architecture == "dflash2":
        errors += [f"dflash_config.{name} is not stated (DFlash2)" for name in DFLASH2_KEYS
                   if start.value(name) is None]
    types = config.get("layer_types")
    if types is not None and isinstance(config.get("num_hidden_layers"), int) and (
            len(types) != config["num_hidden_layers"] or set(types) - {FULL, SLIDING}):
        errors.append(f"layer_types {types} is not one of full_attention / sliding_attention per layer "
                      f"({config['num_hidden_layers']} layers)")
    if errors:
        raise InitFromError(f"drafter.init_from: {path} is not a complete DFlash drafter config:\n  "
                            + "\n  ".join(errors))
    header = safetensors_header(folder / "model.safetensors")
    tensors, dtypes, aliases = {}, {}, {}
    for name, info in header.items():
        read = OFFICIAL_ALIASES.get(name, name) if start.architecture == "dflash2" else name
        if read != name:
            aliases[name] = read
        if read in tensors:
            raise InitFromError(f"drafter.init_from: {folder / 'model.safetensors'} holds both {name} and "
                                f"{read}: one tensor twice")
        tensors[read] = tuple(int(d) for d in info.get("shape", ()))
        dtypes[read] = str(info.get("dtype"))
    return StartDrafter(folder, config, tensors, dtypes, aliases)


def expected_tensors(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor a drafter of this ``config.json`` holds (z-lab release names), computed
    from the config alone: ``fc.weight [H, n*H]``, ``hidden_norm.weight`` / ``norm.weight [H]``, per layer the
    Qwen3 decoder layer's norms, q/k/v/o projections (biases with ``attention_bias``), q/k norms ``[head_dim]`` and
    MLP; DFlash2 also per layer ``{attention,mlp}_conv.base_kernel [2, K, H]`` and ``.kernel_projection.weight
    [2*K*H/G, H]``, and ``candidate_selector.{predecessor,successor}_codebook [V, r]``,
    ``candidate_selector.hidden_projection.weight [r, H]``. (``tests/test_warm_start.py`` holds it equal to the
    models' own state dicts.)"""
    start = StartDrafter(Path("."), dict(config), {})
    H, n = int(config["hidden_size"]), len(start.value("target_layer_ids"))
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or H // heads)
    inter = int(config["intermediate_size"])
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    dflash2 = start.architecture == "dflash2"
    for i in range(int(config["num_hidden_layers"])):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                    p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                    p + "mlp.down_proj.weight": (H, inter)})
        if config.get("attention_bias"):
            out.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                        p + "self_attn.v_proj.bias": (kv * hd,), p + "self_attn.o_proj.bias": (H,)})
        if dflash2:
            K, G = int(start.value("conv_kernel_size")), int(start.value("conv_group_size"))
            for conv in ("attention_conv", "mlp_conv"):
                out[p + f"{conv}.base_kernel"] = (2, K, H)
                out[p + f"{conv}.kernel_projection.weight"] = (2 * K * (H // G), H)
    if dflash2:
        V, r = int(config["vocab_size"]), int(start.value("selector_rank"))
        out.update({"candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
                    "candidate_selector.hidden_projection.weight": (r, H)})
    return out


def tensor_errors(start: StartDrafter, limit: int = 8) -> list[str]:
    """The start folder's tensor set against :func:`expected_tensors`: one line each for the missing tensors, the
    extra ones and the wrong shapes (up to ``limit`` names each, with the count), ``[]`` when they match exactly."""
    want = expected_tensors(start.config)
    have = start.tensors
    w_path = start.folder / "model.safetensors"
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(k for k in set(want) & set(have) if tuple(have[k]) != tuple(want[k]))

    def names(keys: list[str], show=lambda k: k) -> str:
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(show(k) for k in keys[:limit]) + more

    out = []
    if missing:
        out.append(f"{w_path}: {len(missing)} tensor(s) its config.json implies are missing: {names(missing)}")
    if extra:
        out.append(f"{w_path}: {len(extra)} tensor(s) a {ARCHITECTURE_NAMES[start.architecture]} of this config does "
                   f"not have (attention sinks, an MTP head, another architecture?): {names(extra)}")
    if wrong:
        out.append(f"{w_path}: {len(wrong)} tensor(s) of another shape than its config.json implies: "
                   + names(wrong, lambda k: f"{k} {list(have[k])} (expected {list(want[k])})"))
    return out



def start_digest(folder: str | os.PathLike) -> str:
    """sha256 (hex) over the sha256 of the folder's ``config.json`` and ``model.safetensors``: the start's identity
    in the training run's fingerprint (reads every byte of the weights: about 1 s per GB)."""
    from draftsmith.io import sha256_file

    folder = Path(folder)
    parts = {name: sha256_file(folder / name) for name in START_FILES}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# the user's keys against the folder


def overlay_keys(configfiles: Sequence[str | os.PathLike], cli_config: Mapping | None,
                 default_configfile: str | os.PathLike | None = None) -> dict[str, dict[str, tuple[Any, str]]]:
    """The keys the user set on the command line, with where: ``{section: {key: (value, source)}}``; ``source`` is
    the last ``--configfile`` that sets the key (a later file overrides an earlier one, as Snakemake merges them) or
    ``--config``. ``default_configfile`` (the workflow's own config.yaml) is left out, also when named with
    ``--configfile``: its values are defaults, as the schema's are.

    Raises:
        ConfigError: a config file that does not parse (Snakemake has usually reported it already).
    """
    import yaml

    out: dict[str, dict[str, tuple[Any, str]]] = {}
    default = Path(default_configfile).resolve() if default_configfile else None

    def take(data: Any, source: str) -> None:
        if not isinstance(data, Mapping):
            return
        for section, keys in data.items():
            if isinstance(keys, Mapping):
                for key, value in keys.items():
                    out.setdefault(str(section), {})[str(key)] = (value, source)

    for path in configfiles or ():
        path = Path(path)
        if default is not None and path.resolve() == default:
            continue
        try:
            take(yaml.safe_load(path.read_text(encoding="utf-8")), str(path))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot be read as a config file ({exc})") from None
    take(dict(cli_config or {}), "--config")
    return out


def _same(key: str, mine: Any, theirs: Any, start: StartDrafter) -> bool:
    """Whether the user's value of ``drafter.<key>`` says the same as the folder's."""
    if key == "is_causal":
        return start.causal_layers(mine) == start.causal_layers()
    if key == "rope_theta":
        return theirs is not None and float(mine) == float(theirs)
    if isinstance(theirs, list):
        return isinstance(mine, (list, tuple)) and list(mine) == theirs
    return mine == theirs


def contradictions(start: StartDrafter, given: Mapping[str, tuple[Any, str]]) -> list[str]:
    """One line per ``drafter`` key whose given value contradicts the folder, naming the key, where it is set, its
    value, the folder's value and the ``config.json`` field; ``given`` maps a key to ``(value, source)``
    (:func:`overlay_keys`' ``drafter`` section). A key given as null takes the folder's value; the DFlash2 sizes
    are not compared for a DFlash folder (no DFlash drafter reads them, with or without a start)."""
    theirs = start.drafter_keys()
    out = []
    for key, (mine, source) in given.items():
        if key not in FOLDER_KEYS or mine is None or (key in DFLASH2_KEYS and start.architecture == "dflash"):
            continue
        folder_value = theirs.get(key)
        if _same(key, mine, folder_value, start):
            continue
        what = f"{start.config_path} {FOLDER_KEYS[key]}"
        hint = f"remove drafter.{key} from {source} (the folder's value is taken) or start from another drafter"
        if key == "architecture":
            out.append(f"drafter.architecture: {mine!r} in {source}, but {start.config_path} is a "
                       f"{ARCHITECTURE_NAMES[start.architecture]} (architectures {start.config.get('architectures')}):"
                       f" DFlash and DFlash2 weights do not convert; {hint}")
        elif key == "target_layer_ids":
            out.append(f"drafter.target_layer_ids: {list(mine)} in {source}, but the start drafter taps "
                       f"{folder_value} ({what}; id i = output of decoder layer i): its fc reads exactly those "
                       f"layers; {hint}")
        elif key == "mask_token_id":
            out.append(f"drafter.mask_token_id: {mine} in {source}, but the start drafter was trained with mask token "
                       f"{folder_value} ({what}): another mask token is another input to every block slot; "
                       f"{hint}")
        elif key == "sliding_window" and folder_value is None:
            out.append(f"drafter.sliding_window: {mine} in {source}, but the start drafter has no sliding-attention "
                       f"layer ({start.config_path} layer_types {start.layer_types}); {hint}")
        else:
            out.append(f"drafter.{key}: {mine!r} in {source}, but the start drafter has {folder_value!r} ({what}); "
                       f"{hint}")
    return out


def _inside_results(folder: Path, workdir: Path) -> bool:
    try:
        folder.resolve().relative_to((workdir / "results").resolve())
        return True
    except ValueError:
        return False


def resolve_init_from(config: dict, overlay: Mapping[str, Mapping[str, tuple[Any, str]]] | None = None, *,
                      workdir: str | os.PathLike | None = None) -> list[str]:
    """Make the folder of ``drafter.init_from`` the drafter's shape in ``config`` (in place; nothing when it is
    null), or refuse it.

    The keys of :data:`FOLDER_KEYS` take the folder's values, except ``mask_token_id`` (kept as given: null or a
    confirmation of the folder's). Taps equal to the official formula's for the folder's ``num_target_layers``
    are written as ``target_layer_ids: null`` with ``num_target_features`` (the form a run without a start has),
    unless ``target_layer_ids`` was given: a start with the same taps as the features on disk does not extract
    again.

    Args:
        config: the workflow's config, schema defaults filled in.
        overlay: the user's keys (:func:`overlay_keys`); None: none (every drafter key is a default).
        workdir: the project folder (default: the current one); a start inside its ``results/`` is refused.

    Returns:
        Lines to log: which keys were taken from the folder, replacing which default values.

    Raises:
        InitFromError: the folder is incomplete (:func:`read_start`), its tensor set differs from its config's
            (:func:`tensor_errors`), a given key contradicts it (:func:`contradictions`), or it lies inside this
            project's ``results/`` (train would depend on its own output); every reason in one message.
    """
    drafter = config.setdefault("drafter", {})
    init = drafter.get("init_from")
    if not init:
        return []
    workdir = Path(workdir) if workdir is not None else Path.cwd()
    folder = Path(init).expanduser()
    folder = folder if folder.is_absolute() else workdir / folder
    if _inside_results(folder, workdir):
        raise InitFromError(f"drafter.init_from: {init} lies inside this project's results/, which this run rewrites "
                            "(train would depend on its own output): copy the folder out first, e.g. "
                            f"cp -r {init} start-drafter, and set drafter.init_from: start-drafter")
    start = read_start(folder)
    given = dict((overlay or {}).get("drafter") or {})
    errors = tensor_errors(start) + contradictions(start, given)
    if errors:
        raise InitFromError(f"drafter.init_from: {folder} cannot start this run:\n  " + "\n  ".join(errors))
    theirs = start.drafter_keys()
    theirs.pop("mask_token_id")
    if start.architecture == "dflash":
        for key in DFLASH2_KEYS:
            theirs.pop(key, None)
    ids, n_target = theirs["target_layer_ids"], start.config.get("num_target_layers")
    if "target_layer_ids" not in given or given["target_layer_ids"][0] is None:
        try:
            formula = default_target_layer_ids(int(n_target), len(ids)) if isinstance(n_target, int) else None
        except ValueError:
            formula = None
        if formula == ids:
            theirs["target_layer_ids"] = None
    notes = []
    changed = {k: (drafter.get(k), v) for k, v in theirs.items() if drafter.get(k) != v}
    if changed:
        notes.append(f"drafter.init_from {folder}: the drafter's shape is the folder's: "
                     + ", ".join(f"{k} {v!r} (default {old!r})" for k, (old, v) in sorted(changed.items())))
    if start.aliases:
        notes.append(f"drafter.init_from {folder}: tensors {', '.join(sorted(start.aliases))} (the official "
                     f"package's save_pretrained names) are read as {', '.join(sorted(start.aliases.values()))}")
    drafter.update(theirs)
    return notes


# ---------------------------------------------------------------------------------------------------------------
# the folder against the target (draftsmith.target_checks)


def _token_id(name: Any, folder: Path) -> int | None:
    """The id of a special token given as text (``"<|im_end|>"`` or ``{"content": ...}``) in the target's
    tokenizer files: ``tokenizer_config.json``'s ``added_tokens_decoder``, ``tokenizer.json``'s ``added_tokens``
    and vocabulary; None when not found."""
    if isinstance(name, Mapping):
        name = name.get("content")
    if not isinstance(name, str):
        return None
    for fname in ("tokenizer_config.json", "tokenizer.json"):
        path = folder / fname
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        for token_id, token in (data.get("added_tokens_decoder") or {}).items():
            if isinstance(token, Mapping) and token.get("content") == name and str(token_id).isdigit():
                return int(token_id)
        for token in data.get("added_tokens") or []:
            if isinstance(token, Mapping) and token.get("content") == name and isinstance(token.get("id"), int):
                return int(token["id"])
        vocab = (data.get("model") or {}).get("vocab") if isinstance(data.get("model"), Mapping) else None
        if isinstance(vocab, Mapping) and isinstance(vocab.get(name), int):
            return int(vocab[name])
    return None


def target_emitted_tokens(target_dir: str | os.PathLike) -> dict[int, str]:
    """The target's eos and pad tokens, read as JSON: ``{token id: where}`` from ``eos_token_id`` / ``pad_token_id``
    of ``config.json`` (and its ``text_config``) and ``generation_config.json`` (ints or lists), and the
    ``eos_token`` / ``pad_token`` of ``tokenizer_config.json`` (by their text). These are the tokens the target ends
    an answer with or pads with; the chat template's own end-of-turn token is among them for every chat model
    whose ``generation_config.json`` lists it (Qwen, Llama 3), and training checks the whole stop policy
    (:func:`draftsmith.chat.stop_token_ids`) again once the tokenizer is loaded."""
    folder = Path(target_dir)
    out: dict[int, str] = {}

    def add(value: Any, where: str) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                out.setdefault(int(v), where)

    for fname in ("config.json", "generation_config.json"):
        try:
            data = json.loads((folder / fname).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict):
            continue
        for section, prefix in ((data, ""), (data.get("text_config") or {}, "text_config.")):
            if isinstance(section, dict):
                for key in ("eos_token_id", "pad_token_id"):
                    add(section.get(key), f"{fname} {prefix}{key}")
    try:
        tok = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        tok = {}
    if isinstance(tok, dict):
        for key in ("eos_token", "pad_token"):
            token_id = _token_id(tok.get(key), folder)
            if token_id is not None:
                text = tok[key].get("content") if isinstance(tok[key], Mapping) else tok[key]
                out.setdefault(token_id, f"tokenizer_config.json {key} {text!r}")
    return out


def _embedding_rows(target_dir: Path) -> int | None:
    """Rows of the target's input embedding from its safetensors header(s), None when not found."""
    index = target_dir / "model.safetensors.index.json"
    files: list[Path] = []
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            weight_map = {}
        files = [target_dir / weight_map[k] for k in EMBED_KEYS if k in weight_map][:1]
    else:
        files = sorted(target_dir.glob("*.safetensors"))
    for path in files:
        try:
            header = safetensors_header(path)
        except InitFromError:
            continue
        for key in EMBED_KEYS:
            if key in header and len(header[key].get("shape", ())) == 2:
                return int(header[key]["shape"][0])
    return None


def start_target_errors(config: Mapping, target_dir: str | os.PathLike, *, num_layers: int | None,
                        hidden_size: int | None, vocab_size: int | None) -> list[str]:
    """``drafter.init_from`` against the target folder, one line per difference (``[]`` when it fits or there is no
    start): the taps inside the target's ``num_layers`` decoder layers and the folder's ``num_target_layers`` equal
    to them, ``hidden_size`` and the vocabulary (the target embedding's rows, else its ``vocab_size``) equal to the
    target's, and the mask token none of the target's eos / pad tokens (:func:`target_emitted_tokens`) unless
    ``drafter.mask_token_id`` gives the same id (a confirmation: draftsmith itself falls back to eos as the mask
    token of a target whose tokenizer has no mask token and no unused embedding row, SmolLM2 among them).

    Raises:
        InitFromError: the start folder itself is unreadable (:func:`read_start`).
    """
    drafter = config.get("drafter") or {}
    init = drafter.get("init_from")
    if not init:
        return []
    start = read_start(init)
    target_dir = Path(target_dir)
    cfg, where = start.config, start.config_path
    out = []
    if num_layers is not None:
        bad = [i for i in start.layer_ids if not 0 <= i < num_layers]
        n = cfg.get("num_target_layers")
        if bad or (n is not None and int(n) != num_layers):
            out.append(f"drafter.init_from: the start drafter was trained for a target of {n} decoder layers, tapping "
                       f"{start.layer_ids} ({where} num_target_layers, dflash_config.target_layer_ids), but the target "
                       f"{target_dir} has {num_layers} (ids 0..{num_layers - 1}): it was made for another target")
    if hidden_size is not None and int(cfg["hidden_size"]) != hidden_size:
        out.append(f"drafter.init_from: the start drafter's hidden_size is {cfg['hidden_size']} ({where}), the "
                   f"target's {hidden_size} ({target_dir}/config.json): its fc and layers are sized for another target")
    rows = _embedding_rows(target_dir)
    vocab = rows if rows is not None else vocab_size
    if vocab is not None and int(cfg["vocab_size"]) != vocab:
        what = "embedding rows" if rows is not None else "vocab_size"
        out.append(f"drafter.init_from: the start drafter's vocab_size is {cfg['vocab_size']} ({where}), the target "
                   f"has {vocab} {what} ({target_dir}): another vocabulary (a tokenizer with added or removed tokens)")
    mask = start.mask_token_id
    if vocab is not None and not 0 <= mask < vocab:
        out.append(f"drafter.init_from: the start drafter's mask token {mask} is outside the target's vocabulary "
                   f"0..{vocab - 1}")
    emitted = target_emitted_tokens(target_dir)
    confirmed = drafter.get("mask_token_id")
    if mask in emitted and confirmed != mask:
        out.append(f"drafter.init_from: the start drafter's mask token {mask} ({where} dflash_config.mask_token_id) "
                   f"is a token the target emits ({emitted[mask]} in {target_dir}): a drafter trained for this target "
                   "with another tokenizer, or a fine-tune that gave the row a meaning? If the drafter was trained "
                   f"with this mask for this very target, confirm it: drafter.mask_token_id: {mask}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# training: the weights


def load_start_weights(model, folder: str | os.PathLike) -> dict[str, Any]:
    """Load the start folder's weights into ``model`` (a draftsmith ``DFlashDraftModel`` / ``DFlash2DraftModel``
    built from the folder's config), strictly: every tensor of the model from the file, cast to the model's dtype
    and device (bf16 values cast to float32 are exact), official aliases read as the release names.

    Returns:
        ``{"tensors": n, "dtypes": sorted safetensors dtypes, "aliases": {...}}`` for the log.

    Raises:
        InitFromError: a missing, extra or misshapen tensor (every one named: the model's own state dict is the
            reference here, so a divergence from :func:`expected_tensors` shows too).
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    path = folder / "model.safetensors"
    own = model.state_dict()
    with safe_open(str(path), framework="pt") as fh:
        keys = list(fh.keys())
        names = {OFFICIAL_ALIASES.get(k, k) if OFFICIAL_ALIASES.get(k) in own else k: k for k in keys}
        missing = sorted(set(own) - set(names))
        extra = sorted(set(names) - set(own))
        wrong = sorted(k for k in set(own) & set(names)
                       if tuple(fh.get_slice(names[k]).get_shape()) != tuple(own[k].shape))
        if missing or extra or wrong:
            raise InitFromError(f"drafter.init_from: {path} does not fit the drafter its config.json builds: missing "
                                f"{missing[:8]}, extra {extra[:8]}, wrong shapes {wrong[:8]}")
        dtypes = set()
        with torch.no_grad():
            for name, tensor in own.items():
                value = fh.get_tensor(names[name])
                dtypes.add(str(value.dtype).replace("torch.", ""))
                tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
    return {"tensors": len(own), "dtypes": sorted(dtypes),
            "aliases": {k: v for v, k in names.items() if v != k}}


def start_config_errors(start: StartDrafter, drafter_settings: Mapping[str, Any], layer_ids: Sequence[int]
                        ) -> list[str]:
    """What training refuses before building the drafter from the start folder: the ``drafter`` settings it runs
    with (non-null values; the rule's params, which planning made the folder's) against the folder
    (:func:`contradictions`), the features' layer ids against the folder's taps, and the tensor set
    (:func:`tensor_errors`)."""
    given = {k: (v, "the train settings") for k, v in drafter_settings.items() if v is not None}
    errors = tensor_errors(start) + contradictions(start, given)
    if [int(i) for i in layer_ids] != start.layer_ids:
        errors.append(f"the features were extracted at layers {list(layer_ids)}, but the start drafter "
                      f"{start.config_path} taps {start.layer_ids}: extract again (snakemake plans it when "
                      "drafter.init_from changes the taps)")
    return errors
