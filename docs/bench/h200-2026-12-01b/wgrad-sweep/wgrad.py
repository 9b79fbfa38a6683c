"""Weight-gradient GEMMs of ResNet-50 (bf16, NT, fp32 out): the current heuristic, stream-K / split-K
variants, and the same GEMM as a batch of S K-slices (fp32 partials) + torch.sum over the slices."""
import dataclasses, json, math, os, pickle, sys, time
import torch
from tvm import relax
from tvm_evt import tuning
from tvm_evt.codegen import select
from tvm_evt.codegen.backend import KernelConfig, Decomposition, Schedule, default_config
from tvm_evt.codegen.legality import fitting_config
from tvm_evt.codegen.frontend import from_function
from tvm_evt.codegen.passes import lower

T0 = time.time()
parts = pickle.load(open(".gpurun/r50_parts.pkl", "rb"))
WANT = sys.argv[1].split(",") if len(sys.argv) > 1 else ["100", "102", "110", "96", "80", "82", "93", "78", "54", "52", "40", "112"]
SK, SPLIT, PP = Decomposition.STREAM_K, Decomposition.SPLIT_K, Schedule.PINGPONG
cfg = lambda tile, **kw: KernelConfig(tile=tile, **kw)

def batched(m, n, k, s, name):
    bt = lambda *sh: relax.TensorType(sh, "bfloat16")
    dy, x = relax.Var("dy", bt(s, k // s, m)), relax.Var("x", bt(s, k // s, n))
    bb = relax.BlockBuilder()
    with bb.function(name, [dy, x]):
        with bb.dataflow():
            mm = bb.emit(relax.op.matmul(relax.op.permute_dims(dy, [0, 2, 1]), x, out_dtype="float32"))
            out = bb.emit_output(mm)
        bb.emit_func_output(out)
    return lower(from_function(bb.get()[name]))

def divisor_at_most(k, s):
    return max(d for d in range(1, s + 1) if k % d == 0 and (k // d) % 64 == 0)

jobs, meta = {}, {}
for w in WANT:
    p = parts[f"main_adjoint_evt0_{w}"]
    g = p.gemm
    m, n, k = g.m, g.n, g.k
    base = f"w{w}"
    configs = [select.heuristic_config(p), cfg((128, 128, 64), decomposition=SK), cfg((128, 256, 64), decomposition=SK)]
    for c in dict.fromkeys(fitting_config(p, c) for c in configs):
        jobs[f"{base}__{c.name}"] = (dataclasses.replace(p, symbol=f"{base}__{c.name}"), c)
    meta[base] = {"mnk": [m, n, k], "heuristic": fitting_config(p, select.heuristic_config(p)).name, "gemm": g}
    for tile in ((128, 128, 64), (128, 256, 64), (128, 64, 64)):
        if tile[1] > max(64, -(-n // 64) * 64) or (tile == (128, 64, 64) and n > 64 and m > 64):
            continue
        tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1])
        for waves in (1, 2):
            s = divisor_at_most(k, max(1, waves * 132 // tiles))
            if s < 2:
                continue
            grp = f"b{w}s{s}"
            bp = batched(m, n, k, s, grp)
            c = fitting_config(bp, cfg(tile))
            jobs[f"{grp}__{c.name}"] = (dataclasses.replace(bp, symbol=f"{grp}__{c.name}"), c)
            meta.setdefault(grp, {"mnk": [m, n, k], "s": s, "of": base})
print(f"{len(jobs)} jobs, {time.time()-T0:.0f}s", flush=True)
measure = tuning.GpuMeasure()
times = measure(jobs)
print(f"measured {time.time()-T0:.0f}s", flush=True)
rows = {}
for name, ms in times.items():
    grp, c = name.rsplit("__", 1)
    rows.setdefault(grp, {})[c] = (ms, measure.records[name]["error"])
out = {}
for base, mt in meta.items():
    if "gemm" in mt:
        lib = measure.matmul_ms(mt["gemm"])
        m, n, k = mt["mnk"]
        print(f"\n{base} {m}x{n}x{k}  cuBLAS {lib:.4f}  heuristic={mt['heuristic']}")
        out[base] = {"mnk": mt["mnk"], "cublas": lib, "heuristic": mt["heuristic"], "ms": rows.get(base, {})}
        for c, (ms, err) in sorted(rows.get(base, {}).items(), key=lambda kv: kv[1][0]):
            print(f"   {c:40s} {ms:8.4f} {err or ''}")
for grp, mt in meta.items():
    if "s" in mt:
        m, n, k = mt["mnk"]
        s = mt["s"]
        part = torch.randn(s, m, n, device="cuda")
        red = measure._median_ms(lambda: part.sum(0))
        out[grp] = {"of": mt["of"], "s": s, "sum_ms": red, "ms": rows.get(grp, {})}
        for c, (ms, err) in sorted(rows.get(grp, {}).items(), key=lambda kv: kv[1][0]):
            print(f"{mt['of']:6s} batched S={s:4d} {c:32s} {ms:8.4f} + sum {red:.4f} = {ms+red:.4f} {err or ''}")
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "wgrad.json"), "w"), indent=1, default=str)
print(f"done {time.time()-T0:.0f}s")
