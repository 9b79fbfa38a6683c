# launch order gated on causal (non-causal launches keep a head's tiles together): GPU tests, A/B timing
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu -n 16 tests/test_gpu_flash_attention.py -k "d64 or (gqa and d128)" > $OUT/flash_tests.log 2>&1
echo "tests $(el)s: $(tail -1 $OUT/flash_tests.log)"
timeout 90 python3 scripts/bench_attention.py --cases llama,llama_gqa,gpt2,bert --layout bshd --json $OUT/gated.json > $OUT/gated.log 2>&1
echo "gated $(el)s"; grep -v "^\[" $OUT/gated.log | tail -7
