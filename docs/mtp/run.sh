#!/usr/bin/env bash
# Issue 45 on one H200 with no package index (docs/mtp/README.md): the target's own MTP head beside DFlash and DFlash2.
#   WHEELS  a folder of the wheels the device lacks: fla-core 0.6.0 + flash-linear-attention 0.6.0 (the Gated DeltaNet
#           kernels; einops is on the image) and jsonschema 4.26.0 + jsonschema-specifications + referencing + rpds-py
#           (draftsmith.config imports jsonschema); ~2 MB, fetched with the pip lines in docs/mtp/README.md
# Usage (from the repository root):
#   docs/mtp/run.sh setup WHEELS    install them into /tmp/site (seconds)
#   docs/mtp/run.sh bench OUT       bench/bench_draft_step.py at the 27B hybrid shape, random bf16 weights: the 16-token
#                                   verify forward and the 2-4-token ones, a drafting step of DFlash, DFlash2 (selector
#                                   path eager and graphed) and the MTP head at k = 1, 2, 3, from one run (~4 min)
#   docs/mtp/run.sh checks OUT      the CUDA-only tests: MTP decoding with its graphed drafting step on fla's kernels,
#                                   and evaluate's existing GPU tests (~3 min; TESTS= narrows the -k selection; the
#                                   CPU tests of hybrid targets cannot run there: with fla installed transformers
#                                   calls its GPU kernels on CPU tensors)
#   docs/mtp/run.sh evaluate OUT    write a random 27B-shape hybrid target with an MTP head to /tmp (54 GB), then the
#                                   evaluate stage end to end on it (static cache + CUDA graphs; a random 5-layer DFlash
#                                   drafter; 2 MT-Bench questions x 2 turns x 128 new tokens; MTP at k = 1, 2, 3);
#                                   report.json / report.md / tau.png in OUT (~8 min)
#   docs/mtp/run.sh cpu OUT         the same three at tiny shapes on this CPU: a rehearsal of the scripts (~3 min)
# Every command writes its log and JSON to OUT. Python runs unbuffered, so a killed command leaves its output so far.
set -euo pipefail
cmd=${1:?setup, bench, checks, evaluate or cpu}
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
TARGET=${TARGET:-/tmp/random-qwen3.5-27b}

tokenizer() {  # tests/tiny.py's byte-level ChatML tokenizer (ids < 512, eos <|im_end|> = 2): no download needed
  PYTHONPATH=$PYTHONPATH:$PWD/tests "$PY" -c "from tiny import tiny_tokenizer; tiny_tokenizer().save_pretrained('$1')"
}

case "$cmd" in
setup)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$2"/*.whl
  "$PY" -c "import torch, transformers, fla, jsonschema; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'fla', fla.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
  ;;
bench)
  mkdir -p "$2"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$2/gpu.csv" 2>&1 || true
  "$PY" bench/bench_draft_step.py --preset qwen3.5-27b --drafter-layers 5 --layer-ids 1,16,31,46,61 \
      --prompt-tokens 1024 --steps 50 --json "$2/bench-draft-step-27b.json" 2>&1 \
      | grep -v '^\[transformers\]' | tee "$2/bench-draft-step-27b.txt"
  ;;
checks)
  mkdir -p "$2"
  set +e
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -v --durations=8 -p no:cacheprovider tests/test_evaluate.py \
      -k "${TESTS:-gpu_kernels or gpu_equals}" > "$2/pytest-cuda.log" 2>&1
  echo "pytest rc $?"
  set -e
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$2/pytest-cuda.log" | tail -24
  ;;
evaluate)
  mkdir -p "$2"
  t0=$(date +%s)
  if [ ! -f "$TARGET/model-mtp.safetensors" ]; then
    rm -rf "$TARGET" /tmp/tiny-tokenizer
    tokenizer /tmp/tiny-tokenizer
    "$PY" bench/make_random_target.py --shape qwen3.5-27b --tokenizer /tmp/tiny-tokenizer --out "$TARGET" --mtp \
        2>&1 | grep -v '^\[transformers\]' | tee "$2/make-target.txt"
  fi
  echo "target ready after $(( $(date +%s) - t0 )) s; disk: $(df -h /tmp | tail -1)" | tee -a "$2/make-target.txt"
  "$PY" bench/bench_evaluate_stage.py --target "$TARGET" --prompts "${PROMPTS:-2}" --new-tokens "${NEW_TOKENS:-128}" \
      --paths true --mtp-tokens 1,2,3 --drafter-layers 5 --out "$2" --json "$2/bench-evaluate-stage-mtp.json" \
      > "$2/evaluate.log" 2>&1 || { tail -40 "$2/evaluate.log"; exit 1; }
  grep -v '^\[transformers\]' "$2/evaluate.log" | grep -E "MTP|static_cache|lossless|peak|graph|CUDA" | tail -20
  # a device call returns at most 8 files: the report, its markdown and its plot travel as one tarball
  (cd "$2" && tar czf evaluate-report.tgz static-true-* && rm -f static-true-*)
  echo "evaluate done after $(( $(date +%s) - t0 )) s"
  ;;
cpu)  # the rehearsal here: tiny shapes, float32, eager (no GPU)
  mkdir -p "$2"
  "$PY" bench/bench_draft_step.py --preset tiny --steps 3 --json "$2/bench-draft-step-tiny.json" 2>&1 \
      | grep -v '^\[transformers\]' | tail -16
  "$PY" bench/bench_evaluate_stage.py --tiny --mtp --prompts 1 --new-tokens 16 --paths true --mtp-tokens 1,2,3 \
      --out "$2" --json "$2/bench-evaluate-stage-tiny.json" 2>&1 | grep -v '^\[transformers\]' | tail -4
  "$PY" -m pytest -q -p no:cacheprovider tests/test_evaluate.py -k mtp 2>&1 | tail -2
  ;;
*)
  echo "unknown command $cmd" >&2
  exit 2
  ;;
esac
