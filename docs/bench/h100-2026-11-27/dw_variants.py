"""(Experiment, 2026-11-27; run from the repository root on an H100: python3 <this file>.)
More main-loop configurations on BERT-Large's long-K weight gradients (plain GEMM), vs torch."""
import dataclasses, sys
from tvm_evt.codegen import bench, select
from tvm_evt.codegen.backend import emit
from tvm_evt.codegen.backend.config import Raster
PP, SK, SPLIT = select.PP, select.SK, select.SPLIT
C = select._cfg
CFGS = [
    C((128, 128, 64), decomposition=SPLIT, splits=2),  # today's best on attn-out dW (reference)
    C((128, 256, 64), decomposition=SK),               # today's best on QKV dW (reference)
    C((128, 64, 64), schedule=PP), C((128, 64, 64), (1, 2), schedule=PP), C((128, 64, 64), (2, 1), schedule=PP),
    C((128, 128, 64), (1, 2), schedule=PP), C((128, 128, 64), (2, 1), decomposition=SPLIT, splits=3),
    C((256, 128, 64), (1, 2), decomposition=SK), C((128, 256, 64), (1, 2), decomposition=SK),
    C((128, 128, 64), (1, 2), decomposition=SPLIT, splits=2), C((256, 128, 64), decomposition=SPLIT, splits=4),
    C((128, 128, 64), decomposition=SPLIT, splits=3), C((128, 256, 64), decomposition=SPLIT, splits=2),
]
cases = bench.pick_cases(bench.bert_cases(False), sys.argv[1] if len(sys.argv) > 1 else "gemm_QKV_dW,gemm_attnout_dW")
jobs = {}
for case in cases:
    for cfg in CFGS:
        if not select.prune([cfg], case.problem.m, case.problem.n, case.problem.k):
            continue
        name = f"{case.name}__{cfg.name}"
        jobs[name] = (case, cfg, dataclasses.replace(case.partition, symbol=name))
srcs = {}
for n, (case, cfg, p) in jobs.items():
    try:
        srcs[n] = emit(p, cfg)
    except Exception as e:
        print(n, "emit:", e)
objs, failed, stats = bench.build_tolerant(srcs, 16)
print("failed", {k: v[-300:] for k, v in failed.items()}, stats, flush=True)
lib = bench.load_library(objs)
th = bench.Torch()
for case in cases:
    ins = th.inputs(case)
    tms = th.time(lambda: th.mm(case.problem.kind, ins[0], ins[1]), lambda: th.refresh(case, ins), 40, 5)
    print(f"== {case.name}: torch {tms:.4f} ms", flush=True)
    for n in sorted(k for k in objs if jobs[k][0] is case):
        outs = th.outputs(jobs[n][2]); fn = lib[n]
        th.refresh(case, ins)
        th.poison(outs); fn(*ins, *outs); th.torch.cuda.synchronize()
        err = th.verify(case, ins, outs, th.reference(case, ins))
        def refresh(outs=outs):
            th.refresh(case, ins); th.poison(outs)
        ms = th.time(lambda: fn(*ins, *outs), refresh, 40, 5)
        print(f"{n}: {ms:.4f} ms ({tms / ms:.3f}x torch) err {err:.1e}", flush=True)
    tms = th.time(lambda: th.mm(case.problem.kind, ins[0], ins[1]), lambda: th.refresh(case, ins), 40, 5)
    print(f"== {case.name}: torch again {tms:.4f} ms", flush=True)
