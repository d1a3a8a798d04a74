"""Target-only decoding and speculative decoding (DFlash / DFlash2 drafter or prompt lookup), batch size 1.

The speculative loop follows the official z-lab ``dflash_generate`` (``dflash/model.py``, dflash
0.1.0) step for step, so its acceptance lengths are the official figure (tested equal):

* prefill the prompt, capturing the tapped target layers (``draftsmith.target.capture_layers``; no
  early stop: the cache needs every layer), and choose the first new token from the last logits;
* each step, with ``start`` = position of the last committed token (not yet fed to the target):
  block = [token at start, mask x (B - 1)]; the drafter sees the target features of the committed
  positions it has not seen yet (its K/V cache keeps the older ones and is cropped back to ``start``
  after drafting), and drafts B - 1 tokens;
* a DFlash2 drafter drafts the path its candidate selector picks through each slot's top-k (greedy: the best
  path; sampling: drawn from ``softmax(S / T)`` over the candidates, that distribution, zero elsewhere, the draft
  distribution rejection sampling uses), as the official ``dflash_generate`` does;
* one target forward verifies the block; greedy: the longest prefix equal to the target's argmax is
  accepted, plus the target's own next token (bonus / correction); sampling: rejection sampling;
* the committed count of the step (accepted + 1, capped by max_new_tokens and the first stop token)
  is its acceptance length; the target cache is rolled back to the committed length exactly, GDN
  recurrent state included (:class:`draftsmith.evaluate.cache.TargetCache`);
* the drafter's next context is the verify forward's features at the committed positions.

τ (acceptance length) = tokens committed per verify forward, bonus included; the first token (from
the prefill logits) is not part of any step, as in the official code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from draftsmith.evaluate.cache import TargetCache
from draftsmith.evaluate.sampling import (
    SamplingConfig,
    greedy_accept,
    rejection_sample,
    sampling_probs,
    select_tokens,
)
from draftsmith.hybrid_cache import cache_kwargs, record_past
from draftsmith.modeling_dflash2 import DFlash2DraftModel
from draftsmith.target import capture_layers, without_cudnn_attention


@dataclass
class GenerationResult:
    """One prompt's decoding.

    Attributes:
        tokens: generated token ids (prompt excluded, stop token included when hit).
        num_prompt_tokens: prompt length in tokens.
        seconds: wall-clock seconds of the whole call (prefill + decode; CUDA synchronised).
        prefill_seconds: seconds until the first new token was chosen.
        committed: per verify step, tokens committed (accepted drafts + 1, capped by the budget and
            the first stop token) = the official ``acceptance_lengths``. Empty for target-only
            decoding, where every step commits one token.
        accepted: per verify step, drafts accepted by the target (0..proposed, before capping).
        proposed: per verify step, drafts proposed (B - 1 for DFlash, 0..n for prompt lookup).
        stopped: a stop token ended the generation (else the token budget did).
    """

    tokens: list[int]
    num_prompt_tokens: int
    seconds: float
    prefill_seconds: float
    committed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    stopped: bool = False

    @property
    def steps(self) -> int:
        """Target forwards after the prefill."""
        return len(self.committed) if self.committed else max(len(self.tokens) - 1, 0)

    @property
    def tau(self) -> float:
        """Acceptance length τ: mean tokens committed per verify forward (1.0 for target-only)."""
        return sum(self.committed) / len(self.committed) if self.committed else 1.0

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def output_head(target: nn.Module) -> nn.Module:
    """The target's LM head (``lm_head`` or ``get_output_embeddings()``), shared with the drafter."""
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


def dflash_value(config, name: str, default=None):
    """A DFlash setting: ``config.dflash_config[name]``, else ``config.<name>``, else ``default``."""
    dcfg = getattr(config, "dflash_config", None) or {}
    return dcfg.get(name, getattr(config, name, default))


# ------------------------------------------------------------------------------------------------
# Proposers
# ------------------------------------------------------------------------------------------------

