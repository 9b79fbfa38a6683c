[ -d /tmp/site/tvm_evt ] || { echo COLD; exit 3; }
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc
mkdir -p $OUT/eff_rs
TVM_EVT_ENABLE=recompute_sigmoid timeout -k 5 560 python3 scripts/bench.py --models timm_effnet_b0 --systems tvm_evt --profile --top 400 --timeout 540 --out /tmp/s3/eff_rs > $OUT/eff_rs/bench.log 2>&1
echo rc $?; cp /tmp/s3/eff_rs/bench_e2e.* $OUT/eff_rs/
grep -h "ms/step\|FAILED\|Error" $OUT/eff_rs/bench.log | tail -5
