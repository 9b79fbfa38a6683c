"""(Experiment, 2026-11-27; run from the repository root on an H100: python3 <this file> dw|wgrad.)

Plain weight-gradient GEMMs (K = tokens) under explicit CUTLASS configurations, against torch:
  dw     BERT-Large's QKV and attention-output dW under configurations beyond the search table
  wgrad  BERT-Large's and ViT-B/16's dW shapes under heuristic_config's choice and four others
Each kernel is checked against a float32 reference on fresh inputs, then timed."""
import dataclasses
import sys

from tvm_evt.codegen import bench, select

C, PP, SK, SPLIT = select._cfg, select.PP, select.SK, select.SPLIT


def bert_dw():
    configs = [
        C((128, 128, 64), decomposition=SPLIT, splits=2), C((128, 256, 64), decomposition=SK),  # the best so far
        C((128, 64, 64), schedule=PP), C((128, 64, 64), (1, 2), schedule=PP), C((128, 64, 64), (2, 1), schedule=PP),
        C((128, 128, 64), (1, 2), schedule=PP), C((128, 128, 64), (2, 1), decomposition=SPLIT, splits=3),
        C((256, 128, 64), (1, 2), decomposition=SK), C((128, 256, 64), (1, 2), decomposition=SK),
        C((128, 128, 64), (1, 2), decomposition=SPLIT, splits=2), C((256, 128, 64), decomposition=SPLIT, splits=4),
        C((128, 128, 64), decomposition=SPLIT, splits=3), C((128, 256, 64), decomposition=SPLIT, splits=2),
    ]
    return [(c, configs) for c in bench.pick_cases(bench.bert_cases(), "gemm_QKV_dW,gemm_attnout_dW")]


def wgrad():
    shapes = [("bert_qkv_dW", 3072, 1024, 16384), ("bert_ffn_dW", 4096, 1024, 16384),
              ("vit_qkv_dW", 2304, 768, 25216), ("vit_ffn1_dW", 3072, 768, 25216), ("vit_ffn2_dW", 768, 3072, 25216)]
    configs = [C((128, 128, 64), decomposition=SK), C((128, 256, 64), decomposition=SK), C((128, 256, 64)),
               C((256, 128, 64), (2, 1)), C((128, 128, 64))]
    out = []
    for label, m, n, k in shapes:
        case = bench.Case("a", "gemm", bench.Problem(label, "wgrad", m, n, k)).build()
        out.append((case, list(dict.fromkeys([select.heuristic_config(case.partition)] + configs))))
    return out


def main(which: str) -> None:
    plan = {"dw": bert_dw, "wgrad": wgrad}[which]()
    jobs = {}
    for case, configs in plan:
        p = case.problem
        # the dw run took every listed configuration (the table's pruning then let clusters with
        # stream-K through on few tiles); the wgrad run took what ``select.prune`` keeps
        for cfg in configs if which == "dw" else select.prune(configs, p.m, p.n, p.k):
            name = f"{case.name}__{cfg.name}"
            jobs[name] = (case, bench.emit(dataclasses.replace(case.partition, symbol=name), cfg))
    objects, failed, stats = bench.build_tolerant({n: src for n, (_, src) in jobs.items()}, 16)
    print("failed", list(failed), stats, flush=True)
    lib = bench.load_library(objects)
    th = bench.Torch()
    for case, _ in plan:
        ins = th.inputs(case)
        torch_ms = th.time(lambda: th.mm(case.problem.kind, ins[0], ins[1]), lambda: th.refresh(case, ins), 40, 5)
        p = case.problem
        print(f"== {case.name} {p.m}x{p.n}x{p.k}: torch {torch_ms:.4f} ms, "
              f"heuristic {select.heuristic_config(case.partition).name}", flush=True)
        for name in sorted(n for n in objects if jobs[n][0] is case):
            outs, fn = th.outputs(case.partition), lib[name]
            th.refresh(case, ins)
            err = th.checked_call(case, fn, ins, outs)
            ms = th.time_kernel(case, fn, ins, outs, 40, 5)
            print(f"{name}: {ms:.4f} ms ({torch_ms / ms:.3f}x torch) err {err:.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
