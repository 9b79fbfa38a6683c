# Llama: default vs RMSNorm-as-op, with eager and torch.compile in the same run
set -x
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
T0=$(date +%s)
python3 scripts/bench.py --out $OUT/default --profile --memory --models hf_llama --systems tvm_evt,compile,eager --timeout 240 > $OUT/default.log 2>&1
echo "default done $(( $(date +%s) - T0 ))s"
TVM_EVT_ENABLE=rms_norm python3 scripts/bench.py --out $OUT/rms --profile --memory --models hf_llama --systems tvm_evt --timeout 200 > $OUT/rms.log 2>&1
echo "rms done $(( $(date +%s) - T0 ))s"
tail -30 $OUT/default.log $OUT/rms.log
