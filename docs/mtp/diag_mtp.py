"""Which part of test_mtp_decoding_with_cuda_graphs_is_lossless_on_the_gpu_kernels diverges on the H200 (issue 45).

On 2026-12-03 that test's MTP decoding on the static, graphed target differed from target-only decoding at token 25
of 40. This decodes each variant and prints where it first differs from the reference, and the reference's smallest
top-2 logit gaps (a near tie would explain a flip that a wrong state would not):

* the target with and without the random final norm the MTP test gives it;
* the static target tapping [1, 2] (as the passing DFlash test) and [1, 2, 3] (the last layer, as MTP needs: the
  MTP rows run on that one only);
* target-only on that static target (1-token forwards, and padded to the verify width: evaluate's lossless
  reference), prompt lookup on it and on the dynamic target;
* MTP k = 1, 2, 3 on the static target with its drafting step graphed and eager, and on the dynamic target.

Each row prints as soon as it is decoded, with the reference's top-2 logit gap at its first difference.

Run on the device after ``docs/mtp/run.sh setup .whl``: ``PYTHONPATH=/tmp/site:$PWD python3 docs/mtp/diag_mtp.py``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = ["tests", "."]

import test_evaluate as te  # noqa: E402
from draftsmith.evaluate.decode import PromptLookupProposer, speculative_generate  # noqa: E402
from draftsmith.evaluate.static import StaticTarget  # noqa: E402
from tiny import randomize_final_norm, tiny_target  # noqa: E402


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Folders:
    """pytest's tmp_path_factory, for te.mtp_target."""

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name))


def main() -> None:
    _, folder, _ = te.mtp_target("qwen3_5", Folders())
    dev, new = torch.device(os.environ.get("DIAG_DEVICE", "cuda")), 40  # DIAG_DEVICE=cpu: a rehearsal, no graphs
    graphed = dev.type == "cuda"
    for random_norm in (False, True):
        base = tiny_target("qwen3_5", initializer_range=0.1, max_position_embeddings=256)
        tgt = (randomize_final_norm(base) if random_norm else base).to(dev)
        ids = te.prompt(1, length=150).to(dev)
        ref = te.target_generate(tgt, ids, max_new_tokens=new).tokens
        full = torch.cat([ids[0], torch.tensor(ref, device=dev)])[None]
        with torch.no_grad():
            logits = tgt(full).logits[0, ids.shape[1] - 1:-1].float()
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        order = gaps.argsort()[:5].tolist()
        print(f"random norm {random_norm}: logit scale {logits.abs().max().item():.4f}; smallest top-2 logit gaps "
              f"along the dynamic reference {[round(gaps[i].item(), 6) for i in order]} at new tokens {order}",
              flush=True)

        def show(taps, name, tokens):
            at = first_diff(tokens, ref)
            gap = f", reference top-2 gap there {gaps[at].item():.6f}" if at is not None and at < len(gaps) else ""
            print(f"random norm {random_norm}, taps {taps}: {name}: first difference at {at}{gap}", flush=True)

        for taps in ([1, 2], [1, 2, 3]):
            static = StaticTarget(tgt, ids.shape[1] + new + te.BLOCK + 1, layer_ids=taps, cuda_graphs=graphed,
                                  verify_width=te.BLOCK)
            lookup = PromptLookupProposer(3, te.BLOCK - 1)
            show(taps, "target-only static", te.target_generate(tgt, ids, max_new_tokens=new, static=static).tokens)
            wide = te.target_generate(tgt, ids, max_new_tokens=new, static=static, width=None).tokens
            show(taps, "target-only static at the verify width", wide)
            show(taps, "lookup static",
                 speculative_generate(tgt, lookup, ids, max_new_tokens=new, static=static).tokens)
            show(taps, "lookup dynamic", speculative_generate(tgt, lookup, ids, max_new_tokens=new).tokens)
            if 3 not in taps:  # the MTP head reads the last layer's post-norm state: the static target must tap it
                continue
            for k in (1, 2, 3):
                for graphs in (True, False) if graphed else (False,):
                    proposer = te._mtp_proposer(tgt, folder, k, device=dev if graphs else None)
                    out = speculative_generate(tgt, proposer, ids, max_new_tokens=new, static=static).tokens
                    show(taps, f"mtp k={k} static graphs={graphs}", out)
                    print(f"    ... against the verify-width reference: first difference at {first_diff(out, wide)}",
                          flush=True)
                proposer = te._mtp_proposer(tgt, folder, k)
                show(taps, f"mtp k={k} dynamic",
                     speculative_generate(tgt, proposer, ids, max_new_tokens=new).tokens)


if __name__ == "__main__":
    main()
