"""The evaluate stage's decoders and how they decode the benchmark sets.

:class:`Decoders` holds everything decoding one prompt needs, built once per run from the settings, the
tokenizer and the drafter's ``config.json`` (:func:`prepare_decoders`); the target and the drafter load with the
first prompt decoded, so planning, resuming and merging never load them. :func:`decode_set` decodes a set
conversation by conversation (:func:`decode_conversation`: every user turn asked after the target's own answer
to the one before), each prompt three ways (target-only, DFlash, prompt lookup: :mod:`draftsmith.evaluate.decode`
holds the decoding loops) and once more per ``evaluate.mtp.num_speculative_tokens`` entry with the target's own MTP
head when its checkpoint has one (:mod:`draftsmith.evaluate.mtp`), and saves as it goes; :func:`aggregate` joins a
set's conversation records in its order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from draftsmith.evaluate.decode import (
    DFlashProposer,
    GenerationResult,
    PromptLookupProposer,
    speculative_generate,
    target_generate,
)
from draftsmith.evaluate.drafter import check_pair, drafter_architecture, drafter_config, load_drafter
from draftsmith.evaluate.prompts import (
    SKIP_TEMPLATE_ERROR,
    BenchmarkSet,
    Conversation,
    PromptTemplateError,
    load_sets,
    render,
)
from draftsmith.evaluate.report import METHODS, START_METHOD, mtp_method, summarize
from draftsmith.evaluate.sampling import SamplingConfig
from draftsmith.evaluate.settings import EvaluateOptions, EvaluateSettings

log = logging.getLogger("draftsmith.evaluate")


@dataclasses.dataclass(frozen=True)
class EvaluateInputs:
    """The files an evaluate job reads, as :func:`draftsmith.evaluate.run.run_evaluate` was given them (its
    decoding workers get them too)."""

    target_dir: str  # the target's Hugging Face folder
    drafter_dir: str  # the exported drafter folder
    curated_eval: str  # results/curated/eval.parquet
    tokenized_eval: str  # results/tokenized/eval.parquet (its metadata: template kwargs, tokenizer fingerprint)
    sources: list[dict]  # config data.sources (the split: both ones form the heldout set)
    drafter_implementation: str  # draftsmith or dflash (draftsmith.evaluate.drafter.load_drafter)


def prompt_key(ids: list[int]) -> str:
    """Identity of a rendered prompt: sha256 hex (16 digits) of its token ids. Two sets holding the same
    prompt (the same curated row, or the same text from two rows) give the same key."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def _gen_seed(seed: int, label: str) -> int:
    """Seed of a prompt's sampling draws, from the run seed and the prompt label ``<row id>#<turn>``."""
    row_id, turn = label.rsplit("#", 1)
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}:{turn}".encode()).digest()[:6], "little")


def result_from_dict(d: dict) -> GenerationResult:
    """A :class:`~draftsmith.evaluate.decode.GenerationResult` from its saved JSON record (``dataclasses.asdict``)."""
    return GenerationResult(**d)


