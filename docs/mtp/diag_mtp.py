"""Which part of test_mtp_decoding_with_cuda_graphs_is_lossless_on_the_gpu_kernels diverges on the H200 (issue 45).

On 2026-12-03 that test's MTP decoding on the static, graphed target differed from target-only decoding at token 25
of 40. This decodes each variant and prints where it first differs from the reference, and the reference's smallest
top-2 logit gaps (a near tie would explain a flip that a wrong state would not):

* the target with and without the random final norm the MTP test gives it;
* the static target tapping [1, 2] (as the passing DFlash test) and [1, 2, 3] (the last layer, as MTP needs);
* target-only and prompt lookup on that static target, prompt lookup on the dynamic one;
* MTP k = 1, 2, 3 on the static target with its drafting step graphed and eager, and on the dynamic target.

Run on the device after ``docs/mtp/run.sh setup .whl``: ``PYTHONPATH=/tmp/site:$PWD python3 docs/mtp/diag_mtp.py``.
"""

from __future__ import annotations

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
    dev, new = torch.device("cuda"), 40
    for random_norm in (False, True):
        base = tiny_target("qwen3_5", initializer_range=0.1, max_position_embeddings=256)
        tgt = (randomize_final_norm(base) if random_norm else base).to(dev)
        ids = te.prompt(1, length=150).to(dev)
        ref = te.target_generate(tgt, ids, max_new_tokens=new).tokens
        for taps in ([1, 2], [1, 2, 3]):
            static = StaticTarget(tgt, ids.shape[1] + new + te.BLOCK + 1, layer_ids=taps, cuda_graphs=True,
                                  verify_width=te.BLOCK)
            lookup = PromptLookupProposer(3, te.BLOCK - 1)
            rows = {
                "target-only static": te.target_generate(tgt, ids, max_new_tokens=new, static=static).tokens,
                "lookup static": speculative_generate(tgt, lookup, ids, max_new_tokens=new, static=static).tokens,
                "lookup dynamic": speculative_generate(tgt, lookup, ids, max_new_tokens=new).tokens,
            }
            for k in (1, 2, 3):
                for graphs in (True, False):
                    proposer = te._mtp_proposer(tgt, folder, k, device=dev if graphs else None)
                    rows[f"mtp k={k} static graphs={graphs}"] = speculative_generate(
                        tgt, proposer, ids, max_new_tokens=new, static=static).tokens
                proposer = te._mtp_proposer(tgt, folder, k)
                rows[f"mtp k={k} dynamic"] = speculative_generate(tgt, proposer, ids, max_new_tokens=new).tokens
            for name, tokens in rows.items():
                print(f"random norm {random_norm}, taps {taps}: {name}: first difference at "
                      f"{first_diff(tokens, ref)}", flush=True)
        full = torch.cat([ids[0], torch.tensor(ref, device=dev)])[None]
        with torch.no_grad():
            logits = tgt(full).logits[0, ids.shape[1] - 1:-1].float()
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        order = gaps.argsort()[:5].tolist()
        print(f"random norm {random_norm}: smallest top-2 logit gaps along the reference "
              f"{[round(gaps[i].item(), 5) for i in order]} at new tokens {order}", flush=True)


if __name__ == "__main__":
    main()
