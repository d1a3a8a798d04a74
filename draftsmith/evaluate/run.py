"""The evaluate stage: decode every benchmark prompt three ways in the same run and write the report.

For each prompt of each set: target-only decoding (the baseline and the lossless reference), DFlash
speculative decoding with the exported drafter, and prompt-lookup speculative decoding (reference
drafter), in an order rotated from prompt to prompt so that no method is always timed first.

Resume: each decoding process saves the conversations it has decoded under ``partial_dir/<set>/`` (atomically, at
most ``evaluate.checkpoint_interval`` seconds apart and at the end of each set, keyed by a fingerprint of the
drafter weights, target, set, sampling and template kwargs), so a killed job loses at most that many seconds of
decoding; a rerun, with any number of decoding workers, reuses every saved conversation, and a process with
nothing left to decode never loads the target. The folder is removed once the report is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from draftsmith.evaluate.decode import (
    DFlashProposer,
    GenerationResult,
    PromptLookupProposer,
    speculative_generate,
    target_generate,
)
from draftsmith.config import REMOVED_STOP_TOKENS, schema_defaults
from draftsmith.evaluate.prompts import load_sets, render
from draftsmith.evaluate.report import (
    lossless_check,
    plot_histogram,
    plot_per_position,
    plot_tau,
    render_markdown,
    summarize,
)
from draftsmith.evaluate.sampling import SamplingConfig
from draftsmith.io import target_fingerprint
from draftsmith.io import progress, read_json, sha256_file, write_json, write_text

log = logging.getLogger("draftsmith.evaluate")

METHODS = ("target_only", "dflash", "prompt_lookup")
REPORT_FORMAT = "draftsmith.eval/2"


# ------------------------------------------------------------------------------------------------
# Loading and checks
# ------------------------------------------------------------------------------------------------

def load_drafter(folder: str | os.PathLike, *, device: torch.device | str, dtype: torch.dtype,
                 implementation: str = "draftsmith") -> nn.Module:
    """Load an exported DFlash drafter folder (z-lab format: config.json + model.safetensors).

    Args:
        implementation: ``draftsmith`` (``draftsmith.modeling.DFlashDraftModel``) or ``dflash`` (the
            official z-lab package, if installed); both have the same inference interface.

    Raises:
        FileNotFoundError: missing folder / files.
        ValueError: a DFlash-2 checkpoint (candidate selector; not supported), or an unknown implementation.
    """
    folder = Path(folder)
    drafter_config(folder)  # the folder's checks, before loading weights
    if implementation == "draftsmith":
        from draftsmith.modeling import DFlashDraftModel

        return DFlashDraftModel.from_pretrained(folder, dtype=dtype, device=device).eval()
    if implementation == "dflash":
        from dflash.model import DFlashDraftModel as Official

        return Official.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    raise ValueError(f"unknown drafter implementation {implementation!r} (draftsmith, dflash)")


def drafter_config(folder: str | os.PathLike) -> dict:
    """An exported drafter folder's ``config.json`` (a dict), read without loading weights.

    Raises:
        FileNotFoundError: no ``config.json`` (naming the path).
        ValueError: a DFlash-2 checkpoint (candidate selector; not supported).
    """
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist: not an exported drafter folder")
    raw = read_json(cfg_path)
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise ValueError(f"{cfg_path}: DFlash2DraftModel checkpoints (candidate selector) are not supported")
    return raw


def check_pair(drafter: nn.Module, target: nn.Module) -> None:
    """Raise ``ValueError`` (naming the field) unless the drafter was built for this target: width,
    number of target layers, tapped layer ids within range, mask token inside the embedding."""
    from draftsmith.target import num_layers, text_config
    from draftsmith.target_layers import validate_layer_ids

    L = num_layers(target)
    tcfg = text_config(target.config)
    n_cfg = getattr(drafter.config, "num_target_layers", None)
    if n_cfg is not None and int(n_cfg) != L:
        raise ValueError(f"drafter config num_target_layers={n_cfg} but the target has {L} decoder layers: "
                         "the drafter was trained for another target")
    validate_layer_ids(list(drafter.target_layer_ids), L)
    if int(drafter.config.hidden_size) != int(tcfg.hidden_size):
        raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} != target hidden_size {tcfg.hidden_size}")
    rows = target.get_input_embeddings().weight.shape[0]
    if drafter.mask_token_id is None or not 0 <= int(drafter.mask_token_id) < rows:
        raise ValueError(f"drafter dflash_config.mask_token_id={drafter.mask_token_id} is not a row of the "
                         f"target's embedding (0..{rows - 1})")




def prompt_key(ids: list[int]) -> str:
    """Identity of a rendered prompt: sha256 hex (16 digits) of its token ids. Two sets holding the same
    prompt (the same curated row, or the same text from two rows) give the same key."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def _gen_seed(seed: int, label: str) -> int:
    """Seed of a prompt's sampling draws, from the run seed and the prompt label ``<row id>#<turn>``."""
    row_id, turn = label.rsplit("#", 1)
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}:{turn}".encode()).digest()[:6], "little")


# ------------------------------------------------------------------------------------------------
# Partial results (resume)
# ------------------------------------------------------------------------------------------------

def _result_from_dict(d: dict) -> GenerationResult:
    return GenerationResult(**d)


def _saved_file(partial: Path, set_name: str, writer: str) -> Path:
    """Where one decoding process (``writer``: ``main`` or ``worker-<w>-of-<n>``) saves a set's conversations."""
    return partial / set_name / f"{writer}.json"


