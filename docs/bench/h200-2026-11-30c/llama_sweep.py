"""Llama's heaviest CUTLASS partitions under a few tile/cluster configurations, next to their plain
GEMM and torch.matmul (cuBLAS) on the same shapes and layouts.  Writes $OUT/llama_sweep.json."""
import json, os, sys, time
t0 = time.time()
import torch
from tvm_evt import bench_e2e, tuning
from tvm_evt.training import hopper_target
from tvm_evt.codegen import select
from tvm_evt.codegen.legality import fitting_config

model = sys.argv[1] if len(sys.argv) > 1 else "hf_llama"
keep = sys.argv[2].split(",")
only = set(sys.argv[3].split(","))
entry = bench_e2e.build_entry(model, False)
cuda = hopper_target()
_, graph = tuning.training_graph(entry, "bf16", target=cuda)
parts, _ = tuning.cutlass_partitions(tuning.partitioned(graph.mod, cuda))
parts = [p for p in parts if p.symbol in keep]
print("partitions", [p.symbol for p in parts], "setup", round(time.time() - t0), "s", flush=True)

def cublas_ms(g):
    a = torch.randn(g.batch, g.m, g.k, device="cuda").bfloat16()
    b = torch.randn(g.batch, g.k, g.n, device="cuda").bfloat16()
    if not g.a_k_major:
        a = a.transpose(1, 2).contiguous().transpose(1, 2)
    if g.b_k_major:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    a, b = a.squeeze(0), b.squeeze(0)
    for _ in range(5):
        torch.matmul(a, b)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for s, e in ev:
        s.record(); torch.matmul(a, b); e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ev)[10]

rows = tuning.sweep_configs(parts, "full", only=only)
by_symbol = {p.symbol: p for p in parts}
for r in rows:
    p = by_symbol[r["symbol"]]
    r["cublas_ms"] = cublas_ms(p.gemm)
    r["layout"] = p.gemm.layout_name
    r["heuristic"] = fitting_config(p, select.heuristic_config(p)).name
    best = r["best"]
    print(f"{r['symbol']} {r['layout']} {'x'.join(map(str, r['mnk']))}: cublas {r['cublas_ms']:.3f} plain {r['plain_ms']:.3f} "
          f"heuristic {r['heuristic']} {r['ms'].get(r['heuristic'], float('nan')):.3f} best {best} {r['ms'][best]:.3f}", flush=True)
    for name, ms in sorted(r["ms"].items(), key=lambda kv: kv[1]):
        print(f"    {name:40s} {ms:8.3f}" + (f"  {r['errors'][name]}" if name in r.get("errors", {}) else ""))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), f"{model}_sweep.json"), "w"), indent=1, default=str)
print("total", round(time.time() - t0), "s")
