"""Interleaved A/B: hf_llama default vs TVM_EVT_ENABLE=rms_norm vs torch.compile, one process."""
import json, os, statistics, sys, time
import torch
from tvm_evt import bench_e2e as b

out = os.environ["OUT"]
entry = b.build_entry("hf_llama")
inputs = tuple(t.cuda() if torch.is_tensor(t) else t for t in entry.example_inputs())
steps = {}
for name, env in (("default", ""), ("rms_norm", "rms_norm")):
    os.environ["TVM_EVT_ENABLE"] = env
    t = time.time()
    steps[name], cs, ts = b._tvm_step(entry, inputs, "tvm_evt", None)
    print(name, "compile", round(cs, 1), "s", flush=True)
    for _ in range(3): steps[name]()
os.environ["TVM_EVT_ENABLE"] = ""
steps["compile"], _ = b._torch_step(entry, inputs, "compile")
for _ in range(3): steps["compile"]()
torch.cuda.synchronize()
res = {k: [] for k in steps}
for r in range(8):
    for k, s in steps.items():
        res[k] += b.time_steps(s, 10)
summ = {k: dict(median=statistics.median(v), min=min(v), n=len(v)) for k, v in res.items()}
for k, v in summ.items():
    print(k, {a: round(x, 3) for a, x in v.items()}, "ratio vs compile %.4f" % (summ["compile"]["median"] / v["median"]))
json.dump(dict(summary=summ, raw=res), open(f"{out}/ab.json", "w"), indent=1)
