#!/usr/bin/env bash
# CPU-scale run of speculators' DFlash2 beside draftsmith's on the same features: config.yaml's data (regenerated,
# tokenized and extracted with the target's top 256 in <clone> first: `snakemake results/features/index.json --cores 2
# --configfile config.yaml docs/dflash2/dflash2.yaml docs/peers/topk256-features.yaml docs/peers/recipe/d2-selgrad-kl.yaml`),
# anchors as speculators draws them (docs/peers/quality-cpu.yaml), then d2-selgrad-kl-k32 and speculators-dflash2
# (its defaults; float32 on the CPU) trained at once on the 2 cores, each evaluated by draftsmith's evaluate, then
# paired (clip.sh ran d2-selgrad-kl-exp4-clip on the core d2-selgrad-kl-k32 freed). speculators is told draftsmith's
# drafter config (write_config.py: draftsmith.train.model.build_model_config) and step count (a throwaway draftsmith
# run stopped at its first checkpoint, train.save_every 1) through bench/peers/quality.py --base.
set -u
cd <clone>
export PYTHONPATH=<clone> HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=<repo>/.venv/bin/python
C=<work>; mkdir -p $C
CONFIGS="config.yaml docs/dflash2/dflash2.yaml docs/peers/topk256-features.yaml docs/peers/quality-cpu.yaml"
VARIANTS=${VARIANTS:-d2-selgrad-kl-k32}
stamp() { echo "$(date +%s) $1" >> $C/times; }
stamp "start"
$PY -m snakemake results/features/index.json --cores 2 --rerun-triggers mtime \
    --allowed-rules extract_plan extract_shard merge --configfile $CONFIGS docs/peers/recipe/d2-selgrad-kl.yaml \
    > $C/base.log 2>&1; echo $? > $C/base.rc
[ "$(cat $C/base.rc)" = 0 ] || exit 1
stamp "data ready"
$PY bench/topk_coverage.py results/features/index.json > $C/topk-coverage.txt 2>&1
for v in $VARIANTS spec; do
  d=$C/$v; mkdir -p $d
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks . | tar xf - -C $d
  cp -al results resources $d/
done
for v in $VARIANTS; do
  (cd $C/$v && stamp "$v train start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      results/drafter/trained/trainer_state.json --cores 1 --rerun-triggers mtime --allowed-rules train \
      --configfile $CONFIGS docs/peers/recipe/$v.yaml > $C/$v-train.log 2>&1; echo $? > $C/$v-train.rc; stamp "$v train end"
   stamp "$v evaluate start" && PYTHONPATH=$C/$v DRAFTSMITH_GPU_LOCK_DIR=$C/$v/.locks $PY -m snakemake \
      --cores 1 --rerun-triggers mtime --allowed-rules export evaluate all --configfile $CONFIGS \
      docs/peers/recipe/$v.yaml > $C/$v.log 2>&1; echo $? > $C/$v.rc; stamp "$v evaluate end") &
done
(
  # speculators is told draftsmith's drafter config and step count (bench/peers/quality.py --base): a throwaway
  # draftsmith run in its tree (train.save_every 1), stopped at its first checkpoint, gives both
  B=$C/spec-base; mkdir -p $B; printf 'train:\n  save_every: 1\n' > $C/save1.yaml
  cd $C/spec
  PYTHONPATH=$C/spec DRAFTSMITH_GPU_LOCK_DIR=$C/spec/.locks setsid $PY -m snakemake results/drafter/trained/trainer_state.json \
      --cores 1 --rerun-triggers mtime --allowed-rules train --configfile $CONFIGS docs/peers/recipe/d2-selgrad-kl-k32.yaml \
      $C/save1.yaml > $C/spec-probe.log 2>&1 & probe=$!
  until st=$(find results/drafter -name state.json -path '*step-*' 2>/dev/null | head -1) && [ -n "$st" ]; do sleep 5; done
  sleep 2; kill -- -$probe; wait $probe
  $PY $C/write_config.py $B $CONFIGS docs/peers/recipe/d2-selgrad-kl-k32.yaml > $C/write_config.log 2>&1
  $PY -c "import json, sys; s = json.load(open(sys.argv[1])); json.dump({'steps': s['total_steps']}, open(sys.argv[2], 'w'))" "$st" $B/trainer_state.json
  rm -rf results/drafter .snakemake/incomplete
  cp <clone>/results/features/index.json $B/features-index.json
  stamp "spec train start ($(cat $B/trainer_state.json))"
  export PYTHONPATH=$C/spec OMP_NUM_THREADS=1 SPECULATORS_PYTHON=<venv-speculators>/bin/python
  $PY bench/peers/quality.py train --peer speculators-dflash2 --config $CONFIGS --out results/peers --cpu --base $B \
      --timeout 14400 > $C/spec.log 2>&1; echo $? > $C/spec-train.rc; stamp "spec train end"
  $PY bench/peers/quality.py export --peer speculators-dflash2 --config $CONFIGS --out results/peers --base $B \
      >> $C/spec.log 2>&1 && stamp "spec evaluate start" && $PY bench/peers/quality.py evaluate --peer speculators-dflash2 \
      --config $CONFIGS --out results/peers --base $B >> $C/spec.log 2>&1; echo $? > $C/spec.rc; stamp "spec evaluate end"
) &
wait
R() { echo $C/$1/results/eval/report.json; }
S=$C/spec/results/peers/speculators-dflash2/eval/report.json
cmp() { $PY -m draftsmith.evaluate.compare $1 $2 --names $3 --md $C/compare-$4.md --json $C/compare-$4.json >> $C/compare.log 2>&1; }
cmp $(R d2-selgrad-kl-k32) $S d2-selgrad-kl-k32,speculators-dflash2 k32-spec
for v in $VARIANTS; do [ $v = d2-selgrad-kl-k32 ] || cmp $(R $v) $S $v,speculators-dflash2 $v-spec; done
stamp "all done"
