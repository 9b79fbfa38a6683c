#!/usr/bin/env python3
"""Modelled global-memory traffic of a model's training step on the CUDA route, kernel by kernel
(``tuning.kernel_traffic``: buffer bytes x calls; no GPU, no nvcc).  A lower bound on memory time
to compare graph rewrites by:

    python scripts/traffic.py resnet50 --top 20
    TVM_EVT_ENABLE=nhwc python scripts/traffic.py resnet50

The optional rewrites are set as for a compile (``TVM_EVT_ENABLE`` / ``TVM_EVT_DISABLE``).
"""
import argparse
import json
import sys

HBM_BYTES_PER_S = 3.35e12  # H100 SXM


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="traffic.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a scripts/bench.py model (tvm_evt.bench_e2e.MODELS)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--quick", action="store_true", help="the model's small shapes")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (0: all)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)

    from tvm_evt import bench_e2e, optim, tuning
    from tvm_evt.training import hopper_target

    entry = bench_e2e.build_entry(args.model, args.quick)
    cuda = hopper_target()
    _, graph = tuning.training_graph(entry, args.precision, optim.AdamW(lr=1e-4), cuda)  # as scripts/bench.py
    rows = tuning.kernel_traffic(graph.mod, cuda)
    for kind in ("cutlass", "flash", "conv", "tir"):
        total = sum(r["bytes"] for r in rows if r["kind"] == kind)
        print(f"{kind:8s} {sum(r['kind'] == kind for r in rows):4d} kernels {total / 1e6:10.0f} MB/step")
    total = sum(r["bytes"] for r in rows)
    print(f"{'total':8s} {len(rows):4d} kernels {total / 1e6:10.0f} MB/step "
          f"(>= {total / HBM_BYTES_PER_S * 1e3:.2f} ms at {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")
    for r in rows[: args.top or None]:
        print(f"{r['bytes'] / 1e6:10.1f} MB {r['calls']:4d} x {r['bytes_per_call'] / 1e6:8.1f} MB "
              f"{r['kind']:7s} {r['kernel'][:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "precision": args.precision, "quick": args.quick, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
