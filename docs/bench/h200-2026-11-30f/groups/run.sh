# norm-gradient group sweep + GPU norm tests (HEAD before GQA work)
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 200 python3 scripts/bench_tir.py hf_llama --match norm_grad --norm-blocks 132,264,528,1056,2112,100000 > $OUT/llama_norm_blocks.txt 2>&1
echo "llama sweep $(el)s"; tail -20 $OUT/llama_norm_blocks.txt
timeout 120 python3 scripts/bench_tir.py bert_large --match norm_grad --norm-blocks 264,528,1056,100000 > $OUT/bert_norm_blocks.txt 2>&1
echo "bert sweep $(el)s"; tail -12 $OUT/bert_norm_blocks.txt
timeout 200 python3 -m pytest -q -m gpu tests/test_fuse_layer_norm_backward.py tests/test_fuse_layer_norm.py -p no:cacheprovider > $OUT/gputests.log 2>&1
echo "gpu tests $(el)s"; tail -5 $OUT/gputests.log
