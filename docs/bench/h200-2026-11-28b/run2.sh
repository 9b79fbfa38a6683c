source .gpurun/env.sh
t training 400 4 tests/test_gpu_training.py -k "mlp or d128 or d80 or bert_layer-default or vit-default or gpt2_block_d64-default" &
t flash2 400 4 tests/test_gpu_flash_attention.py -k "d32 or d96" &
wait
t dp 150 1 tests/test_data_parallel.py -k nccl
