#!/usr/bin/env python3
"""Time the implicit-GEMM convolution kernels (relax.ext.evt_conv) against cuDNN through torch on
the GPU: ResNet-50's 3x3 convolutions at batch 128, each kernel under the configuration a build
gives it and under other tiles and batch chunks (tvm_evt.codegen.bench_conv)."""
import argparse

from tvm_evt.codegen import bench_conv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=",".join(bench_conv.CASES),
                        help=f"comma-separated, of {', '.join(bench_conv.CASES)}")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per kernel (median)")
    parser.add_argument("--out", help="write bench_conv.json and bench_conv.md into this directory")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = set(names) - set(bench_conv.CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}")
    bench_conv.main(names, args.iters, args.out)


if __name__ == "__main__":
    main()
