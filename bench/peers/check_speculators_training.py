"""Does draftsmith train the same objective as speculators 0.9.0 where their settings match? Both trainers' losses
and gradients on one packed row, from the same drafter weights, for the peer benchmark (issue 43: why speculators'
DFlash2 drafter is 1.063x draftsmith's on the same data).

Run with the speculators virtualenv's Python, the worktree on PYTHONPATH (for draftsmith and bench/peers); a CPU and
a speculators checkpoint trained on tiny features (docs/peers/README.md, "Commands that ran on the CPU") are enough:

    PYTHONPATH=$PWD /tmp/venv-speculators/bin/python bench/peers/check_speculators_training.py \
        --checkpoint /tmp/peers-tiny/spec-out/1 --target /tmp/peers-tiny/target --out /tmp/training-check.json

What is compared. speculators' side is its own ``model.forward`` (the function its trainer differentiates: anchored
blocks, attention mask, labels from the verifier's last pre-norm hidden state through ``verifier_norm`` and
``lm_head``, its eager losses, weights and reduction) with its anchor draw (``select_anchors``) replaced by fixed
anchors. draftsmith's is ``training_forward`` of the drafter converted from the same checkpoint
(``convert_speculators.py``), on a :class:`~draftsmith.modeling.PackedBatch` of the same row: the same features,
tokens, loss mask, documents, document-relative positions and anchors, ``target_token`` the verifier's argmax. The
row packs documents of a prompt (no loss) then an answer whose tokens are the verifier's greedy ones (regenerated
data), then padding; a case may make a share of answer tokens differ from the verifier's argmax.

The two reductions differ by design: speculators divides each term by the number of supervised slots, draftsmith by
the weights' sum under the fixed decay (docs/peers/README.md, difference 5). draftsmith's side is therefore compared
as ``weighted_ce / supervised slots`` (its numerator over speculators' denominator), so equal objectives give equal
losses and equal gradients. Each case prints the loss of both, the largest relative difference of a gradient (over
the trained tensors, ``|g_d - g_s|_max / |g_s|_max``) and the smallest cosine between the two gradients of a tensor;
``match`` is true when the gradients agree to ``--rtol``. A case whose settings differ on purpose (``expect: differ``)
shows what that difference does to the gradient; the exit status is 1 when a case expected to match does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (name, speculators loss_fn, per-position weights, selector alpha, draftsmith: selector stop-gradient, soft labels,
#:  share of answer tokens that are not the verifier's argmax, expected outcome)
CASES = [
    ("ce-exp4", "ce", "fixed-exp-decay", 1.0, False, False, 0.0, "match"),
    ("ce-dpace-unary", "ce", "dpace", 0.0, False, False, 0.0, "match"),
    ("kl-exp4", "kl_div", "fixed-exp-decay", 1.0, False, True, 0.0, "match"),
    ("ce-exp4-data-differs", "ce", "fixed-exp-decay", 1.0, False, False, 0.25, "differ"),
    ("ce-exp4-stopgrad", "ce", "fixed-exp-decay", 1.0, True, False, 0.0, "differ"),
    ("ce-dpace", "ce", "dpace", 1.0, False, False, 0.0, "differ"),
]
DFLASH_CASES = [c for c in CASES if c[3] == 0.0 or c[0] in ("ce-exp4", "kl-exp4")]


def load_speculators(checkpoint: Path):
    """speculators' drafter from its checkpoint (float32, SDPA, the verifier's embedding, head and norm loaded)."""
    from speculators.model import SpeculatorModel

    kind = json.loads((checkpoint / "config.json").read_text())["speculators_model_type"]
    __import__(f"speculators.models.{kind}")
    import speculators.models.dflash.core as core

    spec = SpeculatorModel.registry[kind].from_pretrained(str(checkpoint)).float()
    spec.config.transformer_layer_config._attn_implementation = "sdpa"
    spec._attn_impl, spec._create_mask_fn = "sdpa", core.create_mask  # as built with --draft-attn-impl sdpa
    for layer in spec.layers:
        layer.self_attn.config._attn_implementation = "sdpa"
    spec.load_verifier_weights()
    return kind, spec.train()


def packed_row(spec, n_taps: int, docs: list[tuple[int, int]], pad: int, differ: float, seed: int) -> dict:
    """One packed row: ``docs`` = (prompt tokens, answer tokens) per document, then ``pad`` padding positions.

    Returns the row's tensors (batch dimension 1): ``hidden_states [1, S, n_taps * H]``, ``verifier_last [1, S, H]``,
    ``input_ids``, ``loss_mask`` (int64), ``document_ids`` (-1 on padding), ``position_ids`` (document-relative) and
    ``target_token`` (the verifier's argmax of the next token at each position), all ``[1, S]``.
    """
    g = torch.Generator().manual_seed(seed)
    H, V = spec.config.transformer_layer_config.hidden_size, spec.lm_head.weight.shape[0]
    S = sum(p + a for p, a in docs) + pad
    hidden_states = torch.randn(1, S, n_taps * H, generator=g)
    verifier_last = torch.randn(1, S, H, generator=g) * 3
    with torch.no_grad():
        target_token = spec.verifier_lm_head(spec.verifier_norm(verifier_last)).argmax(-1)
    input_ids = torch.randint(0, V, (1, S), generator=g)
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    document_ids = torch.full((1, S), -1, dtype=torch.long)
    position_ids = torch.zeros(1, S, dtype=torch.long)
    start = 0
    for doc, (prompt, answer) in enumerate(docs):
        end = start + prompt + answer
        document_ids[0, start:end] = doc
        position_ids[0, start:end] = torch.arange(end - start)
        loss_mask[0, start + prompt:end] = 1
        answer_pos = torch.arange(start + prompt, end)
        greedy = torch.rand(answer_pos.numel(), generator=g) >= differ
        input_ids[0, answer_pos[greedy]] = target_token[0, answer_pos[greedy] - 1]
        start = end
    return dict(hidden_states=hidden_states, verifier_last=verifier_last, input_ids=input_ids, loss_mask=loss_mask,
                document_ids=document_ids, position_ids=position_ids, target_token=target_token)


def pick_anchors(row: dict, block_size: int, per_doc: int, padding: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors both trainers could draw: draftsmith's rule (:func:`draftsmith.modeling.sample_anchors`: the anchor
    and the next token supervised, one document) and speculators' (not in the row's last ``block_size`` positions),
    ``per_doc`` per document, sorted, then ``padding`` padding blocks (anchor 0, not valid): ``([A], [A] bool)``."""
    from draftsmith.modeling import sample_anchors

    picked = sample_anchors(row["loss_mask"][0], row["document_ids"][0], per_doc, torch.Generator().manual_seed(seed))
    picked = picked[picked < row["loss_mask"].shape[1] - block_size]
    anchors = torch.cat([picked, torch.zeros(padding, dtype=torch.long)])
    return anchors, torch.cat([torch.ones(picked.numel(), dtype=torch.bool), torch.zeros(padding, dtype=torch.bool)])


def speculators_step(spec, kind: str, row: dict, anchors, anchor_valid, loss_fn: str, weighting: str, alpha: float,
                     gamma: float) -> tuple[float, dict[str, torch.Tensor]]:
    """speculators' loss of the row and the gradient of every trained tensor (z-lab names)."""
    import speculators.models.dflash.core as core

    original = core.select_anchors
    core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors.clone(), anchor_valid.clone())
    try:
        options = dict(loss_fn=loss_fn, loss_implementation="eager", dflash_decay_gamma=gamma,
                       max_anchors=int(anchors.numel()), per_position_loss_weight=weighting, dpace_alpha=0.5,
                       selector_loss_alpha=alpha)
        train_kwargs, _ = type(spec).get_trainer_kwargs(**options)
        spec.zero_grad(set_to_none=True)
        _, loss, _ = spec(hidden_states=row["hidden_states"], input_ids=row["input_ids"], loss_mask=row["loss_mask"],
                          verifier_last_hidden_states=row["verifier_last"], document_ids=row["document_ids"],
                          position_ids=row["position_ids"], **train_kwargs)
        loss.backward()
    finally:
        core.select_anchors = original
    return float(loss), {n: p.grad.detach().clone() for n, p in spec.named_parameters()
                         if p.requires_grad and p.grad is not None}


