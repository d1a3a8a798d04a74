"""Which forwards of a tiny Qwen3-Next (MoE hybrid) target StaticTarget can capture as CUDA graphs, per experts
kernel (transformers' grouped_mm, batched_mm, eager) and dtype; every failed capture's traceback is logged
(draftsmith.gpu.capture_graph logs it at DEBUG level to the stage logger).

    PYTHONPATH=/tmp/site:$PWD python3 docs/rehearsal-x2/x1-2026-12-01b/moe_capture.py      # on a GPU (moe.log)

(moe.log came from an earlier copy of this script that printed the tracebacks itself.)
"""
import logging
import sys

import torch

from draftsmith.evaluate.static import StaticTarget

sys.path.insert(0, "tests")
from tiny import tiny_target

logging.basicConfig(level=logging.WARNING)
logging.getLogger("draftsmith.evaluate").setLevel(logging.DEBUG)
for dtype in (torch.float32, torch.bfloat16):
    for impl in ("grouped_mm", "batched_mm", "eager"):
        tgt = tiny_target("qwen3_next").to("cuda", dtype)
        tgt.set_experts_implementation(impl)
        print("==", dtype, impl, tgt.config._experts_implementation, flush=True)
        st = StaticTarget(tgt, 64, layer_ids=[1, 2], cuda_graphs=True, verify_width=8)
        ids = torch.randint(0, 100, (1, 20), device="cuda")
        st.prefill(ids)
        st.forward_block(ids[:, -1:], 20, width=1)
        st.commit(1)
        st.forward_block(ids[:, :5], 21, width=8)
        st.commit(3)
        print("failures", st.graph_failures, "graphs", list(st._graphs), "replays", list(st._replays), flush=True)
