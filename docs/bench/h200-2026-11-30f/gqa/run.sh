# grouped-query flash kernels: GPU tests, kernel bench; BERT norm-gradient groups by resident threads
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 6"; echo "xdist: $N"
timeout 200 python3 -m pytest -q -m gpu $N tests/test_gpu_flash_attention.py -k "(gqa or mqa) and bfloat16 and (d64 or d128)" -p no:cacheprovider > $OUT/flash_gqa.log 2>&1
echo "flash gqa tests $(el)s"; tail -4 $OUT/flash_gqa.log
timeout 120 python3 scripts/bench_attention.py --cases llama,llama_gqa --json $OUT/attn.json > $OUT/attn.log 2>&1
echo "attn bench $(el)s"; tail -6 $OUT/attn.log
timeout 230 python3 -m pytest -q -m gpu tests/test_gpu_library_models.py -k "llama_lm_d128 or llama_lm_d64" -p no:cacheprovider > $OUT/library.log 2>&1
echo "library llama $(el)s"; tail -4 $OUT/library.log
left=$(( 560 - $(el) ))
timeout $left python3 scripts/bench_tir.py bert_large --match norm_grad --norm-blocks 528,1056,2112,4224,100000 > $OUT/bert_norm_blocks.txt 2>&1
echo "bert sweep $(el)s"; tail -12 $OUT/bert_norm_blocks.txt
