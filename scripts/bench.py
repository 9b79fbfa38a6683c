#!/usr/bin/env python3
"""End-to-end training-step benchmark on one GPU (see --help and tvm_evt/bench_e2e.py).

    python scripts/bench.py --out bench_out                                   # every model and system
    python scripts/bench.py --quick --models bert_large --systems eager,tvm_evt --out bench_out
    python scripts/bench.py --out bench_out --tuning-dir /tmp/tune            # + tvm_evt_tuned (tune.py dirs)
    python scripts/bench.py --out bench_out --replot                          # table and PNG from the JSON
"""
import sys

from tvm_evt.bench_e2e import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
