# #39 (same machine as j.sh, k.sh): Llama (GPU 0) and ViT-B/16 (GPU 1), eager / compile / max-autotune / tvm_evt in one run each
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/c
(CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout $(( 585 - $(el) )) python3 scripts/bench.py --out /tmp/c/llama --profile --top 45 \
   --models hf_llama --systems eager,tvm_evt,compile,compile_max_autotune --timeout 300 > /tmp/c/llama.log 2>&1; echo "llama $(el)s" >> /tmp/c/times.txt) &
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 timeout $(( 585 - $(el) )) python3 scripts/bench.py --out /tmp/c/vit --profile --top 40 \
   --models timm_vit_b16 --systems eager,tvm_evt,compile,compile_max_autotune --timeout 320 > /tmp/c/vit.log 2>&1; echo "vit $(el)s" >> /tmp/c/times.txt) &
wait
cp /tmp/c/times.txt /tmp/c/llama.log /tmp/c/vit.log $OUT/; mkdir -p $OUT/llama $OUT/vit; cp /tmp/c/llama/bench_e2e.json /tmp/c/llama/bench_e2e.md $OUT/llama/; cp /tmp/c/vit/bench_e2e.json /tmp/c/vit/bench_e2e.md $OUT/vit/
echo "total $(el)s"; cat /tmp/c/times.txt; grep -h "LlamaFor\|vit_base" /tmp/c/*/bench_e2e.md | head
