[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 60 python3 .gpurun/mp.py > $OUT/maxpool.log 2>&1; echo "mp rc $? $(el)s" >> $OUT/maxpool.log
timeout 90 python3 -m pytest -q -m gpu tests/test_max_pool_op.py -p no:cacheprovider > $OUT/gpu_test.log 2>&1; echo "test rc $? $(el)s" >> $OUT/gpu_test.log
b() { # models systems timeout
  local left=$((570 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s1/cnn >> /tmp/s1/bench.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s1/bench.log; cp /tmp/s1/cnn/bench_e2e.* /tmp/s1/bench.log $OUT/
}
b tv_resnet50 tvm_evt 250
b tv_mobilenet_v2 tvm_evt 250
cat $OUT/maxpool.log; tail -3 $OUT/gpu_test.log
grep -h "ms/step\|FAILED\|rc \|Error" /tmp/s1/bench.log | tail -12
