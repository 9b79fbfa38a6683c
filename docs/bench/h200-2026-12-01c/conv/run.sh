[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout -k 5 ${1:-500} python3 scripts/bench_conv.py --out $OUT/conv > $OUT/bench_conv.log 2>&1
echo "rc $?" >> $OUT/bench_conv.log
grep -v "^build " $OUT/bench_conv.log | tail -150; grep "^build" $OUT/bench_conv.log | tail -3
