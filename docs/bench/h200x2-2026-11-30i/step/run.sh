# norm_output: GPU tests on GPU1, BERT-Large on/off/on on GPU0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
mkdir -p /tmp/r
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 16-31 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fuse_layer_norm_backward.py tests/test_fuse_layer_norm.py > /tmp/r/gpu_ln.log 2>&1
  echo "ln tests rc $? at $(el)s" >> /tmp/r/gpu_ln.log
  taskset -c 16-31 timeout $((575 - $(el))) python3 -m pytest -q -p no:cacheprovider \
    "tests/test_gpu_library_models.py::test_library_model_bf16_step[bert_mlm]" \
    "tests/test_gpu_library_models.py::test_library_model_bf16_step[gpt2_lm]" \
    "tests/test_gpu_library_models.py::test_rms_norm_op_bf16_step" \
    "tests/test_gpu_training.py::test_bf16_step_on_cuda_runs_every_matmul_in_evt[bert_layer-default]" \
    "tests/test_gpu_training.py::test_bf16_step_on_cuda_runs_every_matmul_in_evt[vit-default]" \
    "tests/test_gpu_library_models.py::test_library_model_bf16_step[timm_vit]" \
    "tests/test_gpu_library_models.py::test_folded_layer_norms_bf16_step[gpt2_lm]" \
    > /tmp/r/gpu_models.log 2>&1
  echo "model tests rc $? at $(el)s" >> /tmp/r/gpu_models.log
) &
export CUDA_VISIBLE_DEVICES=0
taskset -c 0-15 timeout 260 python3 scripts/bench.py --out /tmp/r/on1 --profile --top 60 --models hf_bert_large --systems tvm_evt --timeout 250 > /tmp/r/on1.log 2>&1; echo "on1 $(el)s"
TVM_EVT_DISABLE=norm_output taskset -c 0-15 timeout 170 python3 scripts/bench.py --out /tmp/r/off --profile --top 60 --models hf_bert_large --systems tvm_evt --timeout 160 > /tmp/r/off.log 2>&1; echo "off $(el)s"
taskset -c 0-15 timeout $((570 - $(el))) python3 scripts/bench.py --out /tmp/r/on2 --models hf_bert_large --systems tvm_evt --timeout 160 > /tmp/r/on2.log 2>&1; echo "on2 $(el)s"
wait
for d in on1 off on2; do grep -h "BertFor\|bert" /tmp/r/$d/bench_e2e.md 2>/dev/null | head -2; grep -h "GPU busy" /tmp/r/$d/bench_e2e.md 2>/dev/null; done
tail -3 /tmp/r/gpu_ln.log; tail -15 /tmp/r/gpu_models.log
cp /tmp/r/on1/bench_e2e.md $OUT/on1.md; cp /tmp/r/off/bench_e2e.md $OUT/off.md; cp /tmp/r/on2/bench_e2e.md $OUT/on2.md
cp /tmp/r/gpu_ln.log /tmp/r/gpu_models.log $OUT/
tail -5 /tmp/r/on1.log /tmp/r/off.log /tmp/r/on2.log
