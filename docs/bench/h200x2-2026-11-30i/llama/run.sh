T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/r3
( export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 timeout 300 python3 -m pytest -q -p no:cacheprovider "tests/test_gpu_library_models.py::test_folded_layer_norms_bf16_step[gpt2_lm]" > /tmp/r3/folded.log 2>&1; echo "folded rc $? at $(el)s" >> /tmp/r3/folded.log ) &
export CUDA_VISIBLE_DEVICES=0
taskset -c 0-15 timeout 200 python3 scripts/bench.py --out /tmp/r3/on --models hf_llama --systems tvm_evt --timeout 190 > /tmp/r3/on.log 2>&1; echo "on $(el)s"
TVM_EVT_DISABLE=norm_output taskset -c 0-15 timeout $((320 - $(el))) python3 scripts/bench.py --out /tmp/r3/off --models hf_llama --systems tvm_evt --timeout 150 > /tmp/r3/off.log 2>&1; echo "off $(el)s"
wait
grep -h "Llama" /tmp/r3/on/bench_e2e.md /tmp/r3/off/bench_e2e.md | head -4; tail -3 /tmp/r3/folded.log
cp /tmp/r3/on/bench_e2e.md $OUT/llama_on.md; cp /tmp/r3/off/bench_e2e.md $OUT/llama_off.md; cp /tmp/r3/folded.log $OUT/
