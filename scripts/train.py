#!/usr/bin/env python3
"""Train a zoo model on synthetic data (default: 2-layer BERT, vocab 1k). See --help."""
import sys

from tvm_evt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
