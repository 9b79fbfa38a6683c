[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/t
timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_library_models.py tests/test_codegen_gpu_kinds.py tests/test_depthwise_conv_op.py -k "tv_mobilenet_v2 or connectives or on_gpu" -p no:cacheprovider > $OUT/t/gpu_tests.log 2>&1; echo "tests rc $? $(el)s" >> $OUT/t/gpu_tests.log
left=$((585 - $(el)))
timeout -k 5 $left python3 scripts/bench_partitions.py tv_mobilenet_v2 --sweep heuristic --out $OUT/t/parts_mnv2.json > $OUT/t/parts_mnv2.log 2>&1; echo "parts rc $? $(el)s" >> $OUT/t/parts_mnv2.log
tail -4 $OUT/t/gpu_tests.log; tail -30 $OUT/t/parts_mnv2.log
