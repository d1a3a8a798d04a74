#!/usr/bin/env bash
# Stream mode on one H200 with no package index (docs/stream/README.md).
#   WHEELS   python wheels the machine lacks (snakemake and its interfaces, jsonschema, gguf, ..., and
#            flash-linear-attention + fla-core + einops for the Gated DeltaNet kernels)
#   TOK      a local folder with a tokenizer (tokenizer.json, tokenizer_config.json, chat template): SmolLM2's
#   CURATED  results/curated/{train,eval}.parquet + report.json of config/stream-x1.yaml, curated on a CPU machine
#            (snakemake results/curated/train.parquet --configfile config/gpu-node.yaml config/stream-x1.yaml
#            --config 'target={"model": "embedded:smollm2-135m-instruct"}')
# Usage (from the repository root):
#   docs/stream/run.sh setup WHEELS...      install the wheels into /tmp/site
#   docs/stream/run.sh bench-fp8 OUT        bench_train at gpu-node sizes and the 27B shape on one GPU: the same
#                                           documents with bf16 and with fp8 features (~7 min)
#   docs/stream/run.sh start TOK CURATED    write the random 27B-shape target to /dev/shm, then the stream DAG of
#                                           config/stream-x1.yaml over gpu-node.yaml in its own session, sampling the
#                                           bytes under results/ and the GPU every 2 s
#   docs/stream/run.sh wait SECONDS OUT     wait for it (at most SECONDS), then copy the logs, benchmarks, samples,
#                                           lease log, plan, phase markers and the report into OUT, and print
#                                           docs/node-x8/analyze.py's tables (phases, shards, memory, disk)
# GPUS (default 1) and CONFIG (default config/stream-x1.yaml) pick the node: GPUS=8 CONFIG=config/stream-x8.yaml
# for the eight-GPU sliced run of docs/node-x8/README.md (its CURATED: the same command with stream-x8.yaml).
set -euo pipefail
cmd=${1:?setup, bench-fp8, start or wait}
GPUS=${GPUS:-1} CONFIG=${CONFIG:-config/stream-x1.yaml}
NAME=$(basename "$CONFIG" .yaml)
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
RULES="disk_plan regenerate_shard regenerate tokenize stream_plan extract_heldout extract_slice merge_slice
train_phase train export evaluate all"

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
bench-fp8)
  mkdir -p "$2/fp8"
  timeout 560 python3 bench/bench_train.py --ddp 1 --storage bfloat16,float8_e4m3fn --shape qwen3.5-27b \
      --config config/gpu-node.yaml --ddp-epochs 0 --ddp-steps "${STEPS:-30}" --ddp-log-every 1 --ddp-tokens 120000 \
      --out "$2/fp8" > "$2/fp8/bench.log" 2>&1 || echo "bench rc $?"
  tail -6 "$2/fp8/bench.log"
  ;;
start)
  df -h /dev/shm . | tail -2
  t0=$(date +%s)
  python3 bench/make_random_target.py --shape qwen3.5-27b --tokenizer "$2" --out /dev/shm/random-qwen3.5-27b \
      > "$HOME/target.log" 2>&1
  echo "random target written in $(( $(date +%s) - t0 )) s"; du -sh /dev/shm/random-qwen3.5-27b
  rm -rf results logs benchmarks .snakemake "$HOME/dag.rc"
  mkdir -p results/curated && cp "$3"/* results/curated/
  date +%s > "$HOME/dag.start"
  # time, bytes under results/, under results/stream/ (the slices), free bytes on the disk
  setsid nohup bash -c 'while sleep 2; do echo "$(date +%s) $(du -sb results 2>/dev/null | cut -f1) $(du -sb \
results/stream 2>/dev/null | cut -f1) $(df -B1 --output=avail . | tail -1)"; done' \
      > "$HOME/disk-samples.txt" 2>&1 < /dev/null &
  setsid nohup nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 \
      > "$HOME/gpu-samples.csv" 2>&1 < /dev/null &
  # shellcheck disable=SC2086
  setsid nohup bash -c "python3 -m snakemake --cores all --resources gpu=$GPUS --scheduler greedy \
      --configfile config/gpu-node.yaml $CONFIG --allowed-rules $(echo $RULES) \
      > \"\$HOME/dag.log\" 2>&1; echo \$? > \"\$HOME/dag.rc\"" < /dev/null > /dev/null 2>&1 &
  echo "started at $(date)"
  ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while [ ! -f "$HOME/dag.rc" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  if [ -f "$HOME/dag.rc" ]; then echo "snakemake rc $(cat "$HOME/dag.rc") after $(( $(date +%s) - $(cat "$HOME/dag.start") )) s"
  else echo "still running after $(( $(date +%s) - $(cat "$HOME/dag.start") )) s"; fi
  cp "$HOME/disk-samples.txt" "$HOME/gpu-samples.csv" . 2>/dev/null || true
  python3 docs/node-x8/analyze.py . --json analysis.json > analysis.md 2>&1 || true
  tar czf "$3/$NAME.tgz" --ignore-failed-read logs benchmarks results/stream/plan.json results/stream/disk-plan.json \
      results/drafter/phases results/drafter/trained/trainer_state.json results/eval/report.json results/eval/report.md \
      analysis.json analysis.md disk-samples.txt gpu-samples.csv -C "$HOME" dag.log target.log 2>/dev/null || true
  grep -E "^\[|rule |Finished|Error|error" "$HOME/dag.log" | tail -25
  sed -n '/^## Extraction per slice/,$p' analysis.md
  ;;
esac
