[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
t() { local left=$((585 - $(el))); [ $left -gt 20 ] || return; timeout $left python3 -m pytest -v -m gpu "$@" -p no:cacheprovider >> $OUT/gpu_tests.log 2>&1; echo "== rc $? $(el)s" >> $OUT/gpu_tests.log; }
t tests/test_codegen_gpu_kinds.py -k "narrow or connectives"
SHAPES=1605632x96x16,1605632x32x16,401408x144x24,1605632x16x96,401408x96x24,401408x24x144
CFGS='coop_128x128x64_c1x1,coop_256x64x64_c1x1,coop_128x64x64_c1x1,*x32_c1x1,*x16x64_c1x1,*x32x64_c1x1,*x48x64_c1x1,*x96x64_c1x1'
left=$((390 - $(el)))
timeout -k 5 $left python3 scripts/bench_partitions.py tv_mobilenet_v2 --sweep full --only $SHAPES --configs "$CFGS" --out $OUT/sweep_narrow.json > $OUT/sweep_narrow.log 2>&1; echo "sweep rc $? $(el)s" >> $OUT/sweep_narrow.log
t tests/test_depthwise_conv_op.py -k on_gpu
grep -h "PASS\|FAIL\|rc \|Error" $OUT/gpu_tests.log | tail -20; tail -80 $OUT/sweep_narrow.log
