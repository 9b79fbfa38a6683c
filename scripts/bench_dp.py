#!/usr/bin/env python3
"""Data-parallel throughput on the GPUs of one host (see --help and tvm_evt/bench_dp.py).

    python scripts/bench_dp.py --gpus 1,2,4 --out bench_dp_out          # BERT-Large and GPT-2 medium, every system
    python scripts/bench_dp.py --quick --gpus 1,2 --models hf_bert_large --systems tvm_evt,ddp --out /tmp/dp
"""
import sys

from tvm_evt.bench_dp import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