def _save_conversations(path: Path, key: str, records: dict[str, dict]) -> None:
    """Save a set's decoded conversations (atomically): ``{"key": set key, "conversations": {id: record}}``."""
    write_json(path, {"key": key, "conversations": records})


def _load_saved(partial: Path, set_name: str, key: str) -> dict[str, dict]:
    """Every conversation of a set that any decoding process saved with this key (a file that is not valid JSON
    or was computed with other inputs is logged and left out): ``{conversation id: record}``."""
    out: dict[str, dict] = {}
    for path in sorted((partial / set_name).glob("*.json")):
        try:
            data = read_json(path)
        except ValueError:
            log.warning("%s is not valid JSON: its conversations are decoded again", path)
            continue
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("conversations"), dict):
            log.info("%s was computed with other inputs: its conversations are decoded again", path)
            continue
        out.update(data["conversations"])
    return out


# ------------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Decoding:
    """Everything decoding one prompt needs, built once per run (:func:`_prepare_decoding`). The target, the
    drafter and the static path (``target``, ``dflash``, ``static``) are loaded by :meth:`load`, on the first
    prompt that is not already saved: planning, resuming and merging need only the tokenizer and the configs."""

    tokenizer: object
    template_kwargs: dict
    tokenizer_fingerprint: str
    stops: list[int]
    lookup: PromptLookupProposer
    sampling: SamplingConfig
    seed: int
    rollback: str
    device: torch.device
    dtype: torch.dtype
    max_prompt_tokens: int
    max_positions: int
    block_size: int  # the verify width B (evaluate.block_size, else the drafter's)
    layer_ids: list[int]
    mask_token_id: int | None
    loader: object = None  # () -> (target, DFlashProposer, static or None)
    target: nn.Module | None = None
    dflash: DFlashProposer | None = None
    static: object | None = None
    warmed: bool = False

    def load(self) -> None:
        """Load the target and the drafter and build the proposers and the static path (once)."""
        if self.target is None:
            self.target, self.dflash, self.static = self.loader()

    def fits(self, num_prompt_tokens: int, max_new: int) -> bool:
        return num_prompt_tokens <= self.max_prompt_tokens and num_prompt_tokens + max_new <= self.max_positions

    def render(self, messages: list[dict], tools) -> list[int]:
        return render(self.tokenizer, messages, tools, self.template_kwargs)

    def draw_seed(self, label: str) -> int:
        """The sampling seed of a prompt (0 when greedy: greedy output does not depend on it)."""
        return 0 if self.sampling.greedy else _gen_seed(self.seed, label)

    def decode(self, ids: list[int], max_new: int, gen_seed: int, rotate: int = 0) -> dict[str, GenerationResult]:
        """One prompt decoded by every method (in an order rotated by ``rotate``: no method always first) and,
        when greedy on the static path, the lossless reference (target-only at the verify width)."""
        self.load()
        out = {}
        order = METHODS[rotate % len(METHODS):] + METHODS[:rotate % len(METHODS)]
        for method in order:
            gen = torch.Generator(device=self.device).manual_seed(gen_seed) if not self.sampling.greedy else None
            if method == "target_only":
                out[method] = target_generate(self.target, ids, max_new_tokens=max_new, stop_token_ids=self.stops,
                                              sampling=self.sampling, generator=gen, static=self.static)
            else:
                proposer = self.dflash if method == "dflash" else self.lookup
                out[method] = speculative_generate(self.target, proposer, ids, max_new_tokens=max_new,
                                                   stop_token_ids=self.stops, sampling=self.sampling, generator=gen,
                                                   rollback=self.rollback, static=self.static)
        if self.static is not None and self.sampling.greedy:  # the lossless reference: verification's kernels
            out["reference"] = target_generate(self.target, ids, max_new_tokens=max_new, stop_token_ids=self.stops,
                                               sampling=self.sampling, static=self.static, width=None)
        return out


