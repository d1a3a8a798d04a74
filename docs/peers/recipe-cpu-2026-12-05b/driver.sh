#!/usr/bin/env bash
# CPU pre-check of soft labels for DFlash, draftsmith's default architecture: config.yaml's data (regenerated and
# tokenized by the README's command in <clone>, copied with their mtimes), features with the target's top 32, then
# muon-dpace (the defaults) and kl (the same with labels: target_topk) trained side by side on the 2 cores and
# evaluated side by side, then paired (as docs/peers/recipe-cpu-2026-12-04/driver.sh for DFlash2).
set -u
cd <clone>
export PYTHONPATH=<clone> HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=<repo>/.venv/bin/python
C=<work>; mkdir -p $C
CONFIGS="config.yaml docs/peers/topk-features.yaml"
VARIANTS="muon-dpace kl"
stamp() { echo "$(date +%s) $1" >> $C/times; }
stamp "start"
$PY -m snakemake results/features/index.json --cores 2 --rerun-triggers mtime --configfile $CONFIGS \
    docs/peers/recipe/muon-dpace.yaml > $C/base.log 2>&1; echo $? > $C/base.rc
[ "$(cat $C/base.rc)" = 0 ] || exit 1
stamp "data ready"
for v in $VARIANTS; do
  d=$C/$v; mkdir -p $d
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks \
      --exclude=./.venv . | tar xf - -C $d
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
$PY -m draftsmith.evaluate.compare $C/muon-dpace/results/eval/report.json $C/kl/results/eval/report.json \
    --names muon-dpace,kl --md $C/compare-kl.md --json $C/compare-kl.json > $C/compare.log 2>&1
stamp "all done"
