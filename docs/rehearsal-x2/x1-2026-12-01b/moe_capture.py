"""Which forwards of a tiny Qwen3-Next (MoE hybrid) target StaticTarget can capture as CUDA graphs, per experts
kernel (transformers' grouped_mm, batched_mm, eager) and dtype; prints the traceback of each failed capture.

    PYTHONPATH=/tmp/site:$PWD python3 docs/rehearsal-x2/x1-2026-12-01b/moe_capture.py      # on a GPU (moe.log)
"""
import sys
import traceback

import torch

import draftsmith.evaluate.static as static_mod
from draftsmith.evaluate.static import StaticTarget

sys.path.insert(0, "tests")
from tiny import tiny_target  # noqa: E402


def capture_or_print(device, run, failures, key, what, reset=lambda: None):
    """evaluate.static.capture_graph without the exception handling, so the failure's traceback is printed."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                reset()
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        reset()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out
    except Exception as exc:  # noqa: BLE001 - printed, then the path runs eagerly as in the product
        failures[key] = repr(exc)
        print("FAIL", what, "\n  " + "\n  ".join(traceback.format_exc().splitlines()[-14:]), flush=True)
        torch.cuda.synchronize(device)
        reset()
        return None


static_mod.capture_graph = capture_or_print
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