def _prepare_decoding(target_dir: str, drafter_dir: str, tokenized_eval: str, evaluate_cfg: dict,
                      target_cfg: dict, device: torch.device | str | None, drafter_implementation: str
                      ) -> _Decoding:
    """Tokenizer (checked against the one training used), stop policy, the decoding settings from the configs
    and the drafter's ``config.json``; the target, drafter, DFlash proposer and static decoding path are loaded
    by :meth:`_Decoding.load` when the first prompt is decoded.

    Raises:
        ValueError: another tokenizer / template than training's, the removed ``stop_tokens`` key, no stop
            token; when loading: a drafter that does not fit the target.
        FileNotFoundError / ValueError: ``drafter_dir`` is not an exported DFlash drafter (:func:`drafter_config`).
    """
    import types

    from transformers import AutoConfig

    from draftsmith.chat import load_tokenizer, stop_token_ids, tokenizer_fingerprint
    from draftsmith.drafter_config import draft_value
    from draftsmith.target import default_device, load_target, resolve_dtype, text_config
    from draftsmith.tokenized import read_tokenized_metadata

    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(target_cfg["dtype"], device)
    meta = read_tokenized_metadata(tokenized_eval)
    template_kwargs = meta["chat_template_kwargs"]
    trust = bool(target_cfg["trust_remote_code"])
    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust)
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != meta["tokenizer_fingerprint"]:
        raise ValueError(f"{tokenized_eval}: the training data was tokenized with another tokenizer / chat template "
                         f"(fingerprint {meta['tokenizer_fingerprint'][:12]}) than the target's in {target_dir} "
                         f"({fingerprint[:12]}); evaluation must render prompts exactly as training did")
    if evaluate_cfg["stop_tokens"]:
        raise ValueError(REMOVED_STOP_TOKENS)
    stops = stop_token_ids(tokenizer, target_dir, template_kwargs)  # the policy regenerate and tokenize use
    if not stops:
        raise ValueError(f"{target_dir}: no stop token: the tokenizer, config.json and generation_config.json "
                         "name no eos_token_id and the chat template writes no end-of-turn token")

    cfg_path = Path(drafter_dir) / "config.json"
    drafter_cfg = types.SimpleNamespace(**drafter_config(drafter_dir))
    block_size = int(evaluate_cfg["block_size"] or draft_value(drafter_cfg, "block_size", 16))
    layer_ids = [int(i) for i in draft_value(drafter_cfg, "target_layer_ids", [])]
    mask = draft_value(drafter_cfg, "mask_token_id")
    lookup = PromptLookupProposer(int(evaluate_cfg["prompt_lookup_ngram"]),
                                  int(evaluate_cfg["prompt_lookup_num_tokens"] or block_size - 1))
    target_config = text_config(AutoConfig.from_pretrained(target_dir, trust_remote_code=trust))
    max_positions = int(getattr(target_config, "max_position_embeddings", None) or 1 << 30)
    max_prompt_tokens = int(evaluate_cfg["max_prompt_tokens"] or max_positions)

    def load_models():
        target = load_target(target_dir, dtype=target_cfg["dtype"], device=device,
                             attn_implementation=target_cfg["attn_implementation"], trust_remote_code=trust)
        drafter = load_drafter(drafter_dir, device=device, dtype=dtype, implementation=drafter_implementation)
        check_pair(drafter, target)
        dflash = DFlashProposer(drafter, target, block_size=evaluate_cfg["block_size"])
        if (dflash.block_size, dflash.layer_ids, dflash.mask_token_id) != (block_size, layer_ids, mask):
            raise RuntimeError(f"{cfg_path}: the loaded drafter has block size {dflash.block_size}, target layer ids "
                               f"{dflash.layer_ids}, mask token {dflash.mask_token_id}; its config.json read "
                               f"{block_size}, {layer_ids}, {mask}")
        static = _static_target(target, evaluate_cfg, dflash, lookup, max_prompt_tokens, max_positions, device)
        return target, dflash, static

    sampling = SamplingConfig(float(evaluate_cfg["temperature"]), float(evaluate_cfg["top_p"]),
                              int(evaluate_cfg["top_k"]))
    return _Decoding(tokenizer=tokenizer, template_kwargs=template_kwargs, tokenizer_fingerprint=fingerprint,
                     stops=stops, lookup=lookup, sampling=sampling, seed=int(evaluate_cfg["seed"]),
                     rollback=evaluate_cfg["rollback"], device=device, dtype=dtype,
                     max_prompt_tokens=max_prompt_tokens, max_positions=max_positions, block_size=block_size,
                     layer_ids=layer_ids, mask_token_id=None if mask is None else int(mask), loader=load_models)


def _decode_set(decoding: _Decoding, bset, decoded: dict, bar, saved: dict | None = None, save=None,
                interval: float = 60.0) -> dict:
    """Decode one benchmark set turn by turn: each later turn is asked after the target's own answer.

    ``decoded`` maps ``(prompt key, budget, draw seed)`` to earlier results: a prompt that sits in several sets
    (a held-out row that is also a BFCL / MMATH set row) is decoded once. ``saved`` maps conversation ids to
    records an earlier run saved (:func:`_load_saved`): those conversations are not decoded again. ``save(records)``
    is called with every conversation done so far (JSON records) at most ``interval`` seconds apart and once at the
    end (when anything was decoded).

    Returns:
        ``{"results": {method: [GenerationResult]}, "labels", "prompt_keys", "skipped_prompts", "planned"}``, in
        the set's conversation and turn order.
    """
    saved = saved or {}
    records: dict[str, dict] = {}
    labels_so_far = 0
    so_far: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}  # the progress line's τ
    last_save, fresh = time.monotonic(), 0
    for conv in bset.conversations:
        if conv.id in saved:
            records[conv.id] = rec = saved[conv.id]
            for k, (pkey, label) in enumerate(zip(rec["prompt_keys"], rec["labels"])):
                decoded.setdefault((pkey, bset.max_new_tokens, decoding.draw_seed(label)),
                                   ({m: _result_from_dict(rs[k]) for m, rs in rec["results"].items()},
                                    f"{bset.name}:{label}"))
            labels_so_far += len(rec["labels"])
            bar.update(rec["planned"])
            continue
        rec = _decode_conversation(decoding, bset, conv, decoded, bar, labels_so_far, so_far)
        records[conv.id] = rec
        labels_so_far += len(rec["labels"])
        fresh += 1
        if save is not None and time.monotonic() - last_save >= interval:
            save(records)
            last_save = time.monotonic()
    if save is not None and fresh:
        save(records)
    return _aggregate(bset, records)


