#!/usr/bin/env python3
"""End-to-end training-step benchmark on one GPU (see --help, tvm_evt/bench_e2e.py and, for --max-batch,
tvm_evt/bench_memory.py).

    python scripts/bench.py --out bench_out                                   # every model and system
    python scripts/bench.py --quick --models bert_large --systems eager,tvm_evt --out bench_out
    python scripts/bench.py --out bench_out --tuning-dir /tmp/tune            # + tvm_evt_tuned (tune.py dirs)
    python scripts/bench.py --out bench_out --replot                          # table and PNG from the JSON
    python scripts/bench.py --max-batch 80 --models hf_bert_large --out mem    # largest batch per system in 80 GB
"""
import sys

from tvm_evt.bench_memory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
