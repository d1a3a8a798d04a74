"""The useful model FLOPs each trainer spends on the same rows, by draftsmith's count (:func:`draftsmith.flops.training_
flops`), for MFU in the peer benchmark.

The trainers differ in how many anchors (blocks) they train per row, so "FLOPs per step" would compare different
work. Here each trainer's **useful** work over one epoch of the rows is counted from its anchor rule (read from its
code, docs/peers/README.md), in expectation over its random anchor choice, with draftsmith's FLOP formula:
context tokens (every token of the rows), block tokens (anchors x B: the valid anchors only, no padding blocks),
head tokens (supervised slots: positions a + k, k = 1..B-1, inside the document, loss mask 1) and visible (query, key)
pairs of the z-lab mask (full layers: the context before the anchor and the whole block; sliding layers: the context
within ``W - 1 - k`` of slot k and the block up to the slot). Padding a trainer computes (speculators' unused anchor
slots, SpecForge's batch padding, draftsmith's anchor buckets) is not counted: MFU here is useful FLOPs / time.

Anchor rules (per epoch):

* draftsmith: per document ``min(num_anchors, V)`` with V = positions a with ``mask[a] and mask[a + 1]``; per packed
  row of ``tokens_per_batch`` tokens at most ``max_anchors_per_row`` (a uniform subset);
* speculators: per packed row of ``total_seq_len`` tokens ``min(max_anchors, S)`` with S = supervised positions
  (``mask[a]``; its ``select_anchors``);
* SpecForge: per sample ``min(num_anchors, V)``.

Packing is approximated by draftsmith's greedy packing (:func:`draftsmith.batch_plan.pack_rows`) of the rows in a
seeded random order for both packed trainers (speculators packs with LPT bins of the same capacity: rows as full).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class DocStats:
    """Per document: tokens, supervised tokens, and over its candidate anchors the mean supervised slots and mean
    visible pairs per layer kind."""

    tokens: int
    supervised: int
    pair_anchors: int           # V: positions a with mask[a] and mask[a+1]
    sup_anchors: int            # S: positions a with mask[a]
    slots_pair: float           # mean supervised slots of a V anchor
    slots_sup: float            # mean supervised slots of an S anchor
    pairs_pair: dict            # layer kind -> mean visible pairs of a V anchor's block
    pairs_sup: dict             # layer kind -> mean visible pairs of an S anchor's block


def block_pairs(a: np.ndarray, B: int, *, causal: bool, window: int | None) -> np.ndarray:
    """Visible (query, key) pairs of the blocks anchored at positions ``a`` (context = a tokens before it)."""
    a = a.astype(np.float64)
    total = np.zeros_like(a)
    for k in range(B):
        ctx = a if window is None else np.clip(np.minimum(a, window - 1 - k), 0, None)
        total += ctx + (k + 1 if causal else B)
    return total


def doc_stats(mask: np.ndarray, B: int, kinds: dict[str, tuple[bool, int | None]]) -> DocStats:
    """``kinds``: layer kind -> (causal inside the block, sliding window or None)."""
    m = np.asarray(mask).astype(bool)
    n = m.size
    pos = np.arange(n)
    pair = np.zeros(n, bool)
    pair[:-1] = m[:-1] & m[1:]
    # supervised slots of an anchor at a: k = 1..B-1 with a + k < n and mask[a + k]
    c = np.concatenate([[0], np.cumsum(m)])
    hi = np.minimum(pos + B, n)
    slots = c[hi] - c[np.minimum(pos + 1, n)]

    def mean(x, sel):
        return float(x[sel].mean()) if sel.any() else 0.0

    pairs = {kind: block_pairs(pos, B, causal=cz, window=w) for kind, (cz, w) in kinds.items()}
    return DocStats(tokens=n, supervised=int(m.sum()), pair_anchors=int(pair.sum()), sup_anchors=int(m.sum()),
                    slots_pair=mean(slots, pair), slots_sup=mean(slots, m),
                    pairs_pair={k: mean(v, pair) for k, v in pairs.items()},
                    pairs_sup={k: mean(v, m) for k, v in pairs.items()})


def layer_kinds(config) -> tuple[dict[str, tuple[bool, int | None]], list[str]]:
    """(kind -> (causal, window), one kind per drafter layer) from a z-lab drafter config (draftsmith's)."""
    from draftsmith.drafter_config import layer_is_causal

    kinds, per_layer = {}, []
    for i, t in enumerate(config.layer_types):
        window = int(config.sliding_window) if t == "sliding_attention" else None
        key = f"{'causal' if layer_is_causal(config, i) else 'bidir'}-{window}"
        kinds[key] = (layer_is_causal(config, i), window)
        per_layer.append(key)
    return kinds, per_layer


@dataclass
class EpochWork:
    ctx_tokens: float = 0.0
    supervised_tokens: float = 0.0
    blocks: float = 0.0
    head_tokens: float = 0.0
    pairs: float = 0.0        # summed over layers
    steps: float = 0.0

    def flops(self, config) -> dict:
        from draftsmith.flops import training_flops

        return training_flops(config, ctx_tokens=self.ctx_tokens, block_tokens=self.blocks * config.block_size,
                              head_tokens=self.head_tokens, attended_pairs=self.pairs)

    def as_dict(self, config) -> dict:
        f = self.flops(config)
        return {"ctx_tokens": self.ctx_tokens, "supervised_tokens": self.supervised_tokens, "blocks": self.blocks,
                "head_tokens": self.head_tokens, "attended_pairs": self.pairs, "steps": self.steps,
                "flops": f["total"], "flops_per_ctx_token": f["total"] / max(1.0, self.ctx_tokens),
                "blocks_per_step": self.blocks / max(1.0, self.steps),
                "ctx_tokens_per_step": self.ctx_tokens / max(1.0, self.steps)}


def _add(work: EpochWork, st: DocStats, anchors: float, per_layer: list[str], *, pair_rule: bool) -> None:
    work.blocks += anchors
    work.head_tokens += anchors * (st.slots_pair if pair_rule else st.slots_sup)
    pairs = st.pairs_pair if pair_rule else st.pairs_sup
    work.pairs += anchors * sum(pairs[k] for k in per_layer)


def epoch_work(masks: Sequence[np.ndarray], config, *, trainer: str, capacity: int | None = None,
               num_anchors: int = 512, row_cap: int | None = None, batch_size: int = 1, seed: int = 0) -> EpochWork:
    """Expected useful work of one epoch over the documents ``masks`` (loss masks) for ``trainer``
    (``draftsmith`` / ``speculators`` / ``specforge``), see the module docstring for the rules and arguments:
    ``capacity`` tokens per packed row (draftsmith ``tokens_per_batch``, speculators ``total_seq_len``),
    ``num_anchors`` (draftsmith and SpecForge per document, speculators per packed row), ``row_cap``
    (draftsmith's ``max_anchors_per_row``), ``batch_size`` (SpecForge samples per step)."""
    from draftsmith.batch_plan import pack_rows

    B = int(config.block_size)
    kinds, per_layer = layer_kinds(config)
    stats = [doc_stats(m, B, kinds) for m in masks]
    work = EpochWork()
    for st in stats:
        work.ctx_tokens += st.tokens
        work.supervised_tokens += st.supervised
    if trainer == "specforge":
        for st in stats:
            _add(work, st, min(num_anchors, st.pair_anchors), per_layer, pair_rule=True)
        work.steps = -(-len(stats) // batch_size)
        return work
    order = list(np.random.default_rng(seed).permutation(len(stats)))
    rows = pack_rows([st.tokens for st in stats], order, int(capacity))
    work.steps = len(rows)
    for row in rows:
        docs = [stats[i] for i, _ in row]
        if trainer == "draftsmith":
            want = [min(num_anchors, st.pair_anchors) for st in docs]
            scale = min(1.0, row_cap / sum(want)) if row_cap and sum(want) else 1.0
            for st, n in zip(docs, want):
                _add(work, st, n * scale, per_layer, pair_rule=True)
        elif trainer == "speculators":
            total = sum(st.sup_anchors for st in docs)
            scale = min(1.0, num_anchors / total) if total else 0.0
            for st in docs:
                _add(work, st, st.sup_anchors * scale, per_layer, pair_rule=False)
        else:
            raise ValueError(f"unknown trainer {trainer!r}")
    return work