def _decode_conversation(decoding: _Decoding, bset, conv, decoded: dict, bar, rotate: int,
                         so_far: dict[str, list[GenerationResult]]) -> dict:
    """One conversation of a set, every user turn after the target's answer to the last: its JSON record
    ``{"results": {method: [GenerationResult as dict]}, "labels", "prompt_keys", "skipped", "planned"}``
    (``so_far``: this process's results of the set, for the progress line)."""
    rec = {"results": {m: [] for m in METHODS}, "labels": [], "prompt_keys": [], "skipped": {},
           "planned": len(conv.user_turns)}
    history = list(conv.context)
    for t, turn in enumerate(conv.user_turns):
        history = history + turn
        ids = decoding.render(history, conv.tools)
        if not decoding.fits(len(ids), bset.max_new_tokens):  # a later turn (first turns fit)
            left = len(conv.user_turns) - t  # later turns need this one's answer
            rec["skipped"]["prompt_too_long"] = left
            log.warning("set %s: %s turn %d has %d prompt tokens (limit %d, +%d new <= %d): "
                        "skipped with %d later turn(s)", bset.name, conv.id, t, len(ids),
                        decoding.max_prompt_tokens, bset.max_new_tokens, decoding.max_positions, left - 1)
            bar.update(left)
            break
        if not decoding.warmed:  # first-call costs (loading, CUDA graphs, kernels) out of the timings
            decoding.decode(ids, min(16, bset.max_new_tokens), decoding.seed)
            decoding.warmed = True
        label = f"{conv.id}#{t}"
        pkey = prompt_key(ids)
        again = decoded.get((pkey, bset.max_new_tokens, decoding.draw_seed(label)))
        if again is not None:
            res = again[0]
            log.info("set %s %s: the same prompt as %s, decoded there: its results are reused",
                     bset.name, label, again[1])
        else:
            res = decoding.decode(ids, bset.max_new_tokens, _gen_seed(decoding.seed, label),
                                  rotate=rotate + len(rec["labels"]))
            decoded[(pkey, bset.max_new_tokens, decoding.draw_seed(label))] = (res, f"{bset.name}:{label}")
        for m, r in res.items():
            rec["results"].setdefault(m, []).append(dataclasses.asdict(r))
            so_far.setdefault(m, []).append(r)
        rec["labels"].append(label)
        rec["prompt_keys"].append(pkey)
        answer = decoding.tokenizer.decode(res["target_only"].tokens, skip_special_tokens=True)
        history = history + [{"role": "assistant", "content": answer}]
        log.debug("set %s %s#%d: %d prompt tokens, %d new; τ dflash %.2f, lookup %.2f",
                  bset.name, conv.id, t, len(ids), len(res["target_only"].tokens),
                  res["dflash"].tau, res["prompt_lookup"].tau)
        bar.set_postfix_str(f"set {bset.name}, τ so far: dflash {summarize(so_far['dflash'])['tau']:.2f}"
                            f", lookup {summarize(so_far['prompt_lookup'])['tau']:.2f}", refresh=False)
        bar.update(1)
    return rec


def _aggregate(bset, records: dict[str, dict]) -> dict:
    """A set's conversation records (every conversation of ``bset`` present) joined in its conversation order:
    ``{"results": {method: [GenerationResult]}, "labels", "prompt_keys", "skipped_prompts", "planned"}``.

    Raises:
        RuntimeError: a conversation of the set has no record.
    """
    missing = [c.id for c in bset.conversations if c.id not in records]
    if missing:
        raise RuntimeError(f"set {bset.name}: no decoded results for {len(missing)} of its conversations "
                           f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    results: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}
    labels, keys, skipped, planned = [], [], {}, 0
    for conv in bset.conversations:
        rec = records[conv.id]
        for m, rs in rec["results"].items():
            results.setdefault(m, []).extend(_result_from_dict(d) for d in rs)
        labels += rec["labels"]
        keys += rec["prompt_keys"]
        for reason, n in rec["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        planned += rec["planned"]
    return {"results": results, "labels": labels, "prompt_keys": keys, "skipped_prompts": skipped,
            "planned": planned}


def _run_metadata(decoding: _Decoding, target_dir: str, drafter_dir: str, drafter_sha: str,
                  drafter_implementation: str, decoding_path: dict) -> dict:
    """The report's ``run`` section: what was decoded, how (``decoding_path``: :func:`_decoding_path`), with which
    versions."""
    sampling = decoding.sampling
    return {
        "target": str(target_dir), "drafter": str(drafter_dir), "drafter_sha256": drafter_sha,
        "drafter_implementation": drafter_implementation,
        "block_size": decoding.block_size, "target_layer_ids": decoding.layer_ids,
        "mask_token_id": decoding.mask_token_id, "device": _device_name(decoding.device),
        "dtype": str(decoding.dtype).replace("torch.", ""),
        "sampling": dataclasses.asdict(sampling), "sampling_text": _sampling_text(sampling), "seed": decoding.seed,
        "chat_template_kwargs": decoding.template_kwargs, "tokenizer_fingerprint": decoding.tokenizer_fingerprint,
        "stop_token_ids": decoding.stops,
        "prompt_lookup_ngram": decoding.lookup.max_ngram, "prompt_lookup_num_tokens": decoding.lookup.max_drafts,
        **decoding_path,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "python": platform.python_version()},
    }


