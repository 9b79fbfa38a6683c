# probe3 MODEL BATCH BUDGET_GB GRAPH(0/1) [INPLACE]: device memory around each CUDA-graph builtin and every allocation
# of 0.5 GB or more (VM builtins wrapped), to find what a budgeted graph step holds beyond its plan
import sys, time
import torch
import tvm_ffi
from tvm_evt import bench_e2e as e2e, optim, compile_training
model, batch, budget, graph = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
free0 = torch.cuda.mem_get_info()[0]
used = lambda: round((free0 - torch.cuda.mem_get_info()[0]) / 1e9, 2)
log = []
for name in ("vm.builtin.cuda_graph.run_or_capture", "vm.builtin.cuda_graph.get_cached_alloc", "vm.builtin.alloc_storage",
             "vm.builtin.alloc_tensor"):
    orig = tvm_ffi.get_global_func(name)
    def wrap(*args, _orig=orig, _name=name):
        torch.cuda.synchronize(); before = used()
        try:
            out = _orig(*args)
        except Exception:
            print(f"  {_name} raised at {before} GB used; args {[str(a)[:80] for a in args[1:]]}", flush=True)
            raise
        torch.cuda.synchronize(); after = used()
        big = after - before > 0.5 or "cuda_graph" in _name
        if big:
            print(f"  {_name.split('.')[-1]} {[str(a)[:60] for a in args[1:] if not hasattr(a, 'shape')][:3]}: {before} -> {after} GB", flush=True)
        log.append((before, after))
        return out
    tvm_ffi.register_global_func(name, wrap, override=True)
entry = e2e.build_entry(model, False, batch=batch)
inputs = [x.cuda() for x in entry.example_inputs()]
t = time.time()
ts = compile_training(entry.model, [x.cpu() for x in inputs], loss_fn=entry.loss_fn, optimizer=optim.AdamW(lr=1e-4),
                      precision="bf16", memory_budget=int(budget * 1e9) if budget else None, cuda_graph=graph, inplace=len(sys.argv) > 5)
rep = ts.memory_report()
print(f"== {model} {batch} budget {budget} graph {graph}: compiled {time.time() - t:.0f} s, used {used()} GB, planned peak "
      f"{rep['planned_peak_bytes'] / 1e9:.2f} storage {rep['planned_storage_bytes'] / 1e9:.2f}", flush=True)
try:
    for i in range(2):
        ts(*inputs); torch.cuda.synchronize()
        print(f"after step {i + 1}: {used()} GB", flush=True)
except Exception as err:
    print("step failed:", str(err)[-300:], "used", used(), "wrapped builtin calls", len(log), flush=True)
