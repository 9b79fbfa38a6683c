# BERT-Large's budgeted step at twice eager's batch with norm_output (budget aimed on a CPU); MobileNetV3-small's bf16 step
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /tmp/r4 && cp -r .gpurun/mb_budget /tmp/r4/mb
( export CUDA_VISIBLE_DEVICES=1; taskset -c 16-31 timeout 400 python3 -m pytest -q -p no:cacheprovider "tests/test_gpu_library_models.py::test_library_cnn_bf16_step[tv_mobilenet_v3_small]" > /tmp/r4/mnv3.log 2>&1; echo "mnv3 rc $? at $(el)s" >> /tmp/r4/mnv3.log ) &
export CUDA_VISIBLE_DEVICES=0
taskset -c 0-15 timeout 500 python3 scripts/bench.py --max-batch 80 --models hf_bert_large --systems tvm_evt_at_eager_batch,tvm_evt_budget_at_twice_eager --out /tmp/r4/mb > /tmp/r4/mb.log 2>&1; echo "mb rc $? $(el)s"
wait
grep -h "hf_bert" /tmp/r4/mb/bench_memory.md | head -8; grep "\[bench\]" /tmp/r4/mb.log | tail -6; tail -4 /tmp/r4/mnv3.log
cp /tmp/r4/mb/bench_memory.md /tmp/r4/mb/bench_memory.json /tmp/r4/mb.log /tmp/r4/mnv3.log $OUT/
