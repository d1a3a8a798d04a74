set -u
cd "<repo>"
stamp() { echo "$(date +%s) $1" >> "<peers-home>/times"; }
sm() { python3 -m snakemake "$@" --cores all --resources gpu=1 --scheduler greedy --allowed-rules fetch_target materialize_target disk_plan regenerate_shard regenerate tokenize extract_plan extract_shard merge train export evaluate all --configfile config/gpu-proof.yaml docs/peers/quality.yaml; }
stamp "draftsmith start"
sm results/drafter/final/config.json > "<peers-home>/draftsmith.log" 2>&1
echo $? > "<peers-home>/draftsmith.rc"
[ "$(cat "<peers-home>/draftsmith.rc")" = 0 ] || { touch "<peers-home>/done"; exit 1; }
stamp "draftsmith trained"
evaluate_draftsmith() { sm > "<peers-home>/draftsmith-evaluate.log" 2>&1; echo $? > "<peers-home>/draftsmith-evaluate.rc";
  stamp "draftsmith evaluated"; }
if [ "1" = 1 ]; then evaluate_draftsmith & EVAL=$!; else evaluate_draftsmith; EVAL=; fi
for peer in speculators; do
  stamp "$peer start"
  python3 bench/peers/quality.py train --peer $peer --config config/gpu-proof.yaml docs/peers/quality.yaml --out results/peers  > "<peers-home>/$peer.log" 2>&1
  rc=$?; stamp "$peer trained ($rc)"
  [ -n "$EVAL" ] && wait $EVAL
  if [ $rc = 0 ]; then
    python3 bench/peers/quality.py export --peer $peer --config config/gpu-proof.yaml docs/peers/quality.yaml --out results/peers >> "<peers-home>/$peer.log" 2>&1; rc=$?
  fi
  evaluate_peer() { [ $1 = 0 ] && python3 bench/peers/quality.py evaluate --peer $2 --config config/gpu-proof.yaml docs/peers/quality.yaml --out results/peers       >> "<peers-home>/$2.log" 2>&1; echo $? > "<peers-home>/$2.rc"; stamp "$2 evaluated"; }
  if [ "1" = 1 ]; then evaluate_peer $rc $peer & EVAL=$!; else evaluate_peer $rc $peer; fi
done
[ -n "$EVAL" ] && wait $EVAL
wait
python3 bench/peers/quality.py compare --config config/gpu-proof.yaml docs/peers/quality.yaml --out results/peers > "<peers-home>/compare.log" 2>&1
stamp "all done"
touch "<peers-home>/done"