def draftsmith_step(ours, spec, row: dict, anchors, anchor_valid, weighting: str, alpha: float, stop_gradient: bool,
                    soft: bool, gamma: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """draftsmith's ``weighted_ce / supervised slots`` of the row, the soft labels' entropy term of it (the constant
    by which a cross entropy against soft labels exceeds speculators' KL) and the gradients."""
    from draftsmith.modeling import PackedBatch

    topk_ids = topk_logprobs = None
    if soft:  # the target's whole distribution as "top-V" soft labels: draftsmith's KL up to the labels' entropy
        with torch.no_grad():
            logprobs = torch.log_softmax(spec.verifier_lm_head(spec.verifier_norm(row["verifier_last"])), -1)
        topk_logprobs, topk_ids = logprobs.sort(-1, descending=True)
    batch = PackedBatch(features=row["hidden_states"], input_ids=row["input_ids"], loss_mask=row["loss_mask"].bool(),
                        doc_ids=row["document_ids"], position_ids=row["position_ids"], anchors=anchors[None],
                        anchor_valid=anchor_valid[None], target_token=row["target_token"], target_topk_ids=topk_ids,
                        target_topk_logprobs=topk_logprobs)
    if hasattr(ours, "selector_stop_gradient"):
        ours.selector_stop_gradient = stop_gradient
        ours.selector_loss_weight = alpha
    ours.zero_grad(set_to_none=True)
    out = ours.training_forward(batch, spec.embed_tokens.weight.detach(), spec.lm_head.weight.detach(), gamma=gamma,
                                dpace_alpha=0.5 if weighting == "dpace" else None, use_target_tokens=True,
                                backend="sdpa")
    slots = out.count.sum().to(torch.float32)
    loss = out.weighted_ce / (slots + 1e-5)  # speculators' denominator (its _LOSS_REDUCTION_EPS included)
    loss.backward()
    entropy = 0.0
    if soft:
        from draftsmith.drafter_loss import slot_loss_weights
        from draftsmith.modeling import block_targets, supervised_slots, supervised_soft_labels

        with torch.no_grad():
            _, valid = block_targets(batch, ours.block_size, True)
            index, slot = supervised_slots(valid)
            _, probs = supervised_soft_labels(batch, ours.block_size, index)
            h = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
            w, _ = slot_loss_weights(h, slot, index, valid, gamma=gamma, dpace_alpha=None)
            entropy = float((h * w).sum() / (slots + 1e-5))
    return float(loss), entropy, {n: p.grad.detach().clone() for n, p in ours.named_parameters()
                                  if p.requires_grad and p.grad is not None}


def compare_gradients(ours: dict, theirs: dict) -> dict:
    """Largest relative difference and smallest cosine over the tensors both trained; the tensors only one has."""
    worst, worst_name, low_cos, low_name = 0.0, None, 1.0, None
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name].flatten().double(), theirs[name].flatten().double()
        scale = float(b.abs().max())
        rel = float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max())
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0)) if scale > 0 else 1.0
        if rel > worst:
            worst, worst_name = rel, name
        if cos < low_cos:
            low_cos, low_name = cos, name
    return {"max_rel_diff": worst, "max_rel_diff_tensor": worst_name, "min_cosine": low_cos,
            "min_cosine_tensor": low_name, "tensors": len(set(ours) & set(theirs)),
            "only_draftsmith": sorted(set(ours) - set(theirs)), "only_speculators": sorted(set(theirs) - set(ours))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path, help="a speculators DFlash or DFlash2 checkpoint")
    ap.add_argument("--target", required=True, type=Path, help="the target (verifier) folder it was trained for")
    ap.add_argument("--gamma", type=float, default=4.0, help="the fixed decay's gamma (speculators' default 4)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest relative gradient difference called a match")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = ap.parse_args(argv)

    from convert_speculators import convert

    from draftsmith.modeling_dflash2 import model_class_for

    kind, spec = load_speculators(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.checkpoint, args.target, Path(tmp) / "zlab", dtype="float32")
        cfg = json.loads((Path(tmp) / "zlab" / "config.json").read_text())
        ours = model_class_for(cfg["architectures"]).from_pretrained(Path(tmp) / "zlab", dtype=torch.float32).train()
    B, n_taps = int(ours.block_size), len(ours.target_layer_ids)
    results, failed = [], []
    for name, loss_fn, weighting, alpha, stop_gradient, soft, differ, expect in (
            CASES if kind == "dflash2" else DFLASH_CASES):
        row = packed_row(spec, n_taps, [(7, 23), (5, 31), (9, 12)], pad=6, differ=differ, seed=args.seed)
        anchors, anchor_valid = pick_anchors(row, B, per_doc=6, padding=2, seed=args.seed)
        theirs_loss, theirs = speculators_step(spec, kind, row, anchors, anchor_valid, loss_fn, weighting, alpha,
                                               args.gamma)
        ours_loss, entropy, mine = draftsmith_step(ours, spec, row, anchors, anchor_valid, weighting, alpha,
                                                   stop_gradient, soft, args.gamma)
        grads = compare_gradients(mine, theirs)
        match = grads["max_rel_diff"] <= args.rtol and not grads["only_draftsmith"] and not grads["only_speculators"]
        result = {"case": name, "kind": kind, "expect": expect, "match": match, "speculators_loss": theirs_loss,
                  "draftsmith_loss": ours_loss - entropy, "soft_label_entropy_term": entropy,
                  "anchors": int(anchor_valid.sum()), "padding_blocks": int((~anchor_valid).sum()), **grads}
        results.append(result)
        print(json.dumps(result))
        if (expect == "match") != match:
            failed.append(name)
    if args.out:
        args.out.write_text(json.dumps({"checkpoint": str(args.checkpoint), "kind": kind, "block_size": B,
                                        "gamma": args.gamma, "rtol": args.rtol, "cases": results,
                                        "unexpected": failed}, indent=1) + "\n")
    if failed:
        print(f"cases not as expected: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
