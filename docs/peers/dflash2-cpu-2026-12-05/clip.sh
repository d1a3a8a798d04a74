#!/usr/bin/env bash
# d2-selgrad-kl-exp4-clip on the core d2-selgrad-kl-k32's training frees (driver.sh), trained and evaluated.
set -u
C=<work>; PY=<repo>/.venv/bin/python; v=d2-selgrad-kl-exp4-clip
CONFIGS="config.yaml docs/dflash2/dflash2.yaml docs/peers/topk256-features.yaml docs/peers/quality-cpu.yaml"
stamp() { echo "$(date +%s) $1" >> $C/times; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
until [ -f $C/d2-selgrad-kl-k32-train.rc ]; do sleep 10; done
cd <clone>; d=$C/$v; mkdir -p $d
tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks . | tar xf - -C $d
cp -al results resources $d/
cd $d && stamp "$v train start" && PYTHONPATH=$d DRAFTSMITH_GPU_LOCK_DIR=$d/.locks $PY -m snakemake \
    results/drafter/trained/trainer_state.json --cores 1 --rerun-triggers mtime --allowed-rules train \
    --configfile $CONFIGS docs/peers/recipe/$v.yaml > $C/$v-train.log 2>&1; echo $? > $C/$v-train.rc; stamp "$v train end"
stamp "$v evaluate start" && PYTHONPATH=$d DRAFTSMITH_GPU_LOCK_DIR=$d/.locks $PY -m snakemake \
    --cores 1 --rerun-triggers mtime --allowed-rules export evaluate all --configfile $CONFIGS \
    docs/peers/recipe/$v.yaml > $C/$v.log 2>&1; echo $? > $C/$v.rc; stamp "$v evaluate end"