@dataclasses.dataclass
class Decoders:
    """Everything decoding one prompt needs, built once per run (:func:`prepare_decoders`). The target, the
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
    architecture: str  # the drafter's class: DFlashDraftModel or DFlash2DraftModel
    start_dir: str | None = None  # drafter.init_from: the drafter training started from, decoded too; None: none
    start_sha: str | None = None  # its model.safetensors' sha256 (the resume key, the report)
    mtp_tokens: list[int] = dataclasses.field(default_factory=list)  # the MTP decodings (k); [] without an MTP head
    mtp_status: dict = dataclasses.field(default_factory=dict)  # draftsmith.evaluate.mtp.MTPStatus.to_dict()
    static_cache: str = "auto"  # evaluate.static_cache: with the device and target, whether there is a reference
    loader: object = None  # () -> (target, DFlashProposer, static or None, {k: MTPProposer}, start proposer or None)
    target: nn.Module | None = None
    dflash: DFlashProposer | None = None
    start: DFlashProposer | None = None  # the drafter training started from, once loaded
    static: object | None = None
    mtp: dict = dataclasses.field(default_factory=dict)  # k -> MTPProposer, once loaded
    warmed: bool = False

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods every prompt is decoded by: :data:`~draftsmith.evaluate.report.METHODS`, the MTP head's, one
        per k (``mtp_<k>``), and with a start drafter :data:`~draftsmith.evaluate.report.START_METHOD`."""
        return (METHODS + tuple(mtp_method(k) for k in self.mtp_tokens)
                + ((START_METHOD,) if self.start_dir else ()))

    def load(self) -> None:
        """Load the target, the drafter, the start drafter and the MTP head and build the proposers and the static
        path (once)."""
        if self.target is None:
            self.target, self.dflash, self.static, self.mtp, self.start = self.loader()

    def fits(self, num_prompt_tokens: int, max_new: int) -> bool:
        """Whether a prompt of ``num_prompt_tokens`` tokens is decoded with a budget of ``max_new`` new tokens
        (``evaluate.max_prompt_tokens`` and the target's ``max_position_embeddings``)."""
        return num_prompt_tokens <= self.max_prompt_tokens and num_prompt_tokens + max_new <= self.max_positions

    def render(self, messages: list[dict], tools) -> list[int]:
        """A prompt's token ids, rendered as training rendered it (:func:`draftsmith.evaluate.prompts.render`)."""
        return render(self.tokenizer, messages, tools, self.template_kwargs)

    def draw_seed(self, label: str) -> int:
        """The sampling seed of a prompt (0 when greedy: greedy output does not depend on it)."""
        return 0 if self.sampling.greedy else _gen_seed(self.seed, label)

    def passes(self) -> int:
        """Decodings of a prompt by :meth:`decode`: one per method, plus the lossless reference when greedy on the
        static path."""
        return len(self.methods) + int(self.static is not None and self.sampling.greedy)

    def decode(self, ids: list[int], max_new: int, gen_seed: int, rotate: int = 0,
               on_tokens: Callable[[int], None] | None = None) -> dict[str, GenerationResult]:
        """One prompt decoded by every method (in an order rotated by ``rotate``: no method always first) and,
        when greedy on the static path, the lossless reference (target-only at the verify width); ``on_tokens(k)``
        after every ``k`` tokens decoded (the progress line)."""
        self.load()
        out = {}
        methods = self.methods
        order = methods[rotate % len(methods):] + methods[:rotate % len(methods)]
        for method in order:
            gen = torch.Generator(device=self.device).manual_seed(gen_seed) if not self.sampling.greedy else None
            if method == "target_only":
                out[method] = target_generate(self.target, ids, max_new_tokens=max_new, stop_token_ids=self.stops,
                                              sampling=self.sampling, generator=gen, static=self.static,
                                              on_tokens=on_tokens)
            else:
                proposer = {"dflash": self.dflash, "prompt_lookup": self.lookup, START_METHOD: self.start}.get(method)
                if proposer is None:
                    proposer = self.mtp[int(method.rsplit("_", 1)[1])]
                out[method] = speculative_generate(self.target, proposer, ids, max_new_tokens=max_new,
                                                   stop_token_ids=self.stops, sampling=self.sampling, generator=gen,
                                                   rollback=self.rollback, static=self.static, on_tokens=on_tokens)
        if self.static is not None and self.sampling.greedy:  # the lossless reference: verification's kernels
            out["reference"] = target_generate(self.target, ids, max_new_tokens=max_new, stop_token_ids=self.stops,
                                               sampling=self.sampling, static=self.static, width=None,
                                               on_tokens=on_tokens)
        return out


