# untimed changes (stem im2col gather, CE gradient lanes, dropout lanes): Llama and ResNet-50, tvm_evt and torch.compile in one run
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 290 python3 scripts/bench.py --out $OUT/llama --profile --top 45 --memory --models hf_llama --systems tvm_evt,compile --timeout 240 > $OUT/llama.log 2>&1
echo "llama done $(el)s"; grep "LlamaFor" $OUT/llama/bench_e2e.md | head -3
left=$(( 560 - $(el) ))
timeout $left python3 scripts/bench.py --out $OUT/resnet --profile --top 45 --models tv_resnet50 --systems tvm_evt,compile --timeout $(( left - 15 )) > $OUT/resnet.log 2>&1
echo "resnet done $(el)s"; grep "resnet" $OUT/resnet/bench_e2e.md | head -3
