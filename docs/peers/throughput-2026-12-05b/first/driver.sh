set -u
cd "<repo>"
stamp() { echo "$(date +%s) $1" >> "<home>/peers/times"; }
for shape in qwen3.5-27b; do
  case $shape in
    qwen3.5-27b) cfg=config/gpu-node.yaml
      trainers=${PEERS_TRAINERS:-draftsmith,draftsmith-adamw,speculators,speculators-adamw,specforge} ;;
    smollm2-135m) cfg=config/gpu-proof.yaml
      trainers=${PEERS_TRAINERS:-draftsmith,speculators,specforge,draftsmith-dflash2,speculators-dflash2} ;;
    tiny) cfg=
      trainers=${PEERS_TRAINERS:-draftsmith,draftsmith-adamw,speculators,speculators-adamw,specforge,draftsmith-dflash2,speculators-dflash2} ;;
  esac
  stamp "$shape start"
  python3 bench/peers/throughput.py --shape $shape ${cfg:+--config $cfg} --out "<home>/peers/throughput"       --trainers $trainers --steps 30 --warmup 10 --workdir "/tmp/peers-tp-$shape"       > "<home>/peers/throughput-$shape.log" 2>&1
  echo $? > "<home>/peers/throughput-$shape.rc"
  rm -rf "/tmp/peers-tp-$shape"
  stamp "$shape end"
done
stamp "all done"
touch "<home>/peers/done"