def _decoding_path(decoding: _Decoding) -> dict:
    """How the loaded target decodes: its rollback, the KV cache kind, the lossless reference (report ``run``)."""
    decoding.load()
    static = decoding.static
    return {
        "rollback": _rollback_text(decoding.target, decoding.rollback),
        "decoding": ("static KV cache" + (", CUDA graphs" if static.cuda_graphs else "") if static is not None
                     else "dynamic KV cache"),
        "lossless_reference": (f"greedy target-only decoding with forwards padded to the verify width "
                               f"({static.verify_width} tokens: the kernels verification runs)"
                               if static is not None else "greedy target-only decoding"),
    }


def _plan(decoding: _Decoding, inputs: dict) -> tuple[list, dict]:
    """``(the benchmark sets, the key every set's saved results carry)``: the sets' first prompts that fit, and a
    fingerprint of the drafter weights, target, tokenizer, sampling and decoding settings."""
    def first_prompt_fits(conv, max_new: int) -> bool:
        return decoding.fits(len(decoding.render(list(conv.context) + conv.user_turns[0], conv.tools)), max_new)

    evaluate_cfg = inputs["evaluate_cfg"]
    sets = load_sets(inputs["curated_eval"], evaluate_cfg["sets"] or {},
                     heldout_sources=[s["name"] for s in inputs["sources"] if s.get("split", "both") == "both"],
                     first_prompt_fits=first_prompt_fits)
    if not sets:
        raise ValueError("evaluate.sets is empty: nothing to evaluate")
    base_key = {"format": REPORT_FORMAT, "drafter": sha256_file(Path(inputs["drafter_dir"]) / "model.safetensors"),
                "target": target_fingerprint(inputs["target_dir"]),
                "tokenizer": decoding.tokenizer_fingerprint, "template_kwargs": decoding.template_kwargs,
                "sampling": dataclasses.asdict(decoding.sampling), "seed": decoding.seed,
                "block_size": decoding.block_size,
                "lookup": [decoding.lookup.max_ngram, decoding.lookup.max_drafts], "stops": decoding.stops,
                "device": decoding.device.type, "dtype": str(decoding.dtype), "rollback": decoding.rollback,
                "max_prompt_tokens": decoding.max_prompt_tokens}
    return sets, base_key