def prepare_decoders(inputs: EvaluateInputs, settings: EvaluateSettings,
                     device: torch.device | str | None) -> Decoders:
    """Tokenizer (checked against the one training used), stop policy, the decoding settings, the drafter's
    ``config.json`` and whether the target's checkpoint carries an MTP head (:func:`~draftsmith.evaluate.mtp
    .mtp_status`: safetensors headers only; without one the run logs why and has no MTP methods); the target,
    drafter, MTP head, proposers and static decoding path are loaded by :meth:`Decoders.load` when the first prompt
    is decoded.

    Args:
        device: default: ``cuda`` if available else ``cpu``.

    Raises:
        ValueError: another tokenizer / template than training's, no stop token, a malformed ``mtp.*`` set (naming
            the tensor); when loading: a drafter that does not fit the target.
        FileNotFoundError / ValueError: ``inputs.drafter_dir`` is not an exported DFlash drafter
            (:func:`~draftsmith.evaluate.drafter.drafter_config`).
    """
    import types

    from transformers import AutoConfig

    from draftsmith.chat import load_tokenizer, stop_token_ids, tokenizer_fingerprint
    from draftsmith.drafter_config import draft_value
    from draftsmith.evaluate.mtp import MTPDrafter, MTPProposer, MTPStatus, load_mtp_head, mtp_status
    from draftsmith.target import default_device, load_target, resolve_dtype, text_config
    from draftsmith.tokenized import read_tokenized_metadata

    options, target_options = settings.evaluate, settings.target
    target_dir, drafter_dir, tokenized_eval = inputs.target_dir, inputs.drafter_dir, inputs.tokenized_eval
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(target_options.dtype, device)
    meta = read_tokenized_metadata(tokenized_eval)
    template_kwargs = meta["chat_template_kwargs"]
    trust = bool(target_options.trust_remote_code)
    tokenizer = load_tokenizer(target_dir, trust_remote_code=trust)
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != meta["tokenizer_fingerprint"]:
        raise ValueError(f"{tokenized_eval}: the training data was tokenized with another tokenizer / chat template "
                         f"(fingerprint {meta['tokenizer_fingerprint'][:12]}) than the target's in {target_dir} "
                         f"({fingerprint[:12]}); evaluation must render prompts exactly as training did")
    stops = stop_token_ids(tokenizer, target_dir, template_kwargs)  # the policy regenerate and tokenize use
    if not stops:
        raise ValueError(f"{target_dir}: no stop token: the tokenizer, config.json and generation_config.json "
                         "name no eos_token_id and the chat template writes no end-of-turn token")

    cfg_path = Path(drafter_dir) / "config.json"
    raw_drafter_cfg = drafter_config(drafter_dir)
    drafter_cfg = types.SimpleNamespace(**raw_drafter_cfg)
    block_size = int(options.block_size or draft_value(drafter_cfg, "block_size", 16))
    layer_ids = [int(i) for i in draft_value(drafter_cfg, "target_layer_ids", [])]
    mask = draft_value(drafter_cfg, "mask_token_id")
    lookup = PromptLookupProposer(int(options.prompt_lookup_ngram),
                                  int(options.prompt_lookup_num_tokens or block_size - 1))
    target_config = text_config(AutoConfig.from_pretrained(target_dir, trust_remote_code=trust))
    max_positions = int(getattr(target_config, "max_position_embeddings", None) or 1 << 30)
    max_prompt_tokens = int(options.max_prompt_tokens or max_positions)
    mtp_tokens = options.mtp_tokens
    if mtp_tokens:
        status = mtp_status(target_dir, trust_remote_code=trust)  # ValueError: a malformed mtp.* set
    else:
        status = MTPStatus(False, "evaluate.mtp.num_speculative_tokens is empty")
    if status.available:
        log.info("the target's MTP head (%d layer(s), %d mtp.* tensors) decodes every prompt with %s draft(s) a step",
                 status.num_layers, status.tensors, ", ".join(map(str, mtp_tokens)))
    else:
        log.info("no MTP rows: %s", status.reason)
        mtp_tokens = []

    start_dir = settings.drafter.init_from
    start_sha = None
    if start_dir:
        from draftsmith.io import sha256_file

        start_cfg = drafter_config(start_dir)  # FileNotFoundError / ValueError: not a drafter folder
        start_ids = [int(i) for i in draft_value(types.SimpleNamespace(**start_cfg), "target_layer_ids", [])]
        if start_ids != layer_ids:
            raise ValueError(f"drafter.init_from {start_dir} taps target layers {start_ids}, the trained drafter "
                             f"{drafter_dir} {layer_ids}: the trained drafter was not trained from it")
        start_sha = sha256_file(Path(start_dir) / "model.safetensors")
        log.info("the drafter training started from (%s) decodes every prompt too: one more decoding per prompt, "
                 "for the report's before -> after", start_dir)

    def load_models():
        target = load_target(target_dir, dtype=target_options.dtype, device=device,
                             attn_implementation=target_options.attn_implementation, trust_remote_code=trust)
        drafter = load_drafter(drafter_dir, device=device, dtype=dtype, implementation=inputs.drafter_implementation)
        check_pair(drafter, target)
        dflash = DFlashProposer(drafter, target, block_size=options.block_size)
        if (dflash.block_size, dflash.layer_ids, dflash.mask_token_id) != (block_size, layer_ids, mask):
            raise RuntimeError(f"{cfg_path}: the loaded drafter has block size {dflash.block_size}, target layer ids "
                               f"{dflash.layer_ids}, mask token {dflash.mask_token_id}; its config.json read "
                               f"{block_size}, {layer_ids}, {mask}")
        start = None
        if start_dir:  # verified at the trained drafter's verify width, on the same taps
            first = load_drafter(start_dir, device=device, dtype=dtype, implementation=inputs.drafter_implementation)
            check_pair(first, target)
            start = DFlashProposer(first, target, block_size=block_size)
        mtp = {}
        if mtp_tokens:
            drafter_mtp = MTPDrafter(load_mtp_head(target_dir, target, status.num_layers), target)
            mtp = {k: MTPProposer(drafter_mtp, k) for k in mtp_tokens}
        static = static_target(target, options, dflash, lookup, max_prompt_tokens, max_positions, device,
                               list(mtp.values()), start)
        return target, dflash, static, mtp, start

    sampling = SamplingConfig(float(options.temperature), float(options.top_p), int(options.top_k))
    return Decoders(tokenizer=tokenizer, template_kwargs=template_kwargs, tokenizer_fingerprint=fingerprint,
                    stops=stops, lookup=lookup, sampling=sampling, seed=int(options.seed),
                    rollback=options.rollback, static_cache=str(options.static_cache).lower(), device=device,
                    dtype=dtype,
                    max_prompt_tokens=max_prompt_tokens, max_positions=max_positions, block_size=block_size,
                    layer_ids=layer_ids, mask_token_id=None if mask is None else int(mask),
                    architecture=drafter_architecture(raw_drafter_cfg), start_dir=start_dir or None,
                    start_sha=start_sha, mtp_tokens=list(mtp_tokens), mtp_status=status.to_dict(),
                    loader=load_models)


