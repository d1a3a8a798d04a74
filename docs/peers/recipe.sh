#!/usr/bin/env bash
# The recipe ablation of the peer comparison (docs/peers/README.md, "Why speculators' drafter is better"): on the
# quality run's data (config/gpu-proof.yaml with docs/peers/quality.yaml: 3 epochs, 1,341 steps) draftsmith trains
# four drafters side by side on one GPU, the same features and steps: its own recipe (adamw-exp, the control), D-PACE
# slot weights, Muon, and both (speculators 0.9.0's DFlash defaults), overlays in docs/peers/recipe/. All four are
# evaluated at once (COMPARE_EVAL=parallel: the same τ, but tokens/s are no speed figures) and each variant's report
# is paired by prompt with the control's. A thin wrapper of docs/dflash2/compare.sh; after docs/stream/run.sh setup.
# Usage (from the repository root):
#   docs/peers/recipe.sh start STASH CURATED    as docs/dflash2/compare.sh start
#   docs/peers/recipe.sh wait SECONDS OUT       ... wait; OUT/recipe.tgz holds compare-<variant>.{md,json}
set -euo pipefail
export COMPARE_NAME=recipe COMPARE_OVERLAYS=docs/peers/recipe COMPARE_EVAL=${COMPARE_EVAL:-parallel}
export COMPARE_VARIANTS=${RECIPE_VARIANTS:-adamw-exp dpace muon muon-dpace}
export COMPARE_CONFIGS=${COMPARE_CONFIGS:-config/gpu-proof.yaml docs/peers/quality.yaml}
exec "$(dirname "$0")/../dflash2/compare.sh" "$@"
