"""(Experiment, 2026-11-27; run from the repository root on an H100: python3 <this file> [variants|qkv].)

variants: BERT-Large's two weight gradients with few output tiles (QKV dW 3072x1024x16384, attention-output
dW 1024x1024x16384) under split-K and stream-K, each kernel in three variants:
  kept      the emitted source: ResettingStreamKScheduler, workspace kept between launches
  per_call  the same kernel through ``launch``: workspace allocated, locks zeroed, freed per call
  nondet    kept, with CUTLASS's non-deterministic reduction (splits add in any order)
against torch.matmul.  Every kernel is checked against a float32 reference, then timed twice,
interleaved with the other variants (CUDA events, medians, fresh inputs, outputs poisoned).

qkv: the QKV weight gradient under stream-K with 128x256 and 256x128 tiles, each raster order and
CUTLASS's tile swizzle 1, 2 and 4 (all with the kept workspace)."""
import dataclasses
import sys

from tvm_evt.codegen import bench, select

C, SK, SPLIT = select._cfg, select.SK, select.SPLIT
NONDET = ("args.scheduler.raster_order",
          "args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Nondeterministic;\n"
          "  args.scheduler.raster_order")
VARIANTS = {
    "kept": lambda src: src,
    "per_call": lambda src: src.replace("tvm_evt::launch_kept<Gemm>", "tvm_evt::launch<Gemm>"),
    "nondet": lambda src: src.replace(*NONDET),
}
CONFIGS = [C((128, 128, 64), decomposition=SPLIT, splits=2), C((128, 128, 64), decomposition=SPLIT, splits=3),
           C((128, 256, 64), decomposition=SK), C((128, 128, 64), decomposition=SK),
           C((128, 256, 64), decomposition=SPLIT, splits=2), C((128, 256, 64), (2, 1), decomposition=SK)]


R = select.Raster
QKV_CONFIGS = [C(t, decomposition=SK, raster=r) for t in ((128, 256, 64), (256, 128, 64))
               for r in (R.HEURISTIC, R.ALONG_M, R.ALONG_N)]
SWIZZLE = {f"swizzle{n}": (lambda src, n=n: src.replace(
    "args.scheduler.raster_order", f"args.scheduler.max_swizzle_size = {n};\n  args.scheduler.raster_order"))
    for n in (2, 4)}


def main(mode: str) -> None:
    cases = bench.pick_cases(bench.bert_cases(), "gemm_QKV_dW" if mode == "qkv" else "gemm_QKV_dW,gemm_attnout_dW")
    configs, variants = (QKV_CONFIGS, {"kept": VARIANTS["kept"], **SWIZZLE}) if mode == "qkv" else (CONFIGS, VARIANTS)
    jobs = {}
    for case in cases:
        for cfg in configs:
            src = bench.emit(dataclasses.replace(case.partition, symbol="SYMBOL"), cfg)
            assert "launch_kept<Gemm>" in src
            for variant, edit in variants.items():
                name = f"{case.name}__{cfg.name}__{variant}"
                jobs[name] = (case, edit(src).replace("SYMBOL", name))
    objects, failed, stats = bench.build_tolerant({n: src for n, (_, src) in jobs.items()}, 16)
    print("failed", {k: v[-800:] for k, v in failed.items()}, stats, flush=True)
    lib = bench.load_library(objects)
    th = bench.Torch()
    for case in cases:
        ins = th.inputs(case)
        p = case.problem
        names = sorted(n for n in objects if jobs[n][0] is case)
        errs = {}
        for name in names:
            outs, fn = th.outputs(case.partition), lib[name]
            for _ in range(3):  # repeated launches reuse the kept workspace
                th.refresh(case, ins)
                errs[name] = max(errs.get(name, 0.0), th.checked_call(case, fn, ins, outs))
        for rnd in range(2):
            torch_ms = th.time(lambda: th.mm(p.kind, ins[0], ins[1]), lambda: th.refresh(case, ins), 40, 5)
            print(f"== round {rnd} {case.name} {p.m}x{p.n}x{p.k}: torch {torch_ms:.4f} ms", flush=True)
            for name in names:
                ms = th.time_kernel(case, lib[name], ins, th.outputs(case.partition), 40, 5)
                print(f"{name}: {ms:.4f} ms ({torch_ms / ms:.3f}x torch) err {errs[name]:.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "variants")
