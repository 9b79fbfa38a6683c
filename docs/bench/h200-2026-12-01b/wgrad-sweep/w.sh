[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
python3 .gpurun/wgrad.py "$@" 2>&1 | grep -v Warning | tee $OUT/wgrad.log | tail -150
