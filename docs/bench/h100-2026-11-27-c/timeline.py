"""Timeline of a few training steps: GPU-active time (union over streams), per-stream busy time,
and the largest idle gaps with the kernels around them."""
import json, os, sys, time, statistics
import torch
from torch.profiler import ProfilerActivity, profile
from tvm_evt import bench_e2e as B

model, system = sys.argv[1], sys.argv[2]
out = sys.argv[3]
entry = B.build_entry(model, False)
inputs = [t.cuda() for t in entry.example_inputs()]
if system.startswith("tvm"):
    step, _, ts = B._tvm_step(entry, inputs, system, None)
else:
    step, _ = B._torch_step(entry, inputs, system, channels_last=model in B.CHANNELS_LAST)
for _ in range(5):
    step()
torch.cuda.synchronize()
# host time per step (enqueue only) vs device time
host = []
for _ in range(10):
    t = time.perf_counter(); step(); host.append(time.perf_counter() - t)
torch.cuda.synchronize()
times = B.time_steps(step, 20)
print(f"{model}/{system}: step {statistics.median(times):.3f} ms, host enqueue {1e3*statistics.median(host):.3f} ms")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
path = f"{out}/{model}_{system}_trace.json"
prof.export_chrome_trace(path)
ev = json.load(open(path))["traceEvents"]
k = [e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
k.sort(key=lambda e: e["ts"])
t0, t1 = k[0]["ts"], max(e["ts"] + e["dur"] for e in k)
span = t1 - t0
union, cur_s, cur_e, gaps = 0.0, None, None, []
prev = None
for e in k:
    s, f = e["ts"], e["ts"] + e["dur"]
    if cur_e is None or s > cur_e:
        if cur_e is not None:
            union += cur_e - cur_s
            gaps.append((s - cur_e, prev["name"][:70], e["name"][:70]))
        cur_s, cur_e = s, f
    else:
        cur_e = max(cur_e, f)
    if prev is None or f >= prev["ts"] + prev["dur"]:
        prev = e
union += cur_e - cur_s
streams = {}
for e in k:
    streams.setdefault(e["args"].get("stream"), []).append(e["dur"])
print(f"3 steps: span {span/3e3:.3f} ms/step, GPU active (union) {union/3e3:.3f}, idle {(span-union)/3e3:.3f}, kernel sum {sum(e['dur'] for e in k)/3e3:.3f}")
for s, d in sorted(streams.items(), key=lambda x: -sum(x[1])):
    print(f"  stream {s}: {len(d)/3:.0f} kernels/step, {sum(d)/3e3:.3f} ms/step")
gaps.sort(key=lambda g: -g[0])
print("largest gaps (us): ")
for g in gaps[:25]:
    print(f"  {g[0]:7.1f}  after {g[1]}  before {g[2]}")
print(f"gaps > 5us: {sum(g[0] for g in gaps if g[0] > 5)/3e3:.3f} ms/step; count {len([g for g in gaps if g[0]>5])/3:.0f}/step; all gaps {sum(g[0] for g in gaps)/3e3:.3f}")
