#!/usr/bin/env bash
# The recipe ablation of the peer comparison (docs/peers/README.md, "Why speculators' drafter is better"): on the
# quality run's data (config/gpu-proof.yaml with docs/peers/quality.yaml: 3 epochs, 1,341 steps) draftsmith trains
# three drafters side by side on one GPU, the same features and steps: D-PACE slot weights, Muon, and both
# (speculators 0.9.0's DFlash defaults), overlays in docs/peers/recipe/. All are evaluated at once
# (COMPARE_EVAL=parallel: the same τ, but tokens/s are no speed figures); muon and muon-dpace are paired by prompt
# with dpace. The control, draftsmith's own recipe (adamw-exp), is left out by default to fit one session: its
# earlier runs on these data decoded held-out τ 1.917 to 1.979 (three sessions), and its report is committed
# (docs/peers/quality-2026-12-03d/draftsmith/report.json) to pair with; RECIPE_VARIANTS="adamw-exp dpace muon
# muon-dpace" trains it too (four trainings share the GPU: ~3 more minutes). A thin wrapper of
# docs/dflash2/compare.sh; after docs/stream/run.sh setup.
# Usage (from the repository root):
#   docs/peers/recipe.sh start STASH CURATED    as docs/dflash2/compare.sh start
#   docs/peers/recipe.sh wait SECONDS OUT       ... wait; OUT/recipe.tgz holds compare-<variant>.{md,json}
set -euo pipefail
export COMPARE_NAME=recipe COMPARE_OVERLAYS=docs/peers/recipe COMPARE_EVAL=${COMPARE_EVAL:-parallel}
export COMPARE_VARIANTS=${RECIPE_VARIANTS:-dpace muon muon-dpace}
export COMPARE_CONFIGS=${COMPARE_CONFIGS:-config/gpu-proof.yaml docs/peers/quality.yaml}
exec "$(dirname "$0")/../dflash2/compare.sh" "$@"
