"""Time a model's scheduled TIR kernels one by one on the GPU (``scripts/bench_tir.py``).

The training step's TVM kernels as the CUDA route schedules them (``ScheduleTIRForGPU``; CUTLASS
partitions and flash-attention calls left out, no nvcc), each compiled alone and timed on fresh
random inputs: CUDA events around `LAUNCHES` back-to-back launches (the GPU never waits on the
host), the median of `ITERS` such pairs.  Inputs small enough for the L2 cache (50 MB on H100)
stay there between launches, so the rates of small kernels are above what the step sees; compare
schedules by it, not against HBM.  ``--dlight`` times each kernel under DLight's rules alone too
(``ScheduleTIRForGPU`` without ours, as the ``tvm_default`` baseline schedules it): what a kernel
our rules do not take would get, e.g. a cross-entropy's max over the vocabulary before
``RowReduction`` took maxima (``Fallback``: one thread a row).

    python scripts/bench_tir.py bert_large --match sum --column-rows 2,4,8
    python scripts/bench_tir.py hf_llama --match max --dlight
    python scripts/bench_tir.py hf_llama --match rms_norm_grad --norm-blocks 264,1056,2112,100000
    python scripts/bench_tir.py timm_effnet_b0 --match "wgrad|sum|transpose|permute" --wgrad-threads 67584 --wgrad-columns 0

``--wgrad-threads``: the depthwise weight gradients' first stage (``depthwise_conv_op.wgrad_grid``)
cut for about that many threads in all (by default ``TARGET_THREADS``): fewer line groups, each
walking more lines, and fewer float32 partial sums for the second stage to add.
``--wgrad-columns``: the partial sums laid out [G, R, S, K] where R·S·K is at least the value
(``depthwise_conv_op.COLUMN_PARTIALS``, by default 3072; 0: every weight gradient), a warp's
stores of a tap contiguous, the second stage a column sum and a transpose of the taps; below it
[K, R, S, G], a thread's R·S·2 sums R·S·G floats apart (for a 5x5 filter 50 scattered 4-byte
stores).
``--set 'module.NAME=value ...'`` (repeatable): a variant with any module constants of the
``relax_passes`` stages set together, e.g. both of the above:
``--set 'depthwise_conv_op.TARGET_THREADS=67584 depthwise_conv_op.COLUMN_PARTIALS=0'``.
"""

from __future__ import annotations

import argparse
import re
import sys

import tvm

from .training import hopper_target

LAUNCHES = 20
ITERS = 15
DLIGHT = "dlight"  # the variant scheduled by DLight's rules alone


def scheduled_kernels(model: str, precision: str = "bf16", column_rows: list[int | None] = (None,),
                      match: str = "", dlight: bool = False, quick: bool = False,
                      norm_blocks: list[int] = (), wgrad_threads: list[int] = (), wgrad_columns: list[int] = (),
                      settings: list[str] = (), entry=None) -> dict:
    """``{variant: {kernel name: PrimFunc}}``: the model's TIR kernels whose names match `match`
    (at --quick's size with `quick`), scheduled with each ``ColumnReduction`` row-group count
    (variant: the count, None for its default) and, with `dlight`, by DLight's rules alone
    (variant ``DLIGHT``).  Each of `norm_blocks` (the norm gradient kernels' least thread blocks,
    ``_row_kernel.GROUP_BLOCKS``, by default one full residency of the GPU: the more, the fewer rows a
    block walks; a large one, no weight-gradient partials) adds the variant ``f"blocks={value}"``, scheduled as by default,
    and each of `wgrad_threads` (the depthwise weight gradients' first-stage thread target, ``TARGET_THREADS``) the
    variant ``f"wgrad_threads={value}"``, each of `wgrad_columns` (``COLUMN_PARTIALS``) ``f"wgrad_columns={value}"``,
    and each of `settings` (``"module.NAME=value ..."``, ``parse_setting``) the variant named by it.
    `entry`: a ZooEntry to take instead of the bench model's."""
    from . import bench_e2e, optim, tuning
    from .relax_passes.lower import _row_kernel
    from .relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU
    from .relax_passes.ops import depthwise_conv_op

    entry = entry or bench_e2e.build_entry(model, quick)
    target = hopper_target()
    _, graph = tuning.training_graph(entry, precision, optim.AdamW(lr=1e-4), target)  # as scripts/bench.py
    before, schedule = tuning.until_scheduling(target)
    variants = {rows: ScheduleTIRForGPU(vectorize=schedule.vectorize, column_rows=rows)
                for rows in column_rows}
    if dlight:
        variants[DLIGHT] = ScheduleTIRForGPU()
    pick = lambda mod: {gv.name_hint: f for gv, f in mod.functions_items()  # noqa: E731
                        if isinstance(f, tvm.tirx.PrimFunc) and re.search(match, gv.name_hint)}
    with target:
        fused = tvm.transform.Sequential(before)(graph.mod)
        out = {variant: pick(scheduler(fused)) for variant, scheduler in variants.items()}
        knobs = [(f"blocks={value}", [(_row_kernel, "GROUP_BLOCKS", value)]) for value in norm_blocks]
        knobs += [(f"wgrad_threads={value}", [(depthwise_conv_op, "TARGET_THREADS", value)]) for value in wgrad_threads]
        knobs += [(f"wgrad_columns={value}", [(depthwise_conv_op, "COLUMN_PARTIALS", value)]) for value in wgrad_columns]
        knobs += [(setting, parse_setting(setting)) for setting in settings]
        for variant, assignments in knobs:  # set while the graph is legalized and scheduled again
            defaults = [(module, name, getattr(module, name)) for module, name, _ in assignments]
            try:
                for module, name, value in assignments:
                    setattr(module, name, value)
                out[variant] = pick(variants[column_rows[0]](tvm.transform.Sequential(before)(graph.mod)))
            finally:
                for module, name, value in reversed(defaults):
                    setattr(module, name, value)
    return out