def static_target(target: nn.Module, options: EvaluateOptions, dflash: DFlashProposer, lookup: PromptLookupProposer,
                  max_prompt_tokens: int, max_positions: int, device: torch.device, mtp: list | None = None,
                  start: DFlashProposer | None = None):
    """The :class:`~draftsmith.evaluate.static.StaticTarget` every decoder shares, or None (dynamic cache).

    ``evaluate.static_cache``: ``auto`` = on CUDA when the target qualifies (:func:`~draftsmith.evaluate.static
    .static_decoding_supported`: attention-only and hybrid Gated DeltaNet targets without sliding windows);
    ``true`` = required; ``false`` = never.
    Sized for the longest prompt plus the largest ``max_new_tokens`` of the sets plus one verify block. It taps
    DFlash's layers and, for the MTP proposers (``mtp``: :class:`~draftsmith.evaluate.mtp.MTPProposer`), the last
    layer; every proposer's verify forwards are padded to one width (the widest block), so the greedy lossless
    reference runs the very kernels each one's verification runs. The MTP head then drafts on its fixed K/V
    buffers with CUDA graphs too. The start drafter (``start``: ``drafter.init_from``, the same taps and width) drafts
    on buffers of its own.

    Raises:
        ValueError: ``static_cache: true`` for a target it cannot serve.
    """
    from draftsmith.evaluate.static import StaticDrafter, StaticTarget, static_decoding_supported

    mode = str(options.static_cache).lower()
    if mode == "false" or (mode == "auto" and device.type != "cuda"):
        return None
    ok, why = static_decoding_supported(target)
    if not ok:
        if mode == "true":
            raise ValueError(f"evaluate.static_cache: true, but {why}")
        log.info("static cache / CUDA graphs not used: %s", why)
        return None
    mtp = list(mtp or [])
    width = max([dflash.max_drafts, lookup.max_drafts] + [p.max_drafts for p in mtp]) + 1
    max_new = max((int(s.get("max_new_tokens", 0)) for s in (options.sets or {}).values()), default=0)
    length = min(max_positions, max_prompt_tokens + max_new + width + 1)
    layer_ids = list(dflash.layer_ids) + [i for p in mtp[:1] for i in p.layer_ids if i not in dflash.layer_ids]
    static = StaticTarget(target, length, layer_ids=layer_ids, cuda_graphs=device.type == "cuda",
                          verify_width=width)
    log.info("target decodes on a static cache of %d positions%s", length,
             " with CUDA graphs" if static.cuda_graphs else "")
    for name, proposer in (("the drafter", dflash), ("the start drafter", start)):
        if proposer is None:
            continue
        if proposer.use_static(length, cuda_graphs=static.cuda_graphs):
            log.info("%s drafts on static K/V buffers%s", name, " with CUDA graphs" if static.cuda_graphs else "")
        else:
            log.info("%s drafts on a dynamic cache (%s)", name, StaticDrafter.supported(proposer.drafter)[1])
    if mtp:
        drafter = mtp[0].drafter
        drafter.cache.ensure(length + 2 * width)  # sized once: its CUDA graphs keep the buffers' addresses
        drafter.cuda_graphs = static.cuda_graphs
        log.info("the MTP head drafts on static K/V buffers%s", " with CUDA graphs" if static.cuda_graphs else "")
    return static


