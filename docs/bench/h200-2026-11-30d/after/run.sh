# Llama after ColumnReduction's short rule + rms_norm default + weight copies; then copies off; then GPU tests
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 260 python3 scripts/bench.py --out $OUT/default --profile --memory --models hf_llama --systems tvm_evt,compile --timeout 200 > $OUT/default.log 2>&1
echo "default done $(el)s"; grep "hf_llama\|LlamaFor" $OUT/default/bench_e2e.md | head -3
timeout 60 python3 -m pytest -q tests/test_optimizer_update.py tests/test_column_reduction.py -k "gpu and (copies or match_llvm)" -p no:cacheprovider > $OUT/gputests.log 2>&1
echo "gpu tests $(el)s"; tail -3 $OUT/gputests.log
left=$(( 430 - $(el) ))
if [ $left -gt 100 ]; then
TVM_EVT_DISABLE=weight_copies timeout $left python3 scripts/bench.py --out $OUT/nocopies --profile --models hf_llama --systems tvm_evt --timeout $(( left - 10 )) > $OUT/nocopies.log 2>&1
echo "nocopies done $(el)s"; grep "LlamaFor" $OUT/nocopies/bench_e2e.md | head -2
fi
