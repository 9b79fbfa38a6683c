# norm kernels: GPU tests, Llama vs torch.compile, zoo blocks
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 150 python3 -m pytest -q -m gpu tests/test_fuse_layer_norm.py tests/test_fuse_layer_norm_backward.py -p no:cacheprovider > $OUT/gputests.log 2>&1
echo "gpu tests $(el)s"; tail -3 $OUT/gputests.log
timeout 270 python3 scripts/bench.py --out $OUT/llama --profile --top 45 --models hf_llama --systems tvm_evt,compile --timeout 240 > $OUT/llama.log 2>&1
echo "llama done $(el)s"; grep "LlamaFor" $OUT/llama/bench_e2e.md | head -2; grep "GPU busy" $OUT/llama/bench_e2e.md
left=$(( 575 - $(el) ))
timeout $left python3 scripts/bench.py --out $OUT/zoo --profile --models bert_large,gpt2_medium,vit_b16 --systems tvm_evt --timeout $(( left - 10 )) > $OUT/zoo.log 2>&1
echo "zoo done $(el)s"; grep "tvm_evt" $OUT/zoo/bench_e2e.md | head -4
