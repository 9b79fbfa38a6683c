[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
timeout -k 5 300 python3 .gpurun/dw_variants.py 280 > $OUT/dw_variants.log 2>&1; echo "variants rc $? $(el)s" >> $OUT/dw_variants.log
t() { local left=$((585 - $(el))); [ $left -gt 20 ] || return; timeout $left python3 -m pytest -v -m gpu "$@" -p no:cacheprovider >> $OUT/gpu_tests.log 2>&1; echo "== rc $? $(el)s" >> $OUT/gpu_tests.log; }
t tests/test_depthwise_conv_op.py -k on_gpu
t tests/test_column_reduction.py
cat $OUT/dw_variants.log | grep -v Warning | tail -40; grep -h "PASS\|FAIL\|rc \|Error" $OUT/gpu_tests.log | tail -30
