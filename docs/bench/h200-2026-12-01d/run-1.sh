[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout 100 python3 -m pytest -q -m gpu tests/test_max_pool_op.py -p no:cacheprovider > $OUT/gpu_test_maxpool.log 2>&1; echo "test rc $? $(el)s" >> $OUT/gpu_test_maxpool.log
b() { # models systems timeout outdir
  local left=$((575 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s1/$4 >> /tmp/s1/bench_$4.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s1/bench_$4.log; mkdir -p $OUT/$4; cp /tmp/s1/$4/bench_e2e.* /tmp/s1/bench_$4.log $OUT/$4/
}
b timm_effnet_b0 tvm_evt 380 eff
TVM_EVT_ENABLE=recompute_sigmoid b timm_effnet_b0 tvm_evt 300 eff_rs
tail -3 $OUT/gpu_test_maxpool.log
grep -h "ms/step\|FAILED\|rc \|Error" /tmp/s1/bench_*.log | tail -12
