[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s2
b() { # models systems timeout outdir
  local left=$((575 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s2/$4 >> /tmp/s2/bench_$4.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s2/bench_$4.log; mkdir -p $OUT/$4; cp /tmp/s2/$4/bench_e2e.* /tmp/s2/bench_$4.log $OUT/$4/
}
b timm_effnet_b0 eager,compile_cudagraphs 150 eff
b tv_mobilenet_v2 tvm_evt 330 mnv2
b tv_mobilenet_v2 eager,compile_cudagraphs 120 mnv2
grep -h "ms/step\|FAILED\|rc \|Error" /tmp/s2/bench_*.log | tail -12
