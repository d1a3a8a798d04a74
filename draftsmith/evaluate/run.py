"""The evaluate stage: decode every benchmark prompt three ways in the same run and write the report.

For each prompt of each set: target-only decoding (the baseline and the lossless reference), DFlash
speculative decoding with the exported drafter, and prompt-lookup speculative decoding (reference
drafter), in an order rotated from prompt to prompt so that no method is always timed first. Each set's
results are saved under ``partial_dir`` (atomically, keyed by a fingerprint of
the drafter weights, target, set, sampling and template kwargs) so a killed job resumes at the next
unfinished set; the folder is removed once the report is written.
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
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} does not exist: not an exported drafter folder")
    raw = read_json(cfg_path)
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise ValueError(f"{cfg_path}: DFlash2DraftModel checkpoints (candidate selector) are not supported")
    if implementation == "draftsmith":
        from draftsmith.modeling import DFlashDraftModel

        return DFlashDraftModel.from_pretrained(folder, dtype=dtype, device=device).eval()
    if implementation == "dflash":
        from dflash.model import DFlashDraftModel as Official

        return Official.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    raise ValueError(f"unknown drafter implementation {implementation!r} (draftsmith, dflash)")


def check_pair(drafter: nn.Module, target: nn.Module) -> None:
    """Raise ``ValueError`` (naming the field) unless the drafter was built for this target: width,
    number of target layers, tapped layer ids within range, mask token inside the embedding."""
    from draftsmith.target import num_layers, text_config, validate_layer_ids

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


def _save_partial(path: Path, key: str, payload: dict) -> None:
    write_json(path, {"key": key, **payload})


def _load_partial(path: Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except ValueError:
        log.warning("%s is not valid JSON: recomputing that set", path)
        return None
    if data.get("key") != key:
        log.info("%s was computed with other inputs: recomputing that set", path)
        return None
    return data


# ------------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Decoding:
    """Everything decoding one prompt needs, built once per run (:func:`_prepare_decoding`)."""

    target: nn.Module
    tokenizer: object
    template_kwargs: dict
    tokenizer_fingerprint: str
    stops: list[int]
    dflash: DFlashProposer
    lookup: PromptLookupProposer
    static: object | None
    sampling: SamplingConfig
    seed: int
    rollback: str
    device: torch.device
    dtype: torch.dtype
    max_prompt_tokens: int
    max_positions: int
    warmed: bool = False

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
    """Tokenizer (checked against the one training used), stop policy, target, drafter, proposers and the
    static decoding path.

    Raises:
        ValueError: another tokenizer / template than training's, the removed ``stop_tokens`` key, no stop
            token, a drafter that does not fit the target.
    """
    from draftsmith.chat import load_tokenizer, stop_token_ids, tokenizer_fingerprint
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

    target = load_target(target_dir, dtype=target_cfg["dtype"], device=device,
                         attn_implementation=target_cfg["attn_implementation"], trust_remote_code=trust)
    drafter = load_drafter(drafter_dir, device=device, dtype=dtype, implementation=drafter_implementation)
    check_pair(drafter, target)
    dflash = DFlashProposer(drafter, target, block_size=evaluate_cfg["block_size"])
    lookup = PromptLookupProposer(int(evaluate_cfg["prompt_lookup_ngram"]),
                                  int(evaluate_cfg["prompt_lookup_num_tokens"] or dflash.max_drafts))
    max_positions = int(getattr(text_config(target.config), "max_position_embeddings", 1 << 30))
    max_prompt_tokens = int(evaluate_cfg["max_prompt_tokens"] or max_positions)
    static = _static_target(target, evaluate_cfg, dflash, lookup, max_prompt_tokens, max_positions, device)
    sampling = SamplingConfig(float(evaluate_cfg["temperature"]), float(evaluate_cfg["top_p"]),
                              int(evaluate_cfg["top_k"]))
    return _Decoding(target=target, tokenizer=tokenizer, template_kwargs=template_kwargs,
                     tokenizer_fingerprint=fingerprint, stops=stops, dflash=dflash, lookup=lookup, static=static,
                     sampling=sampling, seed=int(evaluate_cfg["seed"]),
                     rollback=evaluate_cfg["rollback"], device=device, dtype=dtype,
                     max_prompt_tokens=max_prompt_tokens, max_positions=max_positions)


def _decode_set(decoding: _Decoding, bset, decoded: dict, bar) -> dict:
    """Decode one benchmark set turn by turn: each later turn is asked after the target's own answer.

    ``decoded`` maps ``(prompt key, budget, draw seed)`` to earlier results: a prompt that sits in several sets
    (a held-out row that is also a BFCL / MMATH set row) is decoded once.

    Returns:
        ``{"results": {method: [GenerationResult]}, "labels", "prompt_keys", "skipped_prompts", "planned"}``.
    """
    results: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}
    labels: list[str] = []
    keys: list[str] = []
    skipped: dict[str, int] = {}
    planned = 0
    for conv in bset.conversations:
        history = list(conv.context)
        planned += len(conv.user_turns)
        for t, turn in enumerate(conv.user_turns):
            history = history + turn
            ids = decoding.render(history, conv.tools)
            if not decoding.fits(len(ids), bset.max_new_tokens):  # a later turn (first turns fit)
                left = len(conv.user_turns) - t  # later turns need this one's answer
                skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + left
                log.warning("set %s: %s turn %d has %d prompt tokens (limit %d, +%d new <= %d): "
                            "skipped with %d later turn(s)", bset.name, conv.id, t, len(ids),
                            decoding.max_prompt_tokens, bset.max_new_tokens, decoding.max_positions, left - 1)
                bar.update(left)
                break
            if not decoding.warmed:  # first-call costs (CUDA graphs, kernels) out of the timings
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
                res = decoding.decode(ids, bset.max_new_tokens, _gen_seed(decoding.seed, label), rotate=len(labels))
                decoded[(pkey, bset.max_new_tokens, decoding.draw_seed(label))] = (res, f"{bset.name}:{label}")
            for m, r in res.items():
                results.setdefault(m, []).append(r)
            labels.append(label)
            keys.append(pkey)
            answer = decoding.tokenizer.decode(res["target_only"].tokens, skip_special_tokens=True)
            history = history + [{"role": "assistant", "content": answer}]
            log.debug("set %s %s#%d: %d prompt tokens, %d new; τ dflash %.2f, lookup %.2f",
                      bset.name, conv.id, t, len(ids), len(res["target_only"].tokens),
                      res["dflash"].tau, res["prompt_lookup"].tau)
            bar.set_postfix_str(f"set {bset.name}, τ so far: dflash {summarize(results['dflash'])['tau']:.2f}"
                                f", lookup {summarize(results['prompt_lookup'])['tau']:.2f}", refresh=False)
            bar.update(1)
    return {"results": results, "labels": labels, "prompt_keys": keys, "skipped_prompts": skipped,
            "planned": planned}


def _run_metadata(decoding: _Decoding, target_dir: str, drafter_dir: str, drafter_sha: str,
                  drafter_implementation: str) -> dict:
    """The report's ``run`` section: what was decoded, how, with which versions."""
    static, sampling = decoding.static, decoding.sampling
    return {
        "target": str(target_dir), "drafter": str(drafter_dir), "drafter_sha256": drafter_sha,
        "drafter_implementation": drafter_implementation,
        "block_size": decoding.dflash.block_size, "target_layer_ids": decoding.dflash.layer_ids,
        "mask_token_id": decoding.dflash.mask_token_id, "device": _device_name(decoding.device),
        "dtype": str(decoding.dtype).replace("torch.", ""),
        "sampling": dataclasses.asdict(sampling), "sampling_text": _sampling_text(sampling), "seed": decoding.seed,
        "chat_template_kwargs": decoding.template_kwargs, "tokenizer_fingerprint": decoding.tokenizer_fingerprint,
        "stop_token_ids": decoding.stops,
        "prompt_lookup_ngram": decoding.lookup.max_ngram, "prompt_lookup_num_tokens": decoding.lookup.max_drafts,
        "rollback": _rollback_text(decoding.target, decoding.rollback),
        "decoding": ("static KV cache" + (", CUDA graphs" if static.cuda_graphs else "") if static is not None
                     else "dynamic KV cache"),
        "lossless_reference": (f"greedy target-only decoding with forwards padded to the verify width "
                               f"({static.verify_width} tokens: the kernels verification runs)"
                               if static is not None else "greedy target-only decoding"),
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "python": platform.python_version()},
    }


