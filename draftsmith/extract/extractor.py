"""The extraction forward: a target's tapped-layer features of right-padded batches, its greedy next token and,
with ``extract.store_target_topk``, its top-k next tokens and their log-probabilities (:class:`FeatureExtractor`).
Run by the shard jobs (:mod:`draftsmith.extract.shard`) and the peers' bench writers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from draftsmith.features import check_target_topk
from draftsmith.target import LayerCapture, text_config
from draftsmith.target_checks import logit_transform

LOGITS_CHUNK_BYTES = 1 << 30  # at most this many bytes of logits alive at once (target tokens)


class FeatureExtractor:
    """Runs right-padded batches through a target and returns unpadded tapped-layer features.

    Use as a context manager (it registers forward hooks on the tapped decoder layers). Calls the
    base decoder (``model.get_decoder()``) with ``use_cache=False``; without target tokens the
    forward stops after the deepest tapped layer. With target tokens the whole decoder runs and
    ``target_token[t] = argmax(lm_head(final_norm(h_L))[t])`` is computed on real tokens only, in
    slices of at most :data:`LOGITS_CHUNK_BYTES` of logits (never a [tokens x vocab] float32 tensor).
    The argmax equals that of the model's logits for HF decoders whose logits are a monotone map of
    ``lm_head`` output (logit scaling, tanh soft-capping).

    With ``target_topk`` = k > 0 the same slices also give the k most likely next tokens: the float32
    ``log_softmax`` of ``lm_head`` output over the whole vocabulary, its top k (most likely first) and their
    log-probabilities (not renormalised over the k); column 0 of the ids is ``target_token`` (the argmax), also where
    ``topk`` ranks another of exactly tied tokens first (bf16 logits on a GPU). They are the distribution of
    decoders whose logits are ``lm_head`` output itself (a target that scales or caps its logits after ``lm_head``
    has another one).

    Args:
        model: a loaded ``AutoModelForCausalLM`` (eval mode).
        layer_ids: target layer ids (id i = output of decoder layer i).
        target_tokens: also return the greedy next-token prediction per position.
        padding_mask: pass the attention mask for batches of more than one row. Right padding with a
            causal model never lets a real token see a pad, so ``False`` gives the same features
            (tested) and lets SDPA skip the mask.
        pad_token_id: id written into pad positions (any valid id).
        target_topk: k, also return the target's top-k next tokens and their log-probabilities (0: none).

    Raises:
        ValueError: no output embeddings with ``target_tokens``; ``target_topk`` > 0 without ``target_tokens``, or
            above the vocabulary (``extract.store_target_topk`` named).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, target_tokens: bool,
                 padding_mask: bool = True, pad_token_id: int | None = None, target_topk: int = 0):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.num_layers = len(self.layer_ids)
        self.target_tokens = target_tokens
        self.padding_mask = padding_mask
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings() if target_tokens else None
        if target_tokens and self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings: cannot compute target tokens")
        self.capture = LayerCapture(model, self.layer_ids, stop_after_deepest=not target_tokens)
        self.device = next(model.parameters()).device
        cfg = text_config(model.config)
        self.hidden = int(cfg.hidden_size)
        self.vocab = int(cfg.vocab_size)
        self.target_topk = int(target_topk)
        check_target_topk(self.target_topk, target_tokens)
        if self.target_topk > self.vocab:
            raise ValueError(f"extract.store_target_topk {self.target_topk} is outside 0..{self.vocab} (the "
                             "target's vocabulary)")
        transform = logit_transform(cfg)
        if self.target_topk and transform:
            raise ValueError(f"extract.store_target_topk {self.target_topk}: {type(model).__name__} transforms its "
                             f"logits after lm_head ({transform}), so lm_head's top-k would not be its distribution; "
                             "soft labels are built for targets whose logits are lm_head's output: set "
                             "extract.store_target_topk: 0 and train.labels: target")
        pad = pad_token_id if pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab else 0
        self.forward_calls = 0

    def __enter__(self) -> "FeatureExtractor":
        self.capture.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.capture.__exit__(*exc)
        self.capture.clear()

    @torch.inference_mode()
    def __call__(self, samples: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
        """Features of one batch.

        Args:
            samples: token ids of each row (int arrays), longest first or any order.
        Returns:
            ``(hidden [T, n_layers * H] in the model dtype on the model device, target_token [T] int32
            or None)`` with T = sum of lengths, rows concatenated in the given order; with ``target_topk`` = k > 0
            ``(hidden, target_token, topk_ids [T, k] int32, topk_logprobs [T, k] float16)`` (on the model device).
        """
        lengths = [len(s) for s in samples]
        bsz, seq = len(samples), max(lengths)
        ids = np.full((bsz, seq), self.pad_token_id, dtype=np.int64)
        for b, s in enumerate(samples):
            ids[b, :len(s)] = s
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        mask = None
        if bsz > 1 and self.padding_mask and min(lengths) < seq:
            mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long().to(self.device)
        if self.target_topk and not self.forward_calls:
            self._check_logits_are_lm_heads(input_ids[:1, :lengths[0]][:, :32])
        self.forward_calls += 1
        out = self.capture.run(self.decoder, input_ids=input_ids, attention_mask=mask, use_cache=False)
        feats = self.capture.features()  # [B, S, n*H]
        self.capture.clear()
        if bsz == 1:
            hidden = feats[0]
            index = None
        else:
            index = torch.from_numpy(np.concatenate(
                [b * seq + np.arange(n, dtype=np.int64) for b, n in enumerate(lengths)])).to(self.device)
            hidden = feats.reshape(bsz * seq, -1).index_select(0, index)
        del feats
        target_token = None
        if self.target_tokens:
            last = out.last_hidden_state  # after the final norm
            last = last[0] if index is None else last.reshape(bsz * seq, -1).index_select(0, index)
            if self.target_topk:
                return hidden, *self._topk_logits(last)
            target_token = self._argmax_logits(last)
        return hidden, target_token

    def _argmax_logits(self, last: torch.Tensor) -> torch.Tensor:
        """``argmax(lm_head(last))`` per token, in slices bounding the logits to LOGITS_CHUNK_BYTES."""
        step = max(1, LOGITS_CHUNK_BYTES // (self.vocab * max(4, last.element_size())))
        out = torch.empty(last.shape[0], dtype=torch.int32, device=last.device)
        for a in range(0, last.shape[0], step):
            out[a:a + step] = self.lm_head(last[a:a + step]).argmax(-1).to(torch.int32)
        return out

    def _topk_logits(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(target_token [T] int32, topk_ids [T, k] int32, topk_logprobs [T, k] float16)``: the argmax of
        ``lm_head(last)`` in :meth:`_argmax_logits`' slices (the same matmuls, so the same token as without the
        top-k, ties included), and the top k of the same logits, most likely first (the argmax in column 0:
        :func:`argmax_first`), with their log-probabilities ``z - logsumexp(z)`` (float32 sums; the log-softmax of
        the whole vocabulary is never held)."""
        k, n = self.target_topk, last.shape[0]
        step = max(1, LOGITS_CHUNK_BYTES // (self.vocab * max(4, last.element_size())))
        token = torch.empty(n, dtype=torch.int32, device=last.device)
        ids = torch.empty(n, k, dtype=torch.int32, device=last.device)
        logprobs = torch.empty(n, k, dtype=torch.float16, device=last.device)
        for a in range(0, n, step):
            logits = self.lm_head(last[a:a + step])
            arg = logits.argmax(-1)
            token[a:a + step] = arg.to(torch.int32)
            values, top = logits.topk(k, dim=-1, sorted=True)
            ids[a:a + step] = argmax_first(top, arg).to(torch.int32)
            logprobs[a:a + step] = (values.float() - torch.logsumexp(logits.float(), -1, keepdim=True)).half()
        return token, ids, logprobs

    def _check_logits_are_lm_heads(self, input_ids: torch.Tensor) -> None:
        """Refuse a target whose logits are not ``lm_head`` of its final hidden state (a scale, cap or temperature
        applied after it that :func:`logit_transform` does not know): the top-k stored would not be its
        distribution. One forward of the whole model over ``input_ids [1, t]`` (the first batch's first row, at most
        32 tokens), its logits against ``lm_head(last_hidden_state)``.

        Raises:
            ValueError: they differ by more than 2% of the logits' range (bf16 kernels of other shapes differ by
                well under 1%), naming the target class and the difference.
        """
        got = self.model(input_ids=input_ids, use_cache=False).logits[0].float()
        self.capture.clear()
        out = self.decoder(input_ids=input_ids, use_cache=False)
        self.capture.clear()
        ref = self.lm_head(out.last_hidden_state[0]).float()
        diff, scale = float((got - ref).abs().max()), float(ref.abs().max())
        if diff > 0.02 * max(scale, 1e-6):
            raise ValueError(f"extract.store_target_topk {self.target_topk}: {type(self.model).__name__}'s logits "
                             f"are not lm_head of its last hidden state (max difference {diff:.4g} against logits "
                             f"up to {scale:.4g}): it scales or caps them after lm_head, so lm_head's top-k would not "
                             "be its distribution; set extract.store_target_topk: 0 and train.labels: target")


def argmax_first(topk_ids: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """The top-k ids with the argmax in column 0: ``topk`` and ``argmax`` may each pick another of exactly tied
    logits (seen with bf16 logits on an H200), and the features promise ``target_topk_ids[:, 0] == target_token``.
    Where the argmax is elsewhere in a row it swaps places with column 0's token; where a row has more than k tokens
    tied at the maximum and the argmax is not among the k, it replaces column 0's (the log-probabilities, equal at
    a tie, are unchanged either way).

    Args:
        topk_ids: ``[N, k]`` integer, ``topk(k).indices`` of the logits.
        argmax: ``[N]`` integer, ``argmax(-1)`` of the same logits.

    Returns:
        ``[N, k]`` of ``topk_ids``' dtype, a new tensor; equal to ``topk_ids`` where column 0 already is the argmax.
    """
    argmax = argmax.to(topk_ids.dtype)[:, None]
    out = torch.where(topk_ids == argmax, topk_ids[:, :1], topk_ids)
    out[:, :1] = argmax
    return out
