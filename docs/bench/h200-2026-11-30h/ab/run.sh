# flash kernels' launch order (cta_of: head chunks, ranks longest first): GPU tests, then new / old / new A/B
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -n 16 tests/test_gpu_flash_attention.py -k "d64 or (gqa and d128)" > $OUT/flash_tests.log 2>&1
echo "tests $(el)s: $(tail -1 $OUT/flash_tests.log)"
inst() { python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . >/dev/null 2>&1; }
timeout 120 python3 scripts/bench_attention.py --cases llama,llama_gqa,gpt2,bert --layout bshd --json $OUT/new1.json > $OUT/new1.log 2>&1
echo "new1 $(el)s"
patch -R -p1 < .gpurun/launch_order.patch > /dev/null && inst
timeout 120 python3 scripts/bench_attention.py --cases llama,llama_gqa,gpt2,bert --layout bshd --json $OUT/old.json > $OUT/old.log 2>&1
echo "old $(el)s"
patch -p1 < .gpurun/launch_order.patch > /dev/null && inst
timeout 60 python3 scripts/bench_attention.py --cases llama,llama_gqa,gpt2,bert --layout bshd --json $OUT/new2.json > $OUT/new2.log 2>&1
echo "new2 $(el)s"
for f in new1 old new2; do echo "== $f"; grep -v "^\[" $OUT/$f.log | tail -8; done
