# call A: ResNet-50 (tvm_evt, eager, CUDA-graph torch.compile), MobileNetV2's torch rows; full kernel lists
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/s1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv > $OUT/gpu.txt
b() { # models systems timeout
  local left=$((575 - $(el))); [ $left -gt 30 ] || return
  timeout -k 5 $left python3 scripts/bench.py --models $1 --systems $2 --profile --top 400 --timeout $3 --deadline $((left - 5)) --out /tmp/s1/cnn >> /tmp/s1/bench.log 2>&1
  echo "$1 $2 rc $? $(el)s" >> /tmp/s1/bench.log; cp /tmp/s1/cnn/bench_e2e.* /tmp/s1/bench.log $OUT/
}
b tv_resnet50 tvm_evt 330
b tv_resnet50 eager,compile_cudagraphs 130
b tv_mobilenet_v2 eager,compile_cudagraphs 110
grep -h "ms/step\|FAILED\|rc " /tmp/s1/bench.log | tail -12
