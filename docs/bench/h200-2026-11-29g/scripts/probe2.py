# probe2 MODEL BATCH BUDGET_GB VARIANT: compile (variant: default | nograph | noarena), memory at each point
import sys, time
import torch
from tvm_evt import bench_e2e as e2e, optim, compile_training, pipeline
model, batch, budget, variant = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if variant == "noarena":
    pipeline.with_arena = lambda passes: passes
t = time.time()
entry = e2e.build_entry(model, False, batch=batch)
inputs = [x.cuda() for x in entry.example_inputs()]
free0, total = torch.cuda.mem_get_info()
used = lambda: round((free0 - torch.cuda.mem_get_info()[0]) / 1e9, 2)
ts = compile_training(entry.model, [x.cpu() for x in inputs], loss_fn=entry.loss_fn, optimizer=optim.AdamW(lr=1e-4),
                      precision="bf16", memory_budget=int(budget * 1e9) if budget else None,
                      cuda_graph=(variant != "nograph"))
print(f"== {variant}: compiled in {time.time() - t:.0f} s; device used after compile {used()} GB", flush=True)
rep = ts.memory_report()
print(variant, "planned peak GB", rep["planned_peak_bytes"] / 1e9, "storage GB", rep["planned_storage_bytes"] / 1e9,
      "unplanned", rep.get("unplanned_total_bytes", 0) / 1e9, {k: v for k, v in rep.items() if isinstance(v, (int, float))}, flush=True)
try:
    ts(*inputs); torch.cuda.synchronize()
    print(variant, "after step 1 GB", used(), flush=True)
    ts(*inputs); torch.cuda.synchronize()
    print(variant, "after step 2 GB", used(), flush=True)
except Exception as err:
    print(variant, "step failed:", str(err)[-500:], "used at failure GB", used(), flush=True)
