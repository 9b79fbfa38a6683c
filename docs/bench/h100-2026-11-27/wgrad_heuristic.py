"""(Experiment, 2026-11-27; run from the repository root on an H100: python3 <this file>.)
Weight-gradient shapes (K = tokens) of BERT-Large and ViT-B/16: the heuristic's choice against
wider tiles, plain GEMM vs torch, each kernel checked against a float32 reference first."""
import dataclasses
from tvm_evt.codegen import bench, select
C, SK = select._cfg, select.SK
SHAPES = [("bert_qkv_dW", 3072, 1024, 16384), ("bert_ffn_dW", 4096, 1024, 16384), ("vit_qkv_dW", 2304, 768, 25216),
          ("vit_ffn1_dW", 3072, 768, 25216), ("vit_ffn2_dW", 768, 3072, 25216)]
CFGS = [C((128, 128, 64), decomposition=SK), C((128, 256, 64), decomposition=SK), C((128, 256, 64)),
        C((256, 128, 64), (2, 1)), C((128, 128, 64))]
jobs, cases = {}, []
for lab, m, n, k in SHAPES:
    case = bench.Case("a", "gemm", bench.Problem(lab, "wgrad", m, n, k)).build()
    cases.append(case)
    heur = select.heuristic_config(case.partition)
    for cfg in dict.fromkeys([heur] + CFGS):
        if not select.prune([cfg], m, n, k):
            continue
        name = f"{lab}__{cfg.name}"
        jobs[name] = (case, cfg, dataclasses.replace(case.partition, symbol=name))
srcs = {n: bench.emit(p, cfg) for n, (case, cfg, p) in jobs.items()}
objs, failed, stats = bench.build_tolerant(srcs, 16)
print("failed", list(failed), stats, flush=True)
lib = bench.load_library(objs)
th = bench.Torch()
for case in cases:
    ins = th.inputs(case)
    heur = select.heuristic_config(case.partition).name
    tms = th.time(lambda: th.mm("wgrad", ins[0], ins[1]), lambda: th.refresh(case, ins), 40, 5)
    print(f"== {case.problem.label} {case.problem.m}x{case.problem.n}x{case.problem.k}: torch {tms:.4f} ms (heuristic {heur})", flush=True)
    for n in sorted(k for k in objs if jobs[k][0] is case):
        outs = th.outputs(jobs[n][2]); fn = lib[n]
        th.refresh(case, ins)
        th.poison(outs); fn(*ins, *outs); th.torch.cuda.synchronize()
        err = th.verify(case, ins, outs, th.reference(case, ins))
        def refresh(outs=outs):
            th.refresh(case, ins); th.poison(outs)
        ms = th.time(lambda: fn(*ins, *outs), refresh, 40, 5)
        print(f"{n}: {ms:.4f} ms ({tms / ms:.3f}x torch) err {err:.1e}", flush=True)
