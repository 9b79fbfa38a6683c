[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
mkdir -p /tmp/s1
b() { # models systems timeout outdir
  local left=$((585 - $(el))); [ $left -gt 30 ] || { echo "skip $4"; return; }
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s1/$4 >> /tmp/s1/bench_$4.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s1/bench_$4.log; mkdir -p $OUT/$4; cp /tmp/s1/$4/bench_e2e.* /tmp/s1/bench_$4.log $OUT/$4/
}
b timm_effnet_b0 tvm_evt 465 effnet
b timm_effnet_b0 eager,compile_cudagraphs 90 effnet
grep -h "ms/step\|FAILED\|rc \|Error\|compiled in" /tmp/s1/bench_*.log | tail -14
