"""ResNet-50's forward / input-gradient GEMM partitions (batch 1, K < 4096): each under the shape
heuristic and alternatives, beside its plain GEMM (default config) and cuBLAS."""
import dataclasses, json, os, pickle, sys, time
from tvm_evt import tuning
from tvm_evt.codegen import select
from tvm_evt.codegen.backend import KernelConfig, Schedule, default_config, emit
from tvm_evt.codegen.legality import fitting_config

T0 = time.time()
parts = pickle.load(open(".gpurun/r50_now.pkl", "rb"))
PP, COOP = Schedule.PINGPONG, Schedule.COOPERATIVE
ALTS = [KernelConfig(tile=(128, 128, 64)), KernelConfig(tile=(128, 128, 64), schedule=PP),
        KernelConfig(tile=(128, 128, 64), schedule=PP, epi_tile=(64, 16)),
        KernelConfig(tile=(128, 256, 64)), KernelConfig(tile=(256, 128, 64), cluster=(1, 2, 1)),
        KernelConfig(tile=(128, 128, 64), cluster=(2, 1, 1)),
        KernelConfig(tile=(128, 64, 64)), KernelConfig(tile=(128, 64, 64), schedule=PP),
        KernelConfig(tile=(256, 64, 64))]
DRY = "--dry" in sys.argv
jobs, meta = {}, {}
for name, p in parts.items():
    g = p.gemm
    if g.batch != 1 or g.k >= 4096 or g.m < 6272:
        continue
    base = name.replace("main_adjoint_", "").replace("train_step_", "")
    cands = [select.heuristic_config(p)]
    for c in ALTS:
        if c.tile[1] > max(64, -(-g.n // 64) * 64) or (c.tile[1] == 64 and g.n > 64):
            continue
        cands.append(c)
    names = []
    for c in dict.fromkeys(cands):
        try:
            f = fitting_config(p, c)
            emit(dataclasses.replace(p, symbol="probe"), f)
        except Exception as e:
            print(f"{base} {c.name}: {type(e).__name__} {str(e)[:120]}")
            continue
        jobs[f"{base}__{f.name}"] = (dataclasses.replace(p, symbol=f"{base}__{f.name}"), f)
        names.append(f.name)
    d = default_config(g.dtype_a)
    jobs[f"{base}_plain__{d.name}"] = (select.plain_partition(p, f"{base}_plain__{d.name}"), d)
    meta[base] = {"mnk": [g.m, g.n, g.k], "layout": g.layout_name, "heuristic": fitting_config(p, select.heuristic_config(p)).name,
                  "gemm": g, "nodes": [type(n).__name__ for n in p.epilogue.nodes]}
print(f"{len(jobs)} jobs over {len(meta)} partitions, {time.time()-T0:.0f}s", flush=True)
if DRY:
    from tvm_evt.codegen.build.units import translation_units
    print(len(translation_units({n: emit(p, c) for n, (p, c) in jobs.items()})), "units")
    sys.exit()
measure = tuning.GpuMeasure()
times = measure(jobs)
print(f"measured {time.time()-T0:.0f}s", flush=True)
out = {}
for base, mt in meta.items():
    lib = measure.matmul_ms(mt["gemm"])
    rows = {n.rsplit("__", 1)[1]: (ms, measure.records[n]["error"]) for n, ms in times.items() if n.rsplit("__", 1)[0] == base}
    plain = [ms for n, ms in times.items() if n.rsplit("__", 1)[0] == base + "_plain"]
    m, n, k = mt["mnk"]
    print(f"\n{base} {m}x{n}x{k} {mt['layout']} {mt['nodes']}  cuBLAS {lib:.4f} plain {plain[0]:.4f} heuristic={mt['heuristic']}")
    for c, (ms, err) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        print(f"   {c:40s} {ms:8.4f} {err or ''}")
    out[base] = {k2: v for k2, v in mt.items() if k2 != "gemm"} | {"cublas": lib, "plain": plain[0], "ms": rows}
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "fwd.json"), "w"), indent=1, default=str)
print(f"done {time.time()-T0:.0f}s")
