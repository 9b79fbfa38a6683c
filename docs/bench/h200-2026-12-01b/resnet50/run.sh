[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
b() { # models systems timeout
  local left=$((580 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s1/cnn >> /tmp/s1/bench.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s1/bench.log; cp /tmp/s1/cnn/bench_e2e.* /tmp/s1/bench.log $OUT/
}
b tv_resnet50 tvm_evt 340
b tv_resnet50 eager,compile_cudagraphs 200
grep -h "ms/step\|FAILED\|rc \|Error" /tmp/s1/bench.log | tail -12
