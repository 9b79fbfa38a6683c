"""Time XML-CNN's tiny-M long-K weight-gradient partitions under split-K / stream-K configurations
(GpuMeasure also checks each against the default configuration's output)."""
import dataclasses, json, os, sys
import tvm
from tvm_evt import bench_e2e, tuning
from tvm_evt.codegen import select
from tvm_evt.codegen.backend.config import KernelConfig, Decomposition, Schedule

entry = bench_e2e.build_entry("xml_cnn", False)
cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
_, graph = tuning.training_graph(entry, "bf16", target=cuda)
parts, _ = tuning.cutlass_partitions(tuning.partitioned(graph.mod, cuda))
parts = [p for p in parts if p.gemm.m <= 64 and p.gemm.k >= 2048]
SK, SPLIT = Decomposition.STREAM_K, Decomposition.SPLIT_K
configs = [KernelConfig(tile=(64, 256, 64), schedule=Schedule.PINGPONG), KernelConfig()]
configs += [KernelConfig(decomposition=SPLIT, splits=s) for s in (2, 3, 4, 6, 8)]
configs += [KernelConfig(decomposition=SK), KernelConfig(tile=(128, 64, 64), decomposition=SK),
            KernelConfig(tile=(128, 64, 64), decomposition=SPLIT, splits=4)]
jobs = {}
for p in parts:
    for c in configs + [select.heuristic_config(p)]:
        jobs[f"{p.symbol}__{c.name}"] = (dataclasses.replace(p, symbol=f"{p.symbol}__{c.name}"), c)
m = tuning.GpuMeasure()
times = m(jobs)
rows = {}
for p in parts:
    print(p.symbol, p.gemm.m, p.gemm.n, p.gemm.k, "heuristic", select.heuristic_config(p).name)
    for n, ms in sorted(((n, t) for n, t in times.items() if n.startswith(p.symbol + "__")), key=lambda x: x[1]):
        err = m.records.get(n, {}).get("error")
        print(f"    {n.split('__')[1]:36s} {ms:8.4f} {err or ''}")
json.dump({"times": times, "records": {k: str(v) for k, v in m.records.items()}}, open(sys.argv[1], "w"), indent=1)
