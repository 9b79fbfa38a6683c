"""(Experiment, 2026-11-27; run from the repository root on an H100: KDIM=1024 python3 <this file>
bias,bias_res,bias_drop,bias_drop_res.  The ``_r1`` kernels run one Philox round instead of ten:
timing only, their masks are not the convention's.)
Bisect the dropout+residual epilogue's cost: variants of attn-out fwd (16384x1024x1024)."""
import sys, math, json, os
import torch
from tvm import relax
from tvm_evt.codegen import bench, select
from tvm_evt.codegen.backend import emit
from tvm_evt.codegen.frontend import from_function, DROPOUT_EXTERN
from tvm_evt.codegen.passes import lower

M, N, K = 16384, 1024, int(os.environ.get("KDIM", 1024))
BF = "bfloat16"

def func(kind, name):
    tt = lambda *s: relax.TensorType(s, BF)
    x, w = relax.Var("x", tt(M, K)), relax.Var("w", tt(N, K))
    bias, res = relax.Var("bias", tt(N)), relax.Var("residual", tt(M, N))
    seed = relax.Var("seed", relax.TensorType((2,), "uint32"))
    params = [x, w, bias] + ([res] if "res" in kind else []) + ([seed] if "drop" in kind else [])
    bb = relax.BlockBuilder()
    with bb.function(name, params):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            h = bb.emit(relax.op.add(y, bias))
            if "drop" in kind:
                h = bb.emit(relax.call_pure_packed(DROPOUT_EXTERN, h, seed, relax.prim_value(3),
                                                   relax.prim_value(0.1), ty_args=h.ty))
            if "res" in kind:
                h = bb.emit(relax.op.add(h, res))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()[name]

cfgs = {"coop256": select._cfg((128, 256, 64)), "pp128": select._cfg((128, 128, 64), schedule=select.PP)}
hacks = {"": lambda s: s, "_r1": lambda s: s.replace("for (int r = 0; r < 10; ++r)", "for (int r = 0; r < 1; ++r)")}
jobs, parts = {}, {}
for kind in sys.argv[1].split(","):
    for cn, cfg in cfgs.items():
        for hn, hack in hacks.items():
            if hn and "drop" not in kind:
                continue
            name = f"v_{kind}_{cn}{hn}"
            p = lower(from_function(func(kind, name)))
            src = hack(emit(p, cfg))
            jobs[name] = src
            parts[name] = p
objs, failed, stats = bench.build_tolerant(jobs, 16)
print("failed", {k: v[-500:] for k, v in failed.items()}, stats, flush=True)
lib = bench.load_library(objs)
dev = "cuda"
res = {}
for name in sorted(objs):
    p = parts[name]
    ins = []
    for i, d in enumerate(p.params):
        if d.dtype == "uint32":
            ins.append(torch.tensor([0x1234ABCD, 0x0BADF00D], dtype=torch.int64).to(torch.int32).to(dev).view(torch.uint32))
        else:
            ins.append(torch.randn(d.shape, dtype=torch.bfloat16, device=dev) * (K ** -0.5 if i == 1 else 1))
    outs = [torch.empty(d.shape, dtype=torch.bfloat16, device=dev) for d in p.outputs]
    fn = lib[name]
    def refresh():
        for o in outs: o.fill_(float("nan"))
    ms = bench.median_ms(lambda: fn(*ins, *outs), refresh, 30, 5)
    ok = bool(torch.isfinite(outs[0]).all())
    res[name] = ms
    print(f"{name}: {ms:.4f} ms finite={ok}", flush=True)
x = torch.randn(M, K, dtype=torch.bfloat16, device=dev); w = torch.randn(N, K, dtype=torch.bfloat16, device=dev)
b = torch.randn(N, dtype=torch.bfloat16, device=dev); r = torch.randn(M, N, dtype=torch.bfloat16, device=dev)
F = torch.nn.functional
print("torch linear", bench.median_ms(lambda: F.linear(x, w, b), lambda: None, 30, 5))
print("torch linear+dropout+res", bench.median_ms(lambda: F.dropout(F.linear(x, w, b), 0.1, True) + r, lambda: None, 30, 5))
