[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
t() { local left=$((585 - $(el))); [ $left -gt 20 ] || return; timeout $left python3 -m pytest -v -m gpu "$@" -p no:cacheprovider >> $OUT/gpu_tests.log 2>&1; echo "== rc $? $(el)s" >> $OUT/gpu_tests.log; }
t tests/test_gpu_library_models.py -k tv_mobilenet_v2
t tests/test_depthwise_conv_op.py -k on_gpu
t tests/test_codegen_gpu_kinds.py -k connectives
grep -h "PASS\|FAIL\|rc \|Error" $OUT/gpu_tests.log | tail -20
