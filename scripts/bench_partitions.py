#!/usr/bin/env python3
"""Time every CUTLASS partition of a model's training step on the GPU, under the default
configuration and under the shape heuristic an untuned build uses (``select.heuristic_config``).

    python scripts/bench_partitions.py bert_large --out /tmp/parts.json

Prints one row per distinct partition (slowest first) with both times; set ``TVM_EVT_DISABLE`` as
for a compile, since the optional rewrites change the partitions.

    python scripts/bench_partitions.py gpt2_medium --only main_adjoint_evt0_13_c5 --sweep quick

times the chosen partitions under every configuration of a search space (``select.candidates``,
with narrow-epilogue variants) next to their plain GEMM and torch.matmul (cuBLAS) on the same
shape and layouts: what an epilogue costs, whether a configuration hides it, and how far the main
loop is from the library's; ``--only 1605632x96x16,...`` takes the partitions of those problems,
``--configs pp_128x128x64_c1x1_e64x16,'*x32_c1x1'`` times only those configurations, and
``--sweep heuristic`` only what an untuned build runs (each partition beside its plain GEMM and
cuBLAS, two builds a partition).
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_partitions.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a scripts/bench.py model (tvm_evt.bench_e2e.MODELS)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--quick", action="store_true", help="the model's small shapes")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--only", default=None,
                    help="comma-separated partition symbols or MxNxK problems (default: all partitions)")
    ap.add_argument("--sweep", default=None, choices=["heuristic", "quick", "default", "full"],
                    help="time every configuration of this search space and the plain GEMM instead "
                    "(heuristic: only what an untuned build runs)")
    ap.add_argument("--configs", default=None,
                    help="with --sweep: only these comma-separated configuration names (as the sweep prints them) "
                    "or shell patterns of them, e.g. '*x32_c1x1'")
    args = ap.parse_args(argv)

    from tvm_evt import bench_e2e, tuning
    from tvm_evt.training import hopper_target

    entry = bench_e2e.build_entry(args.model, args.quick)
    cuda = hopper_target()
    _, graph = tuning.training_graph(entry, args.precision, target=cuda)
    parts, skipped = tuning.cutlass_partitions(tuning.partitioned(graph.mod, cuda))
    if args.only:
        wanted = set(args.only.split(","))
        keys = {p.symbol: {p.symbol, "x".join(map(str, (p.gemm.m, p.gemm.n, p.gemm.k)))} for p in parts}
        unknown = wanted - set().union(*keys.values())
        if unknown:
            ap.error(f"no partition {sorted(unknown)}; the model has {sorted(p.symbol for p in parts)}")
        parts = [p for p in parts if keys[p.symbol] & wanted]
    if args.sweep:
        only = set(args.configs.split(",")) if args.configs else None
        rows = tuning.sweep_configs(parts, args.sweep, only=only)
        for r in rows:
            library = f", cuBLAS {r['library_ms']:.3f}" if r.get("library_ms") is not None else ""
            print(f"{r['symbol']} batch {r['batch']} {'x'.join(map(str, r['mnk']))} {r['layout']}: plain GEMM "
                  f"{r['plain_ms']:.3f} ms{library}; untuned builds run {r['heuristic']}")
            for name, ms in sorted(r["ms"].items(), key=lambda kv: kv[1]):
                print(f"    {name:40s} {ms:8.3f}" + (f"  {r['errors'][name]}" if name in r["errors"] else ""))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "space": args.sweep, "rows": rows}, f, indent=1)
        return 0
    rows = tuning.compare_configs(parts)
    print(f"{'partition':30s} {'batch':>5s} {'M x N x K':>18s} {'default ms':>10s} {'heuristic':>32s} "
          f"{'ms':>7s} {'speedup':>7s}")
    for r in rows:
        print(f"{r['symbol']:30s} {r['batch']:5d} {'x'.join(map(str, r['mnk'])):>18s} {r['default_ms']:10.3f} "
              f"{r['heuristic']:>32s} {r['heuristic_ms']:7.3f} {r['speedup']:7.2f}"
              + (f"  errors: {r['errors']}" if r["errors"] else ""))
    total_d = sum(r["default_ms"] for r in rows)
    total_h = sum(r["heuristic_ms"] for r in rows)
    print(f"sum over distinct partitions: default {total_d:.3f} ms, heuristic {total_h:.3f} ms; skipped {skipped}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rows": rows, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
