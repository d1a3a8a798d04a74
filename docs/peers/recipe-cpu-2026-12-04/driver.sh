#!/usr/bin/env bash
# CPU pre-check of the DFlash2 soft-label ablation: config.yaml's data (already regenerated and tokenized in
# <clone>), features with the target's top 32, then d2-selgrad and d2-selgrad-kl trained side by side on the 2
# cores and evaluated side by side (as docs/dflash2/compare.sh's driver, from the existing tokenized rows).
set -u
cd <clone>
export PYTHONPATH=<clone> HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=<repo>/.venv/bin/python
C=<work>; mkdir -p $C
CONFIGS="config.yaml docs/dflash2/dflash2.yaml docs/peers/topk-features.yaml"
stamp() { echo "$(date +%s) $1" >> $C/times; }
stamp "start"
$PY -m snakemake results/features/index.json --cores 2 --rerun-triggers mtime --configfile $CONFIGS \
    docs/peers/recipe/d2-selgrad.yaml > $C/base.log 2>&1; echo $? > $C/base.rc
[ "$(cat $C/base.rc)" = 0 ] || exit 1
stamp "data ready"
for v in d2-selgrad d2-selgrad-kl; do
  d=$C/$v; mkdir -p $d
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks . | tar xf - -C $d
  cp -al results resources $d/
done
for v in d2-selgrad d2-selgrad-kl; do
  (cd $C/$v && stamp "$v train start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      results/drafter/trained/trainer_state.json --cores 1 --rerun-triggers mtime --allowed-rules train \
      --configfile $CONFIGS docs/peers/recipe/$v.yaml > $C/$v-train.log 2>&1; echo $? > $C/$v-train.rc; stamp "$v train end") &
done
wait
for v in d2-selgrad d2-selgrad-kl; do
  (cd $C/$v && stamp "$v evaluate start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      --cores 1 --rerun-triggers mtime --allowed-rules export evaluate all --configfile $CONFIGS \
      docs/peers/recipe/$v.yaml > $C/$v.log 2>&1; echo $? > $C/$v.rc; stamp "$v evaluate end") &
done
wait
$PY -m draftsmith.evaluate.compare $C/d2-selgrad/results/eval/report.json $C/d2-selgrad-kl/results/eval/report.json \
    --names d2-selgrad,d2-selgrad-kl --md $C/compare-d2-selgrad-kl.md --json $C/compare-d2-selgrad-kl.json > $C/compare.log 2>&1
stamp "all done"
