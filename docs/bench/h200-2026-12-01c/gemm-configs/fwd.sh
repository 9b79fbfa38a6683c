[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout -k 5 ${1:-480} python3 .gpurun/fwd.py > $OUT/fwd.log 2>&1; echo "rc $?" >> $OUT/fwd.log
grep -v "^\[tvm_evt\]\|Warning" $OUT/fwd.log | tail -250