def _serialised(done: dict) -> dict:
    """A decoded set (:func:`_decode_set`) with its results as plain dicts (JSON)."""
    return {**done, "results": {m: [dataclasses.asdict(r) for r in rs] for m, rs in done["results"].items()}}


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
                "block_size": decoding.dflash.block_size,
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


def _worker_file(partial: Path, set_name: str, worker: int, workers: int) -> Path:
    return partial / f"{set_name}.worker-{worker}-of-{workers}.json"


def _run_workers(workers: int, inputs: dict, device: torch.device | str | None) -> None:
    """Start ``workers`` decoding processes (``python -m draftsmith.evaluate.worker``), each on one GPU of
    ``CUDA_VISIBLE_DEVICES`` (or the CPU), and wait for them all; their log lines go to this job's log file.

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
    for w in range(workers):
        env = dict(os.environ)
        if on_cuda:
            env["CUDA_VISIBLE_DEVICES"] = gpus[w]
        procs.append(subprocess.Popen([sys.executable, "-m", "draftsmith.evaluate.worker", "--worker", str(w),
                                       "--args", str(args_file)], env=env))
    log.info("evaluate: %d decoding workers started (%s)", workers,
             ", ".join(f"worker {w} on GPU {gpus[w]}" if on_cuda else f"worker {w} on the CPU"
                       for w in range(workers)))
    codes = [p.wait() for p in procs]
    failed = [f"worker {w} (exit code {c})" for w, c in enumerate(codes) if c != 0]
    if failed:
        raise RuntimeError(f"evaluate: decoding {', '.join(failed)} failed: the traceback is in the log above")


def _decode_worker(worker: int, args: dict) -> None:
    """One decoding worker: the sets' conversations :func:`worker_of` gives it, decoded as :func:`run_evaluate`
    decodes them, each set saved to ``partial/<set>.worker-<w>-of-<n>.json`` (a rerun skips saved sets)."""
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
    for bset, own in zip(sets, mine):
        key = _set_key(base_key, bset)
        path, wkey = _worker_file(partial, bset.name, worker, workers), f"{key}:{worker}/{workers}"
        if _load_partial(partial / f"{bset.name}.json", key) is not None or _load_partial(path, wkey) is not None:
            bar.update(sum(len(c.user_turns) for c in own.conversations))
            continue
        _save_partial(path, wkey, _serialised(_decode_set(decoding, own, decoded, bar)))
    bar.close()
    from draftsmith.gpu import log_peak_memory

    log.info("evaluate worker %d done (GPU %s)", worker, os.environ.get("CUDA_VISIBLE_DEVICES", "none"))
    log_peak_memory(log)  # each worker's own peak: the job's line after it is the merging process's


def _merge_workers(partial: Path, bset, key: str, workers: int) -> dict:
    """One set's results from the workers' files, in the set's conversation and turn order (what one process
    would have saved); saved as the set's own partial file.

    Raises:
        RuntimeError: a worker's file is missing or was computed with other inputs.
    """
    parts = []
    for w in range(workers):
        path = _worker_file(partial, bset.name, w, workers)
        data = _load_partial(path, f"{key}:{w}/{workers}")
        if data is None:
            raise RuntimeError(f"{path}: evaluate worker {w} left no results for set {bset.name}")
        parts.append(data)
    where = {label: (d, k) for d in parts for k, label in enumerate(d["labels"])}
    results: dict[str, list] = {}
    labels, keys = [], []
    for conv in bset.conversations:
        t = 0
        while f"{conv.id}#{t}" in where:
            d, k = where[f"{conv.id}#{t}"]
            for m, rs in d["results"].items():
                results.setdefault(m, []).append(rs[k])
            labels.append(f"{conv.id}#{t}")
            keys.append(d["prompt_keys"][k])
            t += 1
    if len(labels) != len(where):
        raise RuntimeError(f"set {bset.name}: the workers decoded {len(where)} prompts, {len(labels)} of them belong "
                           "to its conversations")
    skipped: dict[str, int] = {}
    for d in parts:
        for reason, n in d["skipped_prompts"].items():
            skipped[reason] = skipped.get(reason, 0) + n
    done = {"results": results, "labels": labels, "prompt_keys": keys, "skipped_prompts": skipped,
            "planned": sum(d["planned"] for d in parts)}
    _save_partial(partial / f"{bset.name}.json", key, done)
    return {"key": key, **done}


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

    Steps: prepare the decoders (:func:`_prepare_decoding`) -> read the sets (first prompts that fit) -> per set,
    reuse the results an interrupted run saved or decode it (:func:`_decode_set`) and save them -> the report
    (per set, and "all" counting a prompt in several sets once) -> report.md and plots.

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
        partial_dir: where per-set results are kept until the report is written (resume).
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
    if workers > 1:  # every worker decodes its share of the conversations on its own GPU, then exits
        _run_workers(workers, inputs, device)
    decoding = _prepare_decoding(target_dir, drafter_dir, tokenized_eval, evaluate_cfg, target_cfg, device,
                                 drafter_implementation)
    sets, base_key = _plan(decoding, inputs)
    bar = progress(sum(len(c.user_turns) for b in sets for c in b.conversations), "evaluate", unit="prompt",
                   logger=log, interval=float(evaluate_cfg["progress_interval"]))
    set_reports: dict[str, dict] = {}
    all_results: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}
    all_labels: list[str] = []
    all_keys: set[str] = set()
    all_conversations: set[tuple[str, str]] = set()
    decoded: dict[tuple[str, int, int], tuple[dict[str, GenerationResult], str]] = {}
    for bset in sets:
        key = _set_key(base_key, bset)
        ppath = partial / f"{bset.name}.json"
        cached = _load_partial(ppath, key)
        if cached is None and workers > 1:
            cached = _merge_workers(partial, bset, key, workers)
        if cached is not None:
            log.info("set %s: reusing results of %s (%s)", bset.name,
                     f"{workers} decoding workers" if workers > 1 else "an interrupted run", ppath)
            done = {**cached, "results": {m: [_result_from_dict(d) for d in rs]
                                          for m, rs in cached["results"].items()}}
            bar.update(done["planned"])
            for k, (key_, lab) in enumerate(zip(done["prompt_keys"], done["labels"])):
                decoded.setdefault((key_, bset.max_new_tokens, decoding.draw_seed(lab)),
                                   ({m: rs[k] for m, rs in done["results"].items()}, f"{bset.name}:{lab}"))
        else:
            done = _decode_set(decoding, bset, decoded, bar)
            _save_partial(ppath, key, _serialised(done))
        results, labels, keys = done["results"], done["labels"], done["prompt_keys"]
        set_reports[bset.name] = _set_report(bset, results, labels, keys, done["skipped_prompts"], done["planned"],
                                             decoding.sampling, decoding.dflash.block_size)
        for k, key_ in enumerate(keys):  # the "all" row counts a prompt in several sets once
            if key_ in all_keys:
                continue
            all_keys.add(key_)
            all_labels.append(f"{bset.name}:{labels[k]}")
            for m, rs in results.items():
                all_results.setdefault(m, []).append(rs[k])
        all_conversations.update((c.source, c.id) for c in bset.conversations)
    bar.close()

    report = {
        "format": REPORT_FORMAT,
        "run": {**_run_metadata(decoding, target_dir, drafter_dir, base_key["drafter"], drafter_implementation),
                "decoding_workers": workers},
        "sets": set_reports,
        "overall": _overall(set_reports, all_results, all_labels, all_conversations, decoding.sampling,
                            decoding.dflash.block_size),
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
