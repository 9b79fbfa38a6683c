#!/usr/bin/env python3
"""Time the flash-attention kernels (relax.ext.evt_attention) against torch SDPA on the GPU:
the attention cores of BERT-Large, GPT-2 medium, ViT-B/16 and a Llama layer, with its 32 heads or
its 8 key/value heads (tvm_evt.codegen.bench_attention)."""
import argparse

from tvm_evt.codegen import bench_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=",".join(bench_attention.CASES),
                        help=f"comma-separated, of {', '.join(bench_attention.CASES)}")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per kernel (median)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                        help="the kernels' q/k/v/O layout: [B, H, S, D], or [B, S, H, D] as the training graphs use")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = set(names) - set(bench_attention.CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}")
    bench_attention.main(names, args.iters, args.json, args.layout)


if __name__ == "__main__":
    main()
