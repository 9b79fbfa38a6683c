# call B: EfficientNet-B0 (tvm_evt, eager, CUDA-graph torch.compile), full kernel lists
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s2
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
b() { # models systems timeout
  local left=$((575 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s2/cnn >> /tmp/s2/bench.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s2/bench.log; cp /tmp/s2/cnn/bench_e2e.* /tmp/s2/bench.log $OUT/
}
b timm_effnet_b0 tvm_evt 360
b timm_effnet_b0 eager,compile_cudagraphs 150

grep -h "ms/step\|FAILED\|rc " /tmp/s2/bench.log | tail -12
left=$((575 - $(el)))
if [ $left -gt 90 ]; then timeout -k 5 $left python3 -m pytest -q -p no:cacheprovider -x "tests/test_gpu_library_models.py::test_library_cnn_bf16_step[tv_mobilenet_v3_small]" > /tmp/s2/gputests.log 2>&1; echo "tests rc $? $(el)s" >> /tmp/s2/gputests.log; cp /tmp/s2/gputests.log $OUT/; tail -3 /tmp/s2/gputests.log; fi