def read_sets(decoders: Decoders, inputs: EvaluateInputs, sets: Mapping[str, Mapping]) -> list[BenchmarkSet]:
    """The benchmark sets of config ``evaluate.sets`` (in its order), each filled with the first conversations
    whose first prompt fits (:meth:`Decoders.fits`).

    Raises:
        ValueError: no set, or a set the curated eval split cannot fill
            (:func:`~draftsmith.evaluate.prompts.load_sets`).
    """
    def first_prompt_fits(conv: Conversation, max_new: int) -> bool:
        return decoders.fits(len(decoders.render(list(conv.context) + conv.user_turns[0], conv.tools)), max_new)

    out = load_sets(inputs.curated_eval, sets or {},
                    heldout_sources=[s["name"] for s in inputs.sources if s.get("split", "both") == "both"],
                    first_prompt_fits=first_prompt_fits)
    if not out:
        raise ValueError("evaluate.sets is empty: nothing to evaluate")
    return out


def decode_set(decoders: Decoders, bset: BenchmarkSet, decoded: dict, bar, saved: dict | None = None,
               save: Callable[[dict[str, dict]], None] | None = None, interval: float = 60.0) -> dict:
    """Decode one benchmark set turn by turn: each later turn is asked after the target's own answer to the one
    before (:func:`answer_for_next_turn`: greedy on the static path, the lossless reference's).

    ``decoded`` maps ``(prompt key, budget, draw seed)`` to earlier results: a prompt that sits in several sets
    (a held-out row that is also a BFCL / MMATH set row) is decoded once. ``saved`` maps conversation ids to
    records an earlier run saved (:func:`~draftsmith.evaluate.resume.load_saved`): those conversations are not
    decoded again. ``save(records)`` is called with every conversation done so far (JSON records) at most
    ``interval`` seconds apart and once at the end (when anything was decoded).

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
                decoded.setdefault((pkey, bset.max_new_tokens, decoders.draw_seed(label)),
                                   ({m: result_from_dict(rs[k]) for m, rs in rec["results"].items()},
                                    f"{bset.name}:{label}"))
            labels_so_far += len(rec["labels"])
            bar.update(rec["planned"])
            continue
        rec = _decode_conversation(decoders, bset, conv, decoded, bar, labels_so_far, so_far)
        records[conv.id] = rec
        labels_so_far += len(rec["labels"])
        fresh += 1
        if save is not None and time.monotonic() - last_save >= interval:
            save(records)
            last_save = time.monotonic()
    if save is not None and fresh:
        save(records)
    return aggregate(bset, records)


def _decode_conversation(decoders: Decoders, bset: BenchmarkSet, conv: Conversation, decoded: dict, bar,
                         rotate: int, so_far: dict[str, list[GenerationResult]]) -> dict:
    """One conversation of a set, every user turn after the target's answer to the last: its JSON record
    ``{"results": {method: [GenerationResult as dict]}, "labels", "prompt_keys", "skipped", "planned"}``
    (``so_far``: this process's results of the set, for the progress line)."""
    rec = {"results": {m: [] for m in METHODS}, "labels": [], "prompt_keys": [], "skipped": {},
           "planned": len(conv.user_turns)}
    history = list(conv.context)
    for t, turn in enumerate(conv.user_turns):
        history = history + turn
        try:
            ids = decoders.render(history, conv.tools)
        except PromptTemplateError as exc:  # a later turn (first turns rendered when the set was read)
            left = len(conv.user_turns) - t
            rec["skipped"][SKIP_TEMPLATE_ERROR] = left
            log.warning("set %s: %s turn %d skipped with %d later turn(s): %s", bset.name, conv.id, t, left - 1,
                        exc)
            bar.update(left)
            break
        if not decoders.fits(len(ids), bset.max_new_tokens):  # a later turn (first turns fit)
            left = len(conv.user_turns) - t  # later turns need this one's answer
            rec["skipped"]["prompt_too_long"] = left
            log.warning("set %s: %s turn %d has %d prompt tokens (limit %d, +%d new <= %d): "
                        "skipped with %d later turn(s)", bset.name, conv.id, t, len(ids),
                        decoders.max_prompt_tokens, bset.max_new_tokens, decoders.max_positions, left - 1)
            bar.update(left)
            break
        if not decoders.warmed:  # first-call costs (loading, CUDA graphs, kernels) out of the timings
            bar.set_postfix_str("loading the target and drafter, warming up", refresh=False)
            decoders.decode(ids, min(16, bset.max_new_tokens), decoders.seed)
            decoders.warmed = True
            bar.restart_eta()  # the loading and warm-up are paid once, not per prompt left
        label = f"{conv.id}#{t}"
        pkey = prompt_key(ids)
        again = decoded.get((pkey, bset.max_new_tokens, decoders.draw_seed(label)))
        if again is not None:
            res = again[0]
            log.info("set %s %s: the same prompt as %s, decoded there: its results are reused",
                     bset.name, label, again[1])
        else:
            budget, tokens = decoders.passes() * bset.max_new_tokens, [0]

            def on_tokens(k: int) -> None:  # the prompt in flight: its tokens decoded of every pass's budget
                tokens[0] += k
                bar.advance(**{"tok decoded": k})
                bar.set_partial(min(tokens[0] / budget, 0.999))

            bar.set_postfix_str(f"set {bset.name} {label}{tau_so_far(so_far)}", refresh=False)
            res = decoders.decode(ids, bset.max_new_tokens, _gen_seed(decoders.seed, label),
                                  rotate=rotate + len(rec["labels"]), on_tokens=on_tokens)
            decoded[(pkey, bset.max_new_tokens, decoders.draw_seed(label))] = (res, f"{bset.name}:{label}")
        for m, r in res.items():
            rec["results"].setdefault(m, []).append(dataclasses.asdict(r))
            so_far.setdefault(m, []).append(r)
        rec["labels"].append(label)
        rec["prompt_keys"].append(pkey)
        answer = decoders.tokenizer.decode(answer_for_next_turn(res).tokens, skip_special_tokens=True)
        history = history + [{"role": "assistant", "content": answer}]
        log.debug("set %s %s#%d: %d prompt tokens, %d new; τ dflash %.2f, lookup %.2f",
                  bset.name, conv.id, t, len(ids), len(res["target_only"].tokens),
                  res["dflash"].tau, res["prompt_lookup"].tau)
        bar.set_postfix_str(f"set {bset.name}{tau_so_far(so_far)}", refresh=False)
        bar.update(1)
    return rec


#: which answer a later turn follows (:func:`answer_for_next_turn`; part of the resume key and the report's ``run``)
NEXT_TURN_RULE = "the lossless reference's answer, else target-only decoding's"
#: the report's ``run.next_turn``: which of the two a run's later turns followed
NEXT_TURN_REFERENCE = "after the lossless reference's answer"
NEXT_TURN_TARGET_ONLY = "after target-only decoding's answer"


def answer_for_next_turn(res: dict[str, GenerationResult]) -> GenerationResult:
    """The answer a conversation's next turn is asked after: the lossless reference's when :meth:`Decoders.decode`
    made one (greedy on the static path), else target-only decoding's (greedy or, when sampling, sampled).

    The reference is the target's greedy answer at the verify width, the one every lossless method commits, and it
    repeats bit for bit from run to run; one-token target-only forwards do not on a GPU (2026-12-04, H200: the same
    target's target-only answer to an MT-Bench first turn ran 256 tokens in three runs and 216 in a fourth, so 11
    of 32 second turns differed between runs and prompt lookup's MT-Bench τ moved from 2.31 to 2.69;
    docs/peers/README.md, "SpecForge judged"). Following the reference asks every method, in every run, the same
    second turn, so reports of two drafters pair on all of a set's turns (expected from the lengths above; two
    GPU runs pairing on every turn is still to be seen).
    """
    return res.get("reference") or res["target_only"]


def tau_so_far(so_far: dict[str, list[GenerationResult]]) -> str:
    """``, τ so far: dflash 2.10, lookup 1.80`` (empty before the first prompt is decoded)."""
    if not so_far.get("dflash"):
        return ""
    start = (f", start drafter {summarize(so_far[START_METHOD])['tau']:.2f}" if so_far.get(START_METHOD) else "")
    return (f", τ so far: dflash {summarize(so_far['dflash'])['tau']:.2f}"
            f", lookup {summarize(so_far['prompt_lookup'])['tau']:.2f}{start}")


def aggregate(bset: BenchmarkSet, records: dict[str, dict]) -> dict:
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
            results.setdefault(m, []).extend(result_from_dict(d) for d in rs)
        labels += rec["labels"]
        keys += rec["prompt_keys"]
        for reason, n in rec["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        planned += rec["planned"]
    return {"results": results, "labels": labels, "prompt_keys": keys, "skipped_prompts": skipped,
            "planned": planned}


def decoding_path(decoders: Decoders) -> dict:
    """How the loaded target decodes: its rollback, the KV cache kind, the lossless reference (report ``run``)."""
    decoders.load()
    static = decoders.static
    mtp = next(iter(decoders.mtp.values()), None)
    return {
        "rollback": _rollback_text(decoders.target, decoders.rollback),
        "mtp_decoding": None if mtp is None else (
            "fixed K/V buffers indexed by position" + (", CUDA graphs" if mtp.drafter.cuda_graphs else "")),
        "decoding": ("static KV cache" + (", CUDA graphs" if static.cuda_graphs else "") if static is not None
                     else "dynamic KV cache"),
        "lossless_reference": (f"greedy target-only decoding with forwards padded to the verify width "
                               f"({static.verify_width} tokens: the kernels verification runs)"
                               if static is not None else "greedy target-only decoding"),
        "next_turn": (NEXT_TURN_REFERENCE if static is not None and decoders.sampling.greedy
                      else NEXT_TURN_TARGET_ONLY),
    }


def _rollback_text(target: nn.Module, rollback: str) -> str:
    """How the target's cache is rolled back after a partly accepted block, in words (report ``run.rollback``)."""
    from draftsmith.evaluate.cache import TargetCache

    with TargetCache(target, rollback) as cache:
        if not cache.recurrent:
            return "crop (attention-only target)"
        rerun = "recurrent mixers" if cache.mode == "mixer" else "target"
        return f"snapshot + re-run accepted tokens through the {rerun}"
