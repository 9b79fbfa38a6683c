#!/usr/bin/env python3
"""Time a model's scheduled TIR kernels one by one on the GPU (see --help and tvm_evt/bench_tir.py).

    python scripts/bench_tir.py bert_large --match sum --column-rows 2,4,8
    python scripts/bench_tir.py hf_llama --match max --dlight
"""
import sys

from tvm_evt.bench_tir import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
