# ViT-B/16 (timm) against torch.compile default and max-autotune in one run (same machine as ../llama)
export PYTHONPATH=/tmp/site XDG_CACHE_HOME=/tmp/evtc; T0=$(date +%s)
timeout 540 python3 scripts/bench.py --out $OUT/vit --models timm_vit_b16 --systems tvm_evt,compile,compile_max_autotune --timeout 300 > $OUT/vit.log 2>&1
echo "vit $(( $(date +%s) - T0 ))s"; grep "vit\|ViT" $OUT/vit/bench_e2e.md | head -4; tail -4 $OUT/vit.log
