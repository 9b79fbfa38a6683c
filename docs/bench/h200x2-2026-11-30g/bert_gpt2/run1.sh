# #39: BERT-Large (GPU 1) and GPT-2 medium (GPU 0) in one run each, eager / compile / tvm_evt (part 1; max-autotune in k.sh)
# Each model on its own GPU and its own 16 cores (taskset), concurrently; results kept in /tmp/b for part 2.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/b
nvidia-smi --query-gpu=index,name,clocks.max.sm,memory.total --format=csv > /tmp/b/gpu.txt
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 timeout $(( 545 - $(el) )) python3 scripts/bench.py --out /tmp/b/bert --profile --top 40 \
   --models hf_bert_large --systems eager,compile,tvm_evt --timeout 300 > /tmp/b/bert.log 2>&1; echo "bert part 1 $(el)s" >> /tmp/b/times.txt) &
(CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vectorized_elementwise.py -k rotary > /tmp/b/rotary.log 2>&1
 CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout $(( 545 - $(el) )) python3 scripts/bench.py --out /tmp/b/gpt2 --profile --top 40 \
   --models hf_gpt2_medium --systems eager,compile,tvm_evt --timeout 300 > /tmp/b/gpt2.log 2>&1; echo "gpt2 part 1 $(el)s" >> /tmp/b/times.txt) &
wait
cp -r /tmp/b $OUT/
echo "total $(el)s"; cat /tmp/b/times.txt; tail -3 /tmp/b/rotary.log; grep -h "BertFor\|GPT2LM" /tmp/b/*/bench_e2e.md | head; tail -2 /tmp/b/bert.log /tmp/b/gpt2.log
