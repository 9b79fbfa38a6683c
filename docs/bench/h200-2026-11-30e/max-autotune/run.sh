# the partials' GPU test; Llama against torch.compile default and max-autotune in one run
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 60 python3 -m pytest -q -m gpu tests/test_fuse_layer_norm_backward.py -p no:cacheprovider > $OUT/gputests.log 2>&1
echo "gpu tests $(el)s"; tail -2 $OUT/gputests.log
timeout $(( 585 - $(el) )) python3 scripts/bench.py --out $OUT/llama --models hf_llama --systems tvm_evt,compile,compile_max_autotune --timeout 290 > $OUT/llama.log 2>&1
echo "llama done $(el)s"; grep "LlamaFor" $OUT/llama/bench_e2e.md | head -3; tail -5 $OUT/llama.log
