# norm_output: largest batches in 80 GB confirmed on the device (estimates from a CPU), and the rest of the model tests
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/r2 && cp -r .gpurun/mb_bert /tmp/r2/bert && cp -r .gpurun/mb_gpt /tmp/r2/gpt
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 16-31 timeout 240 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_gpu_training.py::test_bf16_step_on_cuda_runs_every_matmul_in_evt[vit-default]" \
    "tests/test_gpu_library_models.py::test_library_model_bf16_step[timm_vit]" \
    "tests/test_gpu_library_models.py::test_folded_layer_norms_bf16_step[gpt2_lm]" \
    > /tmp/r2/gpu_models.log 2>&1
  echo "model tests rc $? at $(el)s" >> /tmp/r2/gpu_models.log
  taskset -c 16-31 timeout $((575 - $(el))) python3 scripts/bench.py --max-batch 80 --models hf_gpt2_medium --systems tvm_evt --out /tmp/r2/gpt > /tmp/r2/gpt.log 2>&1
  echo "gpt2 rc $? at $(el)s" >> /tmp/r2/gpt.log
) &
export CUDA_VISIBLE_DEVICES=0
taskset -c 0-15 timeout 570 python3 scripts/bench.py --max-batch 80 --models hf_bert_large --systems tvm_evt --out /tmp/r2/bert > /tmp/r2/bert.log 2>&1; echo "bert rc $? $(el)s"
wait
grep -h "hf_\|BERT\|GPT" /tmp/r2/bert/bench_memory.md /tmp/r2/gpt/bench_memory.md 2>/dev/null | head
grep "\[bench\]" /tmp/r2/bert.log /tmp/r2/gpt.log | tail -12
tail -4 /tmp/r2/gpu_models.log; tail -2 /tmp/r2/gpt.log
cp /tmp/r2/bert/bench_memory.md $OUT/bert.md; cp /tmp/r2/gpt/bench_memory.md $OUT/gpt.md
cp /tmp/r2/bert/bench_memory.json $OUT/bert.json; cp /tmp/r2/gpt/bench_memory.json $OUT/gpt.json
cp /tmp/r2/gpu_models.log $OUT/
