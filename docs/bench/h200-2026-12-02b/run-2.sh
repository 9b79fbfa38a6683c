[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
t() { local left=$((585 - $(el))); [ $left -gt 20 ] || return; timeout $left python3 -m pytest -v -m gpu "$@" -p no:cacheprovider >> $OUT/gpu_tests.log 2>&1; echo "== rc $? $(el)s" >> $OUT/gpu_tests.log; }
t tests/test_column_reduction.py
t tests/test_depthwise_conv_op.py -k on_gpu
export VARIANTS="depthwise_conv_op.COLUMN_PARTIALS=None" SHAPES="[(112,32,3,1),(112,96,3,2),(56,144,3,1),(28,192,3,1),(14,576,3,1),(7,960,3,1),(28,240,5,1),(56,144,5,2)]"
left=$((585 - $(el)))
timeout -k 5 $left python3 .gpurun/dw_variants.py $((left - 15)) > $OUT/dw_variants.log 2>&1; echo "variants rc $? $(el)s" >> $OUT/dw_variants.log
grep -h "PASS\|FAIL\|rc \|Error" $OUT/gpu_tests.log | tail -30
python3 -c "
import json;r=json.load(open('$OUT/depthwise_times.json'))
for x in r: print(x['h'],x['c'],x['r'],x['stride'],x['fprop_ms'],x['dgrad_ms'],x['wgrad_ms'],x['tvm_evt_ms'],x['torch_forward_ms'],x['torch_backward_ms'],x['speedup'])"
cat $OUT/dw_variants.log | grep -v Warning | tail -40
