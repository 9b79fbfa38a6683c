[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
timeout 300 python3 -m pytest -q -x tests/test_split_matmul_reduction.py -m gpu -p no:cacheprovider > $OUT/split_gpu.log 2>&1
echo "split test rc $? $(el)s"; tail -5 $OUT/split_gpu.log
left=$(( 570 - $(el) ))
timeout $left python3 -m pytest -q -x "tests/test_gpu_library_models.py::test_library_cnn_bf16_step[tv_mobilenet_v3_small]" -p no:cacheprovider > $OUT/mnv3.log 2>&1
echo "mnv3 rc $? $(el)s"; tail -5 $OUT/mnv3.log
