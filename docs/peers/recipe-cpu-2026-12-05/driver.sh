#!/usr/bin/env bash
# CPU pre-check of the soft labels' width: config.yaml's data (regenerated and tokenized in <data clone>, copied with
# their mtimes), features with the target's top 256, then d2-selgrad-kl-k32 (the first 32) and d2-selgrad-kl (all
# 256) trained side by side on the 2 cores and evaluated side by side (docs/peers/recipe-cpu-2026-12-04/driver.sh's
# procedure), then paired.
set -u
cd <clone>
export PYTHONPATH=<clone> HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=<repo>/.venv/bin/python
C=<work>; mkdir -p $C
CONFIGS="config.yaml docs/dflash2/dflash2.yaml docs/peers/topk256-features.yaml"
VARIANTS="d2-selgrad-kl-k32 d2-selgrad-kl"
stamp() { echo "$(date +%s) $1" >> $C/times; }
stamp "start"
$PY -m snakemake results/features/index.json --cores 2 --rerun-triggers mtime \
    --allowed-rules extract_plan extract_shard merge --configfile $CONFIGS docs/peers/recipe/d2-selgrad-kl.yaml \
    > $C/base.log 2>&1; echo $? > $C/base.rc
[ "$(cat $C/base.rc)" = 0 ] || exit 1
stamp "data ready"
$PY bench/topk_coverage.py results/features/index.json > $C/topk-coverage.txt 2>&1
for v in $VARIANTS; do
  d=$C/$v; mkdir -p $d
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks . | tar xf - -C $d
  cp -al results resources $d/
done
for v in $VARIANTS; do
  (cd $C/$v && stamp "$v train start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      results/drafter/trained/trainer_state.json --cores 1 --rerun-triggers mtime --allowed-rules train \
      --configfile $CONFIGS docs/peers/recipe/$v.yaml > $C/$v-train.log 2>&1; echo $? > $C/$v-train.rc; stamp "$v train end") &
done
wait
for v in $VARIANTS; do
  (cd $C/$v && stamp "$v evaluate start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      --cores 1 --rerun-triggers mtime --allowed-rules export evaluate all --configfile $CONFIGS \
      docs/peers/recipe/$v.yaml > $C/$v.log 2>&1; echo $? > $C/$v.rc; stamp "$v evaluate end") &
done
wait
$PY -m draftsmith.evaluate.compare $C/d2-selgrad-kl-k32/results/eval/report.json $C/d2-selgrad-kl/results/eval/report.json \
    --names top-32,top-256 --md $C/compare-k32-k256.md --json $C/compare-k32-k256.json > $C/compare.log 2>&1
stamp "all done"
