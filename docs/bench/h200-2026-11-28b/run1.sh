source .gpurun/env.sh
nvidia-smi -L
t flash 480 6 tests/test_gpu_flash_attention.py -k "d128 or d80" &
t libmodels 480 3 tests/test_gpu_library_models.py &
wait
