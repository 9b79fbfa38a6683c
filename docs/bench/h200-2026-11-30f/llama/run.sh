# Llama with grouped-query flash kernels and the norm groups by residency, against torch.compile default and max-autotune in one run
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout $(( 585 - $(el) )) python3 scripts/bench.py --out $OUT/llama --profile --top 45 --models hf_llama --systems tvm_evt,compile,compile_max_autotune --timeout 290 > $OUT/llama.log 2>&1
echo "llama done $(el)s"; grep "LlamaFor" $OUT/llama/bench_e2e.md | head -3; grep "GPU busy" $OUT/llama/bench_e2e.md; tail -3 $OUT/llama.log
