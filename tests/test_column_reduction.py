"""ColumnReduction: sums, maxima and minima over a non-innermost axis, a 16-byte vector of columns
a thread."""
import shutil

import pytest
import tvm
from tvm import te
from tvm.support import nvcc

from _te_kernels import CUDA, assert_matches_llvm_on_gpu, schedule, serial

from tvm_evt.relax_passes.lower.column_reduction import THREADS, ColumnReduction


def _kernels():
    """name -> (te tensors, expected columns a thread; 0: declined)."""
    x3 = te.placeholder((32, 40, 512), "bfloat16", name="x3")  # 32 x 4 thread blocks
    mean = te.placeholder((1, 1, 512), "float32", name="mean")
    x2 = te.placeholder((96, 16384), "bfloat16", name="x2")  # 128 thread blocks
    xf = te.placeholder((64, 16384), "float32", name="xf")
    k40, k96, k64 = te.reduce_axis((0, 40), "k"), te.reduce_axis((0, 96), "k"), te.reduce_axis((0, 64), "k")
    kr = te.reduce_axis((0, 16384), "k")
    xl = te.placeholder((65536, 128), "float32", name="xl")
    kl = te.reduce_axis((0, 65536), "k")
    kv = te.placeholder((2, 8, 4, 1024, 128), "bfloat16", name="kv")  # 2 x 8 x 1024 x 128 / 4: 2^19 threads
    kg = te.reduce_axis((0, 4), "g")
    x33 = te.placeholder((33, 16, 65536), "bfloat16", name="x33")
    xp, kp = te.placeholder((448, 5, 5, 480), "float32", name="xp"), te.reduce_axis((0, 448), "k")
    xq, kq = te.placeholder((128, 196, 96), "bfloat16", name="xq"), te.reduce_axis((0, 196), "k")
    k33 = te.reduce_axis((0, 33), "k")
    xr, kr64 = te.placeholder((128, 64, 148), "float32", name="xr"), te.reduce_axis((0, 64), "k")
    return {
        # grouped-query attention's key gradient: the 4 query heads of a key/value head summed
        "gqa_heads": ([kv, te.compute((2, 8, 1024, 128), lambda b, h, s, d: te.sum(
            kv[b, h, kg, s, d].astype("float32"), axis=kg), name="y")], 4),
        # 33 rows are more than a short reduction takes: row groups
        "rows_33": ([x33, te.compute((16, 65536), lambda m, n: te.sum(x33[k33, m, n].astype("float32"), axis=k33),
                                     name="y")], 4),
        # batch norm's Σ(x - mean)·dy over a split reduction's groups: fp32 mean -> 4 columns
        "batch_norm": ([x3, mean, te.compute((32, 512), lambda g, n: te.sum(
            x3[g, k40, n].astype("float32") * (x3[g, k40, n].astype("float32") - mean[0, 0, n]), axis=k40),
            name="y")], 4),
        # a bias gradient: bf16 rows summed in fp32, 4 columns (as many as a float32x4 accumulator)
        "bias_grad": ([x2, te.compute((16384,), lambda n: te.sum(x2[k96, n].astype("float32"), axis=k96),
                                      name="y")], 4),
        "fp32": ([xf, te.compute((16384,), lambda n: te.sum(xf[k64, n], axis=k64), name="y")], 4),
        # a row sum (the reduced axis innermost) is DLight Reduction's
        "row_sum": ([x2, te.compute((96,), lambda m: te.sum(x2[m, kr].astype("float32"), axis=kr), name="y")], 0),
        # 128 columns: one thread block would do it all (DLight's rule spreads it)
        "few_columns": ([xl, te.compute((128,), lambda n: te.sum(xl[kl, n], axis=kl), name="y")], 0),
        # the column read transposed
        "transposed": ([x2, te.compute((96,), lambda m: te.sum(x2[k96, m].astype("float32"), axis=k96),
                                       name="y")], 0),
        # a max or min down the columns takes the sums' schedule
        "column_max": ([x2, te.compute((16384,), lambda n: te.max(x2[k96, n].astype("float32"), axis=k96),
                                       name="y")], 4),
        "column_min": ([xf, te.compute((16384,), lambda n: te.min(xf[k64, n], axis=k64), name="y")], 4),
        # DLight's Reduction takes no max: one thread block is better than Fallback's thread a column
        "few_columns_max": ([xl, te.compute((128,), lambda n: te.max(xl[kl, n], axis=kl), name="y")], 4),
        # 96 columns: no 32 vectors divide them; a block of 24 threads of 4-column vectors
        "transposed_max": ([x2, te.compute((96,), lambda m: te.max(x2[k96, m].astype("float32"), axis=k96),
                                           name="y")], 4),
        # 480 columns over 25 x 4 blocks of 30 threads (a depthwise 5x5 weight gradient's
        # [G, R, S, K] partial sums); 96 channels of 128 images' 196 pixels (a pool), 24 threads
        "columns_480": ([xp, te.compute((5, 5, 480), lambda a, b, c: te.sum(xp[kp, a, b, c], axis=kp),
                                          name="y")], 4),
        "pool_96": ([xq, te.compute((128, 96), lambda b, c: te.sum(xq[b, kq, c].astype("float32"), axis=kq),
                                    name="y")], 4),
        # 148 columns: 37 float32x4 or 74 float32x2 vectors, no divisor from 16 to 32 threads
        "prime_vectors": ([xr, te.compute((128, 148), lambda b, c: te.sum(xr[b, kr64, c], axis=kr64), name="y")], 0),
    }


