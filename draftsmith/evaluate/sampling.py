"""Token selection for target-only and speculative decoding: greedy, sampling, rejection sampling.

Sampling follows the official z-lab DFlash code (``dflash/model.py``: ``_sampling_probs``,
``_rejection_sample``): logits / temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019,
arXiv 1904.09751) on the renormalised top-k distribution. Speculative sampling is the standard
rejection scheme of Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023
(arXiv 2302.01318): draft token x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
at the first rejection the replacement is drawn from the residual norm(max(p_i - q_i, 0)); when every
draft is accepted a bonus token is drawn from p_k. The committed tokens are then distributed exactly
as tokens sampled from the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        temperature: 0 = greedy (argmax, the lossless check); > 0 = sample from softmax(logits / T).
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.

    Raises:
        ValueError: temperature < 0, top_p outside (0, 1] or top_k < 0.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sampling_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (the official DFlash order).

    Args:
        logits: ``[..., V]`` any float dtype.
        sampling: a sampling (temperature > 0) configuration.

    Returns:
        ``[..., V]`` float32 probabilities; entries outside the top-k / nucleus are exactly 0.
    """
    if sampling.greedy:
        raise ValueError("sampling_probs needs temperature > 0 (greedy decoding uses argmax)")
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    indices = None
    if 0 < sampling.top_k < vocab:
        scores, indices = torch.topk(scores, sampling.top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < sampling.top_p  # the top token always stays
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if indices is not None:
        probs = torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter(-1, indices, probs)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` -> ``[...]`` int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def select_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens from ``logits [..., V]``: argmax when greedy, else a sample. Returns ``[...]`` int64."""
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    return sample_from(sampling_probs(logits, sampling), generator)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: the longest draft prefix equal to the target's argmax, plus the bonus token.

    Args:
        draft_tokens: ``[k]`` int64, the drafted tokens for positions t+1..t+k.
        target_logits: ``[k + 1, V]``, the target's logits at positions t..t+k (row i predicts t+i+1).

    Returns:
        ``(accepted, next_token)``: accepted in 0..k drafts, and the target's own token after them
        (the correction at the first mismatch, or the bonus token when all k were accepted).
    """
    posterior = torch.argmax(target_logits, dim=-1)
    k = draft_tokens.shape[0]
    accepted = int((draft_tokens == posterior[:k]).to(torch.int64).cumprod(0).sum().item()) if k else 0
    return accepted, int(posterior[accepted].item())


def rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative (rejection) sampling of one block; lossless w.r.t. the target distribution.

    Args:
        draft_tokens: ``[k]`` int64 drafted tokens.
        target_probs: ``[k + 1, V]`` float target probabilities at positions t..t+k (after
            temperature / top-k / top-p, see :func:`sampling_probs`).
        draft_probs: ``[k, V]`` the drafter's probabilities the drafts were sampled from, or ``None``
            for a deterministic drafter (prompt lookup, greedy drafts): q is then one-hot on the draft.
        generator: torch RNG for reproducible draws.

    Returns:
        ``(accepted, next_token)``: accepted drafts in 0..k and the token committed after them,
        drawn from the residual ``norm(max(p - q, 0))`` at the first rejection, or from ``p_k``
        (bonus) when every draft was accepted. Leviathan et al. 2023, arXiv 2211.17192, Alg. 1.
    """
    k = draft_tokens.shape[0]
    if k:
        p = target_probs[:k].gather(-1, draft_tokens[:, None])[:, 0]
        if draft_probs is None:
            q = torch.ones_like(p)
        else:
            q = draft_probs.gather(-1, draft_tokens[:, None])[:, 0].to(p.dtype)
        u = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
        accepted = int((u * q < p).to(torch.int64).cumprod(0).sum().item())
    else:
        accepted = 0
    if accepted == k:
        return accepted, int(sample_from(target_probs[k], generator).item())
    residual = target_probs[accepted].clone()
    if draft_probs is None:
        residual[draft_tokens[accepted]] = 0.0  # max(p - onehot, 0)
    else:
        residual = (residual - draft_probs[accepted].to(residual.dtype)).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q exactly: the draft could not have been rejected; keep p (as dflash does)
        residual = target_probs[accepted]
    else:
        residual = residual / total
    return accepted, int(sample_from(residual, generator).item())