def _set_key(base_key: dict, bset) -> str:
    """The key of one set's saved results: :func:`_plan`'s fingerprint, the set's settings and rows."""
    return hashlib.sha256(json.dumps({**base_key, "set": [bset.name, bset.source, bset.max_prompts,
                                                          bset.max_new_tokens],
                                      "rows": [c.id for c in bset.conversations]}, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Decoding workers: one process per GPU, each with its share of the conversations
# ------------------------------------------------------------------------------------------------

def _on_cuda(device: torch.device | str | None) -> bool:
    """Whether the job decodes on CUDA: ``device``'s type, or (None) whether CUDA is there."""
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def decoding_workers(evaluate_cfg: dict, device: torch.device | str | None = None) -> int:
    """Decoding processes for an evaluate job: ``evaluate.gpus`` when the job runs on CUDA and sees at least that
    many GPUs (its lease), else 1 (on the CPU, or a job given fewer GPUs)."""
    gpus = int(evaluate_cfg.get("gpus") or 0)
    if gpus > 1 and _on_cuda(device) and torch.cuda.device_count() >= gpus:
        return gpus
    return 1


def worker_of(conversation_id: str, workers: int) -> int:
    """The worker that decodes a conversation: a stable hash of its id modulo ``workers``. A conversation that sits
    in several sets goes to one worker, which decodes their shared prompts once, as a single process does."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % workers


def _unsaved(bset, saved: dict[str, dict]) -> list:
    """The conversations of a set that no decoding process has saved."""
    return [c for c in bset.conversations if c.id not in saved]


def _run_workers(workers: int, inputs: dict, device: torch.device | str | None, which: list[int]) -> None:
    """Start decoding processes ``which`` of ``workers`` (``python -m draftsmith.evaluate.worker``), worker ``w``
    on GPU ``w`` of ``CUDA_VISIBLE_DEVICES`` (or the CPU), and wait for them all; their log lines go to this job's
    log file.

    Raises:
        RuntimeError: a worker exited with an error (naming it and its exit code).
    """
    on_cuda = _on_cuda(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count() if on_cuda else 0)]
    file_handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for h in file_handlers:  # from now on this process appends too: the workers append to the same log
        h.mode = "a"
        h.close()  # reopened, appending, by its next line
    log_files = [h.baseFilename for h in file_handlers]
    Path(inputs["partial"]).mkdir(parents=True, exist_ok=True)
    args_file = Path(inputs["partial"]) / "worker-args.json"
    write_json(args_file, {**inputs, "workers": workers, "log_file": log_files[0] if log_files else None,
                           "device": "cuda" if on_cuda else "cpu",
                           "threads": max(1, torch.get_num_threads() // workers)})
    procs = []
    for w in which:
        env = dict(os.environ)
        if on_cuda:
            env["CUDA_VISIBLE_DEVICES"] = gpus[w]
        procs.append(subprocess.Popen([sys.executable, "-m", "draftsmith.evaluate.worker", "--worker", str(w),
                                       "--args", str(args_file)], env=env))
    log.info("evaluate: %d decoding workers started (%s)%s", len(which),
             ", ".join(f"worker {w} on GPU {gpus[w]}" if on_cuda else f"worker {w} on the CPU" for w in which),
             f"; {workers - len(which)} of {workers} had every conversation saved" if len(which) < workers else "")
    codes = [p.wait() for p in procs]
    failed = [f"worker {w} (exit code {c})" for w, c in zip(which, codes) if c != 0]
    if failed:
        raise RuntimeError(f"evaluate: decoding {', '.join(failed)} failed: the traceback is in the log above")


def _decode_worker(worker: int, args: dict) -> None:
    """One decoding worker: the sets' conversations :func:`worker_of` gives it, decoded as :func:`run_evaluate`
    decodes them and saved to ``partial/<set>/worker-<w>-of-<n>.json`` as it goes; conversations any earlier
    process saved are reused, and a worker with nothing left never loads the target. A worker that loaded the
    models writes how they decode (``partial/decoding.json``) for the report."""
    workers, partial = int(args["workers"]), Path(args["partial"])
    torch.set_num_threads(int(args["threads"]))
    device = torch.device("cuda", 0) if args["device"] == "cuda" else torch.device("cpu")
    decoding = _prepare_decoding(args["target_dir"], args["drafter_dir"], args["tokenized_eval"],
                                 args["evaluate_cfg"], args["target_cfg"], device, args["drafter_implementation"])
    sets, base_key = _plan(decoding, args)
    mine = [dataclasses.replace(b, conversations=[c for c in b.conversations if worker_of(c.id, workers) == worker])
            for b in sets]
    bar = progress(sum(len(c.user_turns) for b in mine for c in b.conversations), f"evaluate worker {worker}",
                   unit="prompt", logger=log, interval=float(args["evaluate_cfg"]["progress_interval"]))
    decoded: dict = {}
    interval = float(args["evaluate_cfg"]["checkpoint_interval"])
    for bset, own in zip(sets, mine):
        key, path = _set_key(base_key, bset), _saved_file(partial, bset.name, f"worker-{worker}-of-{workers}")
        _decode_set(decoding, own, decoded, bar, _load_saved(partial, bset.name, key),
                    lambda records, key=key, path=path: _save_conversations(path, key, records), interval)
    bar.close()
    if decoding.target is not None:
        write_json(partial / "decoding.json", _decoding_path(decoding))
    from draftsmith.gpu import log_peak_memory

    log.info("evaluate worker %d done (GPU %s)%s", worker, os.environ.get("CUDA_VISIBLE_DEVICES", "none"),
             "" if decoding.target is not None else ": every conversation was saved by an earlier run")
    log_peak_memory(log)  # each worker's own peak: the job's line after it is the merging process's


def main(argv: list[str] | None = None) -> int:
    """``python -m draftsmith.evaluate.worker --worker W --args FILE``: one decoding worker of an evaluate job."""
    import argparse

    from draftsmith.io import setup_logging

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--args", required=True, help="JSON written by the evaluate job")
    opts = ap.parse_args(argv)
    args = read_json(opts.args)
    setup_logging(args["log_file"], append=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _decode_worker(opts.worker, args)
    return 0


def run_evaluate(*, target_dir: str, drafter_dir: str, curated_eval: str, tokenized_eval: str,
                 outputs: dict[str, str], evaluate_cfg: dict, target_cfg: dict, sources: list[dict],
                 device: torch.device | str | None = None,
                 partial_dir: str | None = None, drafter_implementation: str = "draftsmith",
                 trainer_state: str | None = None, workers: int | None = None) -> dict:
    """Run the evaluate stage and write report.json, report.md and the three plots.

    Steps: prepare the decoders (:func:`_prepare_decoding`; the models load with the first prompt decoded) ->
    read the sets (first prompts that fit) -> per set, reuse the conversations an interrupted run saved and
    decode the others (:func:`_decode_set`, saving as it goes), or with several workers start those with
    conversations left and join their saved results -> the report (per set, and "all" counting a prompt in
    several sets once) -> report.md and plots.

    Args:
        target_dir: the target's Hugging Face folder.
        drafter_dir: the exported drafter folder (``results/drafter/final``).
        curated_eval: ``results/curated/eval.parquet`` (benchmark conversations).
        tokenized_eval: ``results/tokenized/eval.parquet`` (its metadata: chat template kwargs and
            tokenizer fingerprint used for training).
        outputs: paths ``json``, ``md``, ``tau``, ``positions``, ``histogram``.
        evaluate_cfg: config ``evaluate`` (sets, sampling, prompt lookup, ...).
        target_cfg: config ``target`` (dtype, attn_implementation, trust_remote_code).
        sources: config ``data.sources`` (``split: both`` sources form the ``heldout`` set).
        device: default: ``cuda`` if available else ``cpu``.
        partial_dir: where decoded conversations are kept until the report is written (resume; default
            ``partial/`` beside the report).
        trainer_state: the training run's ``trainer_state.json``: its held-out (teacher-forced) block τ is
            reported beside the decoded τ.
        workers: decoding processes (default :func:`decoding_workers`: one per GPU of ``evaluate.gpus`` when
            that many GPUs are visible). With more than one, each decodes the conversations :func:`worker_of`
            gives it on its own device (``python -m draftsmith.evaluate.worker``), and this process merges
            their results in the sets' order and writes the report as from one process.

    Returns:
        The report dict (also written to ``outputs["json"]``).

    Raises:
        ValueError: drafter / target mismatch, tokenizer differing from the one training used, bad sets.
        RuntimeError: a decoding worker failed (its traceback is in the log) or left a set undone.
    """
    evaluate_cfg = {**schema_defaults("evaluate"), **evaluate_cfg}  # a library caller may pass a few keys
    target_cfg = {**schema_defaults("target"), **target_cfg}
    partial = Path(partial_dir) if partial_dir else Path(outputs["json"]).parent / "partial"
    workers = decoding_workers(evaluate_cfg, device) if workers is None else int(workers)
    inputs = {"target_dir": str(target_dir), "drafter_dir": str(drafter_dir), "curated_eval": str(curated_eval),
              "tokenized_eval": str(tokenized_eval), "evaluate_cfg": evaluate_cfg, "target_cfg": target_cfg,
              "sources": sources, "drafter_implementation": drafter_implementation, "partial": str(partial)}
    decoding = _prepare_decoding(target_dir, drafter_dir, tokenized_eval, evaluate_cfg, target_cfg, device,
                                 drafter_implementation)
    sets, base_key = _plan(decoding, inputs)
    keys_of = {bset.name: _set_key(base_key, bset) for bset in sets}
    if workers > 1:  # every worker with conversations left decodes its share on its own GPU, then exits
        left = sorted({worker_of(c.id, workers) for bset in sets
                       for c in _unsaved(bset, _load_saved(partial, bset.name, keys_of[bset.name]))})
        if left:
            _run_workers(workers, inputs, device, left)
        else:
            log.info("evaluate: every conversation was saved by an earlier run: no decoding worker started")
    bar = progress(sum(len(c.user_turns) for b in sets for c in b.conversations), "evaluate", unit="prompt",
                   logger=log, interval=float(evaluate_cfg["progress_interval"]))
    set_reports: dict[str, dict] = {}
    all_results: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}
    all_labels: list[str] = []
    all_keys: set[str] = set()
    all_conversations: set[tuple[str, str]] = set()
    decoded: dict[tuple[str, int, int], tuple[dict[str, GenerationResult], str]] = {}
    for bset in sets:
        key = keys_of[bset.name]
        saved = _load_saved(partial, bset.name, key)
        reused = len(bset.conversations) - len(_unsaved(bset, saved))
        if reused and workers == 1:
            log.info("set %s: %d of its %d conversations were saved by an interrupted run (%s): reused",
                     bset.name, reused, len(bset.conversations), partial / bset.name)
        if workers > 1:  # the workers' saved conversations, in the set's order (RuntimeError if one is missing)
            done = _aggregate(bset, saved)
            bar.update(done["planned"])
        else:
            path = _saved_file(partial, bset.name, "main")
            done = _decode_set(decoding, bset, decoded, bar, saved,
                               lambda records, key=key, path=path: _save_conversations(path, key, records),
                               float(evaluate_cfg["checkpoint_interval"]))
            if decoding.target is not None and not (partial / "decoding.json").is_file():
                write_json(partial / "decoding.json", _decoding_path(decoding))  # a resumed run's report needs it
        results, labels, keys = done["results"], done["labels"], done["prompt_keys"]
        set_reports[bset.name] = _set_report(bset, results, labels, keys, done["skipped_prompts"], done["planned"],
                                             decoding.sampling, decoding.block_size)
        for k, key_ in enumerate(keys):  # the "all" row counts a prompt in several sets once
            if key_ in all_keys:
                continue
            all_keys.add(key_)
            all_labels.append(f"{bset.name}:{labels[k]}")
            for m, rs in results.items():
                all_results.setdefault(m, []).append(rs[k])
        all_conversations.update((c.source, c.id) for c in bset.conversations)
    bar.close()

    path_file = partial / "decoding.json"
    if decoding.target is None and path_file.is_file():  # nothing decoded here: how the decoders ran
        decoding_path = read_json(path_file)
    else:
        decoding_path = _decoding_path(decoding)
    report = {
        "format": REPORT_FORMAT,
        "run": {**_run_metadata(decoding, target_dir, drafter_dir, base_key["drafter"], drafter_implementation,
                                decoding_path),
                "decoding_workers": workers},
        "sets": set_reports,
        "overall": _overall(set_reports, all_results, all_labels, all_conversations, decoding.sampling,
                            decoding.block_size),
        "training": _training_summary(trainer_state),
    }
    write_json(outputs["json"], report)
    write_text(outputs["md"], render_markdown(report))
    plot_tau(report, outputs["tau"])
    plot_per_position(report, outputs["positions"])
    plot_histogram(report, outputs["histogram"])
    shutil.rmtree(partial, ignore_errors=True)
    bad = [n for n, s in set_reports.items() if s["lossless"] is not None
           and not (s["lossless"]["dflash"]["lossless"] and s["lossless"]["prompt_lookup"]["lossless"])]
    if bad:
        log.warning("!" * 20 + " greedy speculative output differs from target-only output in set(s) %s "
                    "(see report.json lossless.mismatches; bf16 kernels whose results depend on the number of "
                    "tokens per forward can flip near-tied argmaxes)", ", ".join(bad))
    return report


def _training_summary(path: str | None) -> dict | None:
    """Training's held-out figures (teacher-forced on held-out rows) from ``trainer_state.json``, or None."""
    if not path:
        return None
    state = read_json(path)
    held = state.get("heldout") or {}
    return {"steps": state.get("steps"), "labels": state.get("labels"), "block_size": state.get("block_size"),
            "heldout_tau_blocks": held.get("tau_blocks"), "heldout_tau_expected": held.get("tau_expected"),
            "heldout_accuracy_per_position": held.get("accuracy_per_position"), "heldout_loss": held.get("loss"),
            "train_tokens_per_s": (state.get("last_train") or {}).get("tokens_per_s")}


def _static_target(target, evaluate_cfg: dict, dflash, lookup, max_prompt_tokens: int, max_positions: int,
                   device: torch.device):
    """The :class:`~draftsmith.evaluate.static.StaticTarget` all three decoders share, or None (dynamic cache).

    ``evaluate.static_cache``: ``auto`` = on CUDA when the target qualifies (:func:`~draftsmith.evaluate.static
    .static_decoding_supported`: attention-only and hybrid Gated DeltaNet targets without sliding windows);
    ``true`` = required; ``false`` = never.
    Sized for the longest prompt plus the largest ``max_new_tokens`` of the sets plus one verify block.

    Raises:
        ValueError: ``static_cache: true`` for a target it cannot serve.
    """
    from draftsmith.evaluate.static import StaticDrafter, StaticTarget, static_decoding_supported

    mode = str(evaluate_cfg["static_cache"]).lower()
    if mode == "false" or (mode == "auto" and device.type != "cuda"):
        return None
    ok, why = static_decoding_supported(target)
    if not ok:
        if mode == "true":
            raise ValueError(f"evaluate.static_cache: true, but {why}")
        log.info("static cache / CUDA graphs not used: %s", why)
        return None
    width = max(dflash.max_drafts, lookup.max_drafts) + 1
    max_new = max((int(s.get("max_new_tokens", 0)) for s in (evaluate_cfg["sets"] or {}).values()), default=0)
    length = min(max_positions, max_prompt_tokens + max_new + width + 1)
    static = StaticTarget(target, length, layer_ids=dflash.layer_ids, cuda_graphs=device.type == "cuda",
                          verify_width=width)
    log.info("target decodes on a static cache of %d positions%s", length,
             " with CUDA graphs" if static.cuda_graphs else "")
    if dflash.use_static(length, cuda_graphs=static.cuda_graphs):
        log.info("the drafter drafts on static K/V buffers%s", " with CUDA graphs" if static.cuda_graphs else "")
    else:
        log.info("the drafter drafts on a dynamic cache (%s)", StaticDrafter.supported(dflash.drafter)[1])
    return static


def _set_report(bset, results, labels, keys, skipped, planned, sampling, block_size) -> dict:
    base = results["target_only"]
    if planned != len(base) + sum(skipped.values()):
        raise RuntimeError(f"set {bset.name}: {planned} prompts planned != {len(base)} decoded + {skipped} skipped")
    if bset.rows_read != len(bset.conversations) + sum(bset.skipped.values()):
        raise RuntimeError(f"set {bset.name}: {bset.rows_read} rows read != {len(bset.conversations)} kept + "
                           f"{bset.skipped} skipped")
    out = {
        "source": bset.source,
        "max_prompts": bset.max_prompts,
        "max_new_tokens": bset.max_new_tokens,
        "rows_read": bset.rows_read,
        "conversations": len(bset.conversations),
        "skipped_rows": dict(bset.skipped),
        "prompts_planned": planned,
        "prompts": len(base),
        "skipped_prompts": dict(skipped),
        **_decoder_metrics(results, labels, sampling, block_size),
        "per_prompt": [
            {"prompt": lab, "prompt_key": key, "prompt_tokens": b.num_prompt_tokens, "new_tokens": len(b.tokens),
             "target_only_s": b.seconds, "dflash_s": d.seconds, "dflash_tau": d.tau,
             "prompt_lookup_s": p.seconds, "prompt_lookup_tau": p.tau}
            for lab, key, b, d, p in zip(labels, keys, base, results["dflash"], results["prompt_lookup"])],
    }
    return out


def _decoder_metrics(results, labels, sampling, block_size) -> dict:
    """Summaries of target-only, DFlash and prompt-lookup decoding, and (greedy) the lossless checks."""
    base = results["target_only"]
    reference = results.get("reference") or base
    out = {
        "target_only": summarize(base),
        "dflash": summarize(results["dflash"], base, block_size),
        "prompt_lookup": summarize(results["prompt_lookup"], base),
        "lossless": None if not sampling.greedy else {
            "dflash": lossless_check(reference, results["dflash"], labels),
            "prompt_lookup": lossless_check(reference, results["prompt_lookup"], labels)},
    }
    if results.get("reference"):  # how often bf16 1-token forwards flip a near-tie against verify-width ones
        out["target_only_vs_reference"] = lossless_check(reference, base, labels)
    return out


def _overall(set_reports, all_results, all_labels, all_conversations, sampling, block_size) -> dict:
    """The "all" row: every distinct prompt once (a prompt in several sets, e.g. a held-out row that is also
    a BFCL set row, counts once); ``prompts_in_several_sets`` = set prompts - distinct prompts."""
    base = all_results["target_only"]
    return {
        "conversations": len(all_conversations),
        "prompts": len(base),
        "prompts_in_several_sets": sum(s["prompts"] for s in set_reports.values()) - len(base),
        **_decoder_metrics(all_results, all_labels, sampling, block_size),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sampling_text(s: SamplingConfig) -> str:
    if s.greedy:
        return "greedy"
    return f"temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k or 'off'} (rejection sampling)"


def _rollback_text(target, rollback: str) -> str:
    from draftsmith.evaluate.cache import TargetCache

    with TargetCache(target, rollback) as cache:
        if not cache.recurrent:
            return "crop (attention-only target)"
        rerun = "recurrent mixers" if cache.mode == "mixer" else "target"
        return f"snapshot + re-run accepted tokens through the {rerun}"


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