def _schedule(tensors):
    return schedule(tensors, ColumnReduction())


@pytest.mark.parametrize("name", list(_kernels()))
def test_takes_column_reductions_and_declines_the_rest(name):
    tensors, lanes = _kernels()[name]
    out = _schedule(tensors)["main"]
    assert (bool(out.attrs) and "tirx.is_scheduled" in out.attrs) == bool(lanes)
    if lanes:
        assert f"T.vectorized({lanes})" in out.script().replace("T.int64(", "(")


@pytest.mark.parametrize("row_groups", [2, 4, 8])
def test_row_groups_are_the_threads_along_y(row_groups):
    """The rows of each thread block's columns go to `row_groups` threads along y (default 4:
    faster than 8 on H100, scripts/bench_tir.py)."""
    tensors, _ = _kernels()["bias_grad"]
    script = schedule(tensors, ColumnReduction(row_groups))["main"].script()
    assert f'T.thread_binding({row_groups}, thread="threadIdx.y")' in script.replace("T.int64(", "(").replace("), thread", ", thread")


@pytest.mark.parametrize("name, short", [("gqa_heads", True), ("rows_33", False), ("bias_grad", False),
                                         ("batch_norm", False)])
def test_short_reductions_are_one_thread_a_column_vector(name, short):
    """At most SHORT_ROWS rows under enough column vectors: each thread sums all the rows of its
    columns (no threads along y, no partial results); more rows, or fewer columns: row groups."""
    tensors, _ = _kernels()[name]
    script = _schedule(tensors)["main"].script().replace("T.int64(", "(").replace("), thread", ", thread")
    assert ('thread="threadIdx.y"' not in script) == short
    assert (f'T.thread_binding({THREADS}, thread="threadIdx.x")' in script) == short
    assert ("rf" in script) != short


@pytest.mark.parametrize("name, threads", [("columns_480", 30), ("pool_96", 24), ("transposed_max", 24),
                                           ("bias_grad", 32)])
def test_blocks_take_whole_columns_without_predicates(name, threads):
    """Where no 32 vectors divide the columns, a block's threads along them divide them instead:
    no partial block, so no predicate (TVM 0.27's cross-thread reduction dropped it from the
    write of the combined sums: idle threads' zeros in the next row, found on the GPU)."""
    script = _schedule(_kernels()[name][0])["main"].script().replace("T.int64(", "(").replace("), thread", ", thread")
    assert f'T.thread_binding({threads}, thread="threadIdx.x")' in script
    assert "T.where" not in script


@pytest.mark.parametrize("name", ["columns_480", "pool_96", "bias_grad"])
def test_column_blocks_sum_every_column_on_the_cpu(name):
    """The schedule's index arithmetic on llvm (thread bindings as serial loops) against the
    unscheduled kernel, outputs poisoned with NaN first."""
    import torch

    tensors, _ = _kernels()[name]
    func = serial(_schedule(tensors)["main"])
    ref = tvm.compile(tvm.IRModule({"main": te.create_prim_func(tensors)}), target="llvm")
    got_kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    x = torch.randn([int(d) for d in tensors[0].shape], dtype=dtypes[str(tensors[0].dtype)])
    got, want = (torch.full([int(d) for d in tensors[-1].shape], float("nan")) for _ in range(2))
    got_kernel["main"](tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(got))
    ref["main"](tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", ["batch_norm", "bias_grad", "fp32", "column_max", "column_min", "gqa_heads",
                                  "columns_480", "pool_96"])
def test_column_reductions_compile_with_nvcc(name):
    tensors, _ = _kernels()[name]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "float4" in src  # the accumulator (and fp32 loads) as 16-byte vectors
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["batch_norm", "bias_grad", "fp32", "gqa_heads", "rows_33", "columns_480", "pool_96"])
def test_column_sums_on_gpu_match_llvm(name):
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["column_max", "column_min", "few_columns_max"])
def test_column_maxima_on_gpu_match_llvm_exactly(name):
    """A max or min in any order is the same value: bit for bit."""
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors)
