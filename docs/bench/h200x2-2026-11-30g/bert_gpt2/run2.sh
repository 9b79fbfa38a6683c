# #39 part 2 (same machine as j.sh): torch.compile max-autotune on both models, concurrently, one GPU and 16 cores each
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
test -d /tmp/b || { echo "machine went cold: /tmp/b missing"; exit 3; }
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 timeout $(( 580 - $(el) )) python3 scripts/bench.py --out /tmp/b/bert --profile --top 40 \
   --models hf_bert_large --systems compile_max_autotune --timeout 575 > /tmp/b/bert2.log 2>&1; echo "bert part 2 $(el)s" >> /tmp/b/times.txt) &
(CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout $(( 580 - $(el) )) python3 scripts/bench.py --out /tmp/b/gpt2 --profile --top 40 \
   --models hf_gpt2_medium --systems compile_max_autotune --timeout 575 > /tmp/b/gpt22.log 2>&1; echo "gpt2 part 2 $(el)s" >> /tmp/b/times.txt) &
wait
cp -r /tmp/b $OUT/
echo "total $(el)s"; cat /tmp/b/times.txt; grep -h "BertFor\|GPT2LM" /tmp/b/*/bench_e2e.md | head; tail -2 /tmp/b/bert2.log /tmp/b/gpt22.log