class Proposer:
    """Interface of a draft proposer used by :func:`speculative_generate`.

    ``needs_features``: whether it needs the target features (``layer_ids``) of committed positions.
    ``max_drafts``: drafts per step at most.
    """

    needs_features = False
    layer_ids: list[int] = []
    max_drafts = 0
    name = "proposer"

    def reset(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """Start a new prompt: ``prompt_ids [1, P]``, features ``[1, P, n*H]`` of the prompt or None."""

    def propose(self, tokens: torch.Tensor, start: int, num_drafts: int,
                sampling: SamplingConfig, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts for positions start+1..start+k (k <= num_drafts).

        Args:
            tokens: ``[>= start + 1]`` int64 committed tokens (prompt + generated), on the target's device.
            start: position of the last committed token.
        Returns:
            ``(drafts [k] int64, draft_probs [k, V] float or None)``; None = deterministic drafts.
        """
        raise NotImplementedError

    def commit(self, features: torch.Tensor | None) -> None:
        """Features ``[1, n_new, n*H]`` of the newly committed positions (None if not needed)."""


class DFlashProposer(Proposer):
    """The DFlash or DFlash2 drafter as a proposer (block diffusion: one drafter forward drafts B - 1 tokens).

    Args:
        drafter: a ``DFlashDraftModel`` or ``DFlash2DraftModel`` (draftsmith's or the official ``dflash.model``):
            ``forward(position_ids, noise_embedding, target_hidden, past_key_values, use_cache) ->
            [1, Q, H]``, ``compute_logits(hidden, head)``, ``block_size``, ``mask_token_id``,
            ``target_layer_ids``, ``config``; DFlash2 also ``candidate_selector`` and
            ``propose(hidden, anchor_ids, head, temperature)``.
        target: the target (its input embedding embeds the block, its LM head gives draft logits).
        block_size: override of the drafter's block size B (verify width).

    Raises:
        ValueError: drafter without a mask token, or whose width differs from the target's.
    """

    needs_features = True
    name = "dflash"

    def __init__(self, drafter: nn.Module, target: nn.Module, block_size: int | None = None):
        self.drafter = drafter
        self.block_size = int(block_size or drafter.block_size)
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2, got {self.block_size}")
        self.max_drafts = self.block_size - 1
        if drafter.mask_token_id is None:
            raise ValueError("the drafter config has no mask_token_id (dflash_config.mask_token_id)")
        self.mask_token_id = int(drafter.mask_token_id)
        self.layer_ids = [int(i) for i in drafter.target_layer_ids]
        self.embed_weight = target.get_input_embeddings().weight
        if self.mask_token_id >= self.embed_weight.shape[0]:
            raise ValueError(f"drafter mask_token_id {self.mask_token_id} is outside the target's "
                             f"embedding ({self.embed_weight.shape[0]} rows)")
        if self.embed_weight.shape[1] != drafter.config.hidden_size:
            raise ValueError(f"drafter hidden_size {drafter.config.hidden_size} != target hidden size "
                             f"{self.embed_weight.shape[1]}")
        self.head = output_head(target)
        self.embed_scale = float(dflash_value(drafter.config, "input_embedding_scale", 1.0))
        self.dtype = next(drafter.parameters()).dtype
        #: DFlash2: drafts are the candidate selector's path (:meth:`_select`)
        self.selector = hasattr(drafter, "candidate_selector")
        self.cache = None
        self.context = None
        #: a :class:`~draftsmith.evaluate.static.StaticDrafter` (fixed K/V buffers, CUDA-graph steps) or None
        self.static = None

    def use_static(self, max_length: int, cuda_graphs: bool = True) -> bool:
        """Draft on a :class:`~draftsmith.evaluate.static.StaticDrafter` of ``max_length`` positions when the
        drafter qualifies; returns whether it does (else drafting stays on the dynamic cache)."""
        from draftsmith.evaluate.static import StaticDrafter

        if not StaticDrafter.supported(self.drafter)[0]:
            return False
        self.static = StaticDrafter(self.drafter, self.embed_weight, self.head, max_length,
                                    embed_scale=self.embed_scale, cuda_graphs=cuda_graphs)
        return True

    def reset(self, prompt_ids, features):
        self.cache = DynamicCache(config=self.drafter.config)
        record_past(self.cache)
        self.context = features

    def propose(self, tokens, start, num_drafts, sampling, generator):
        verify = num_drafts + 1
        with without_cudnn_attention():  # the drafter's key length grows every step: no per-shape cuDNN plans
            if self.selector:
                return self._select(tokens, start, verify, sampling, generator)
            if self.static is not None:
                logits = self.static.logits(self.context, tokens[start], start, verify)
            else:
                logits = self._dynamic_logits(tokens, start, verify)
        if sampling.greedy:
            return torch.argmax(logits, dim=-1), None
        probs = sampling_probs(logits, sampling)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], probs

    def _select(self, tokens, start, verify, sampling, generator):
        """DFlash2: the selector's path ``[verify - 1]`` and, sampling, its distribution ``[verify - 1, V]`` (the
        candidates' probabilities scattered into the vocabulary; tokens outside the top-k have 0)."""
        anchor = tokens[start:start + 1]
        temperature = 0.0 if sampling.greedy else float(sampling.temperature)
        if self.static is not None and temperature == 0:  # the path drafted inside the step's CUDA graph
            return self.static.greedy_path(self.context, tokens[start], start, verify)[0].clone(), None
        if self.static is not None:  # draftsmith's DFlash2DraftModel on fixed buffers (CUDA graphs on a GPU)
            hidden, logits = self.static.step(self.context, tokens[start], start, verify)
            drafts, candidates, q = self.drafter.candidate_selector.select(hidden, logits[None], anchor, temperature,
                                                                           generator)
            return self._drafts(drafts, candidates, q)
        hidden = self._dynamic_hidden(tokens, start, verify)
        if isinstance(self.drafter, DFlash2DraftModel):  # draftsmith's: draws with the evaluation's generator
            drafts, candidates, q = self.drafter.propose(hidden, anchor, self.head, temperature, generator)
        else:  # the official class draws from torch's global RNG
            drafts, candidates, q = self.drafter.propose(hidden, anchor, self.head, temperature)
        return self._drafts(drafts, candidates, q)

    def _drafts(self, drafts, candidates, q):
        """The selector's path ``drafts [1, P]`` as the proposer's ``(tokens [P], probs [P, V] or None)``: ``q [1, P,
        k]`` over ``candidates [1, P, k]`` scattered into the vocabulary."""
        if q is None:
            return drafts[0], None
        probs = torch.zeros((q.shape[1], self.embed_weight.shape[0]), dtype=q.dtype, device=q.device)
        return drafts[0], probs.scatter_(-1, candidates[0], q[0])

    def _dynamic_logits(self, tokens, start, verify):
        """Draft logits ``[verify - 1, V]`` on the growing ``DynamicCache`` (cropped back to the context after)."""
        return self.drafter.compute_logits(self._dynamic_hidden(tokens, start, verify), self.head)[0]  # [k, V]

    def _dynamic_hidden(self, tokens, start, verify):
        """Draft hidden states ``[1, verify - 1, H]`` on the growing ``DynamicCache`` (cropped back to the context
        after)."""
        block = torch.full((1, verify), self.mask_token_id, dtype=torch.long, device=tokens.device)
        block[0, 0] = tokens[start]
        noise = F.embedding(block, self.embed_weight) * self.embed_scale
        ctx_len = self.context.shape[1]
        positions = torch.arange(start - ctx_len, start + verify, device=tokens.device)[None]
        hidden = self.drafter(target_hidden=self.context.to(self.dtype), noise_embedding=noise.to(self.dtype),
                              position_ids=positions, past_key_values=self.cache, use_cache=True)
        hidden = hidden[:, 1:, :]
        remove = self.cache.get_seq_length() - start  # keep only the context K/V (official _crop_to)
        self.cache.crop(-remove)
        return hidden

    def commit(self, features):
        self.context = features


class PromptLookupProposer(Proposer):
    """Prompt-lookup (n-gram) drafting, the reference drafter (Saxena 2023; HF
    ``PromptLookupCandidateGenerator``): find the trailing n-gram (n = max_ngram .. 1) earlier in the
    committed tokens, earliest match first, and propose the tokens that followed it.

    Args:
        max_ngram: longest n-gram tried.
        num_tokens: drafts per step at most.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, num_tokens: int = 10):
        if max_ngram < 1 or num_tokens < 1:
            raise ValueError(f"max_ngram and num_tokens must be >= 1, got {max_ngram}, {num_tokens}")
        self.max_ngram = max_ngram
        self.max_drafts = num_tokens

    def propose(self, tokens, start, num_drafts, sampling, generator):
        ids = tokens[: start + 1]
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = ids.unfold(0, n, 1)  # [length - n + 1, n]
            matches = (windows == ids[length - n:]).all(dim=1).nonzero()[:, 0].tolist()
            for idx in matches:
                begin = idx + n
                end = min(begin + num_drafts, length)
                if begin < end:
                    return ids[begin:end].clone(), None
        return ids[:0].clone(), None


# ------------------------------------------------------------------------------------------------
# The target's forwards: a dynamic cache with exact rollback, or a static cache with CUDA graphs
# ------------------------------------------------------------------------------------------------

class DynamicTarget:
    """The target on a growing ``DynamicCache`` with exact rollback (:class:`TargetCache`, GDN state included)
    and forward hooks on the tapped layers: any target, any device. Use as a context manager, per prompt.

    Args:
        target: Hugging Face causal LM.
        layer_ids: tapped layers whose features forwards return (``[]``: none).
        rollback: see :class:`TargetCache`.
    """

    def __init__(self, target: nn.Module, layer_ids: list[int], rollback: str = "auto"):
        self.target, self.layer_ids, self.rollback_mode = target, list(layer_ids), rollback
        self.tcache = None
        self.cap = None
        self._cap_ctx = None

    def __enter__(self) -> "DynamicTarget":
        self.tcache = TargetCache(self.target, rollback=self.rollback_mode).__enter__()
        if self.layer_ids:
            self._cap_ctx = capture_layers(self.target, self.layer_ids)
            self.cap = self._cap_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cap_ctx is not None:
            self._cap_ctx.__exit__(*exc)
        self.tcache.__exit__(*exc)

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the prompt ``[1, P]``; returns the last position's logits ``[V]`` and features ``[1, P, n*H]``."""
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        out = self.target(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                          **cache_kwargs(self.target, self.tcache.cache))
        self.tcache.advance(ids.shape[1])
        return out.logits[0, -1], (self.cap.features() if self.cap is not None else None)

    def forward_block(self, tokens: torch.Tensor, start: int, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``tokens [1, k]`` at positions ``start..``; returns logits ``[k, V]`` and features ``[1, k, n*H]``.
        Follow with :meth:`commit`. ``width`` is ignored (no padding needed)."""
        k = tokens.shape[1]
        if k > 1:
            self.tcache.checkpoint()
        if self.cap is not None:
            self.cap.clear()
        positions = torch.arange(start, start + k, device=tokens.device)[None]
        out = self.target(input_ids=tokens, position_ids=positions, use_cache=True,
                          **cache_kwargs(self.target, self.tcache.cache))
        self._last = (tokens, positions)
        return out.logits[0], (self.cap.features() if self.cap is not None else None)

    def commit(self, consumed: int, keep: int) -> None:
        """Keep the first ``keep`` of the ``consumed`` tokens of the last :meth:`forward_block`."""
        tokens, positions = self._last
        self.tcache.rollback(consumed, keep, tokens, positions)

    def select(self, features: torch.Tensor | None, layer_ids: list[int]) -> torch.Tensor | None:
        """The features of ``layer_ids``: this runner taps exactly the proposer's layers, so ``features`` as they
        are."""
        return features


class _StaticRun:
    """Per-prompt view of a :class:`draftsmith.evaluate.static.StaticTarget` with the runner interface."""

    def __init__(self, static):
        self.static = static

    def __enter__(self) -> "_StaticRun":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def prefill(self, ids):
        return self.static.prefill(ids)

    def forward_block(self, tokens, start, width=None):
        return self.static.forward_block(tokens, start, width)

    def commit(self, consumed: int, keep: int) -> None:
        """Attention layers: nothing to undo (the next forward sets the cache length to the committed positions);
        Gated DeltaNet layers: the snapshot / replay rollback of :meth:`StaticTarget.commit`."""
        self.static.commit(keep)

    def select(self, features: torch.Tensor | None, layer_ids: list[int]) -> torch.Tensor | None:
        """The columns of ``layer_ids`` among the static target's tapped layers (it serves every proposer of the
        run: DFlash's taps plus the last layer for the MTP head), ``[1, k, len(layer_ids) * H]``.

        Raises:
            ValueError: a layer the static target does not tap.
        """
        tapped = list(self.static.layer_ids)
        if features is None or list(layer_ids) == tapped:
            return features
        missing = [i for i in layer_ids if i not in tapped]
        if missing:
            raise ValueError(f"the static target taps layers {tapped}, not {missing}")
        width = features.shape[-1] // len(tapped)
        return torch.cat([features[..., tapped.index(i) * width:(tapped.index(i) + 1) * width] for i in layer_ids],
                         dim=-1)


def target_runner(target: nn.Module, layer_ids: list[int], rollback: str = "auto", static=None):
    """The runner for one prompt: ``static`` (a :class:`~draftsmith.evaluate.static.StaticTarget`) when given,
    else a :class:`DynamicTarget`."""
    return _StaticRun(static) if static is not None else DynamicTarget(target, layer_ids, rollback)


# ------------------------------------------------------------------------------------------------
# Decoding loops
# ------------------------------------------------------------------------------------------------

def _prompt_tensor(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one non-empty prompt [1, P], got shape {tuple(ids.shape)}")
    return ids


@torch.inference_mode()
def target_generate(target: nn.Module, input_ids, *, max_new_tokens: int,
                    stop_token_ids: list[int] | None = None,
                    sampling: SamplingConfig = SamplingConfig(),
                    generator: torch.Generator | None = None, static=None, width: int | None = 1,
                    on_tokens: Callable[[int], None] | None = None) -> GenerationResult:
    """Target-only decoding (the baseline and the lossless reference): one token per forward.

    Args:
        target: Hugging Face causal LM.
        input_ids: ``[1, P]`` or ``[P]`` prompt token ids.
        max_new_tokens: tokens generated at most (stop token included).
        stop_token_ids: ids that end the generation (eos, end of turn).
        sampling: greedy (temperature 0) or sampling.
        generator: RNG for sampling.
        static: a :class:`~draftsmith.evaluate.static.StaticTarget` (static cache, CUDA graphs) or None
            (dynamic cache).
        width: static path only: each one-token forward padded to this width (None: the static target's verify
            width). With the verify width, target-only
            decoding runs the very kernels verification runs, so its greedy output is the exact reference for the
            lossless check in bf16 (a 1-token forward's kernels round differently and flip near-tied argmaxes).
        on_tokens: called with 1 after each token generated (the progress line's tokens decoded).

    Returns:
        :class:`GenerationResult` (``committed`` empty: every step commits one token).
    """
    device = _device_of(target)
    ids = _prompt_tensor(input_ids, device)
    stops = set(stop_token_ids or [])
    t0 = _now(device)
    with target_runner(target, [], static=static) as runner:
        logits, _ = runner.prefill(ids)
        token = int(select_tokens(logits, sampling, generator).item())
        t_first = _now(device)
        tokens = [token]
        position = ids.shape[1]
        stopped = token in stops
        if on_tokens is not None:
            on_tokens(1)
        step_ids = torch.empty((1, 1), dtype=torch.long, device=device)
        while len(tokens) < max_new_tokens and not stopped:
            step_ids.fill_(token)
            logits, _ = runner.forward_block(step_ids, position, width)
            runner.commit(1, 1)
            position += 1
            token = int(select_tokens(logits[-1], sampling, generator).item())
            tokens.append(token)
            stopped = token in stops
            if on_tokens is not None:
                on_tokens(1)
    t1 = _now(device)
    return GenerationResult(tokens=tokens, num_prompt_tokens=ids.shape[1], seconds=t1 - t0,
                            prefill_seconds=t_first - t0, stopped=stopped)


@torch.inference_mode()
def speculative_generate(target: nn.Module, proposer: Proposer, input_ids, *, max_new_tokens: int,
                         stop_token_ids: list[int] | None = None,
                         sampling: SamplingConfig = SamplingConfig(),
                         generator: torch.Generator | None = None,
                         rollback: str = "auto", static=None,
                         on_tokens: Callable[[int], None] | None = None) -> GenerationResult:
    """Speculative decoding of one prompt: draft with ``proposer``, verify with one target forward.

    Lossless: with greedy sampling the tokens equal :func:`target_generate`'s; with temperature > 0
    they are distributed as the target's (rejection sampling). Semantics of the budget, the stop
    tokens and the acceptance lengths follow the official ``dflash_generate``.

    Args:
        target: Hugging Face causal LM (hybrid GDN targets included).
        proposer: :class:`DFlashProposer`, :class:`PromptLookupProposer` or any :class:`Proposer`.
        input_ids: ``[1, P]`` or ``[P]`` prompt.
        max_new_tokens: tokens generated at most.
        stop_token_ids: ids that end the generation.
        sampling: greedy or sampling.
        generator: RNG for sampling and rejection draws.
        rollback: how recurrent state is restored, see :class:`TargetCache`.
        static: a :class:`~draftsmith.evaluate.static.StaticTarget` (static cache, CUDA graphs; attention-only
            and Gated DeltaNet hybrid targets) or None (dynamic cache with exact rollback).
        on_tokens: called with the tokens committed by each step, the first token included (the progress line).

    Returns:
        :class:`GenerationResult` with per-step ``committed`` / ``accepted`` / ``proposed``.
    """
    device = _device_of(target)
    ids = _prompt_tensor(input_ids, device)
    num_prompt = ids.shape[1]
    max_length = num_prompt + max_new_tokens
    stops = torch.tensor(sorted(set(stop_token_ids or [])), dtype=torch.long, device=device)
    output = torch.zeros(max_length + 1, dtype=torch.long, device=device)
    output[:num_prompt] = ids[0]
    committed, accepted_log, proposed_log = [], [], []

    t0 = _now(device)
    layer_ids = proposer.layer_ids if proposer.needs_features else []
    with target_runner(target, layer_ids, rollback, static) as runner:
        logits, features = runner.prefill(ids)
        output[num_prompt] = select_tokens(logits, sampling, generator)
        proposer.reset(ids, runner.select(features, layer_ids) if proposer.needs_features else None)
        t_first = _now(device)
        start = num_prompt
        stopped = bool(torch.isin(output[start], stops).item()) if stops.numel() else False
        if on_tokens is not None:
            on_tokens(1)
        while start + 1 < max_length and not stopped:
            room = max_length - start - 1  # drafts that can still become output
            drafts, draft_probs = proposer.propose(output, start, min(proposer.max_drafts, room),
                                                   sampling, generator)
            k = int(drafts.shape[0])
            block = torch.cat([output[start:start + 1], drafts.to(device)])[None]
            logits, features = runner.forward_block(block, start)  # [k + 1, V]; static: padded to its verify width
            if sampling.greedy:
                accepted, next_token = greedy_accept(drafts, logits)
            else:
                accepted, next_token = rejection_sample(drafts, sampling_probs(logits, sampling),
                                                        draft_probs, generator)
            output[start + 1:start + 1 + accepted] = drafts[:accepted]
            output[start + accepted + 1] = next_token
            produced = min(accepted + 1, max_length - start - 1)
            if stops.numel():
                hits = torch.isin(output[start + 1:start + produced + 1], stops).nonzero()
                if hits.numel():
                    produced = int(hits[0, 0].item()) + 1
                    stopped = True
            runner.commit(k + 1, produced)
            proposer.commit(runner.select(features[:, :produced], layer_ids).clone() if proposer.needs_features
                            else None)
            start += produced
            committed.append(produced)
            accepted_log.append(accepted)
            proposed_log.append(k)
            if on_tokens is not None:
                on_tokens(produced)
    t1 = _now(device)
    end = min(start + 1, max_length)
    return GenerationResult(tokens=output[num_prompt:end].tolist(), num_prompt_tokens=num_prompt,
                            seconds=t1 - t0, prefill_seconds=t_first - t0, committed=committed,
                            accepted=accepted_log, proposed=proposed_log, stopped=stopped)