def parse_setting(setting: str) -> list[tuple]:
    """``"depthwise_conv_op.TX=16 _row_kernel.GROUP_BLOCKS=264"`` -> [(module, name, value)]: module-level
    constants of ``tvm_evt.relax_passes``' stages (a module named by its file, found in any stage) set
    together for one variant; values are Python literals (``None``, ints, tuples)."""
    import ast
    import importlib
    import importlib.util
    import pkgutil

    from . import relax_passes

    stages = [f"{relax_passes.__name__}.{m.name}" for m in pkgutil.iter_modules(relax_passes.__path__) if m.ispkg]
    out = []
    for item in setting.split():
        target, sep, literal = item.partition("=")
        file, _, name = target.rpartition(".")
        if not sep or not file:
            raise ValueError(f"bench_tir --set: {item!r} is not module.NAME=value")
        found = [f"{stage}.{file}" for stage in stages if importlib.util.find_spec(f"{stage}.{file}") is not None]
        if len(found) != 1:
            raise ValueError(f"bench_tir --set: {file!r} names {len(found)} modules of tvm_evt.relax_passes' stages")
        module = importlib.import_module(found[0])
        if not hasattr(module, name):
            raise ValueError(f"bench_tir --set: {module.__name__} has no {name}")
        out.append((module, name, ast.literal_eval(literal)))
    return out


def time_kernel(func, target) -> tuple[float, int]:
    """(median ms a launch, bytes of its buffers) for one scheduled PrimFunc on CUDA device 0."""
    import torch

    from .codegen.bench import median_ms

    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    tensors = []
    for p in func.params:
        shape, dtype = [int(s) for s in p.shape], getattr(torch, str(p.dtype))
        tensors.append(torch.randn(shape, device="cuda").to(dtype) if dtype.is_floating_point
                       else torch.zeros(shape, device="cuda", dtype=dtype))
    args = [tvm.runtime.from_dlpack(t) for t in tensors]
    fn = lib["main"]

    def launches():
        for _ in range(LAUNCHES):
            fn(*args)

    ms = median_ms(launches, refresh=lambda: None, iters=ITERS, warmup=1) / LAUNCHES
    return ms, sum(t.numel() * t.element_size() for t in tensors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_tir.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a scripts/bench.py model (tvm_evt.bench_e2e.MODELS)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--match", default="", help="regular expression the kernel names must contain")
    ap.add_argument("--column-rows", default="",
                    help="comma-separated ColumnReduction row-group counts to compare (default: its own)")
    ap.add_argument("--dlight", action="store_true",
                    help="also time each kernel as DLight's rules alone schedule it (without ours)")
    ap.add_argument("--quick", action="store_true", help="the model at scripts/bench.py --quick's size")
    ap.add_argument("--norm-blocks", default="",
                    help="comma-separated thread-block targets of the norm gradient kernels with weight-gradient "
                         "partials to compare (_row_kernel.GROUP_BLOCKS; by default one full residency of the GPU; "
                         "a large one: no partials)")
    ap.add_argument("--wgrad-threads", default="",
                    help="comma-separated first-stage thread targets of the depthwise weight gradients to compare "
                         "(depthwise_conv_op.TARGET_THREADS; fewer: fewer line groups and partial sums)")
    ap.add_argument("--wgrad-columns", default="",
                    help="comma-separated least R·S·K for the depthwise weight gradients' partial sums laid out "
                         "[G, R, S, K] (depthwise_conv_op.COLUMN_PARTIALS; 0: all)")
    ap.add_argument("--set", action="append", default=[], metavar="'module.NAME=value ...'",
                    help="a variant with these module constants of tvm_evt.relax_passes set together "
                         "(e.g. 'depthwise_conv_op.TARGET_THREADS=67584 depthwise_conv_op.COLUMN_PARTIALS=0'); repeatable")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = [int(r) for r in args.column_rows.split(",") if r] or [None]
    target = hopper_target()
    blocks = [int(b) for b in args.norm_blocks.split(",") if b]
    threads = [int(t) for t in args.wgrad_threads.split(",") if t]
    columns = [int(c) for c in args.wgrad_columns.split(",") if c]
    kernels = scheduled_kernels(args.model, args.precision, rows, args.match, args.dlight, args.quick, blocks, threads,
                                columns, args.set)
    print(f"{torch.cuda.get_device_name(0)}; us a launch (TB/s of its buffers)")
    for name in sorted(set().union(*kernels.values())):
        cells = []
        for variant, funcs in kernels.items():
            if name in funcs:
                ms, nbytes = time_kernel(funcs[name], target)
                label = variant if isinstance(variant, str) else f"rows={variant}"
                cells.append(f"{label}: {ms * 1e3:7.1f} us ({nbytes / ms / 1e9:4.2f})")
        print(f"{name[:72]:72s} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
