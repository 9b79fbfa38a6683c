"""RowReduction: sums over the innermost axis, 16-byte vectors of a row a thread's load."""
import shutil

import pytest
import tvm
from tvm import te
from tvm.support import nvcc

from _te_kernels import CUDA, assert_matches_llvm_on_gpu, schedule

from tvm_evt.relax_passes.lower.row_reduction import RowReduction


def _kernels():
    """name -> (te tensors, expected elements a thread's load; 0: declined)."""
    y = te.placeholder((512, 1024), "bfloat16", name="y")
    t = te.placeholder((512, 1024), "float32", name="t")
    b = te.placeholder((384, 3, 512), "bfloat16", name="b")
    w = te.placeholder((384, 3), "float32", name="w")
    k, k3 = te.reduce_axis((0, 1024), "k"), te.reduce_axis((0, 512), "k")
    few = te.placeholder((16, 65536), "float32", name="few")
    kf = te.reduce_axis((0, 65536), "k")
    odd = te.placeholder((512, 1000), "float32", name="odd")
    ko = te.reduce_axis((0, 1000), "k")
    col = te.placeholder((1024, 512), "bfloat16", name="col")
    kc = te.reduce_axis((0, 1024), "k")
    return {
        # a split MSE loss: bf16 output, float32 target, summed in float32 -> 4 elements a load
        "mse": ([y, t, te.compute((512,), lambda m: te.sum(
            (y[m, k].astype("float32") - t[m, k]) * (y[m, k].astype("float32") - t[m, k]), axis=k), name="s")], 4),
        # two spatial axes and a per-row factor that does not use the reduced axis
        "scaled_rows": ([b, w, te.compute((384, 3), lambda i, j: te.sum(
            b[i, j, k3].astype("float32") * w[i, j], axis=k3), name="s")], 4),
        # 16 rows: DLight's rule spreads a row over a block and more
        "few_rows": ([few, te.compute((16,), lambda m: te.sum(few[m, kf], axis=kf), name="s")], 0),
        # a row no multiple of 32 vectors
        "odd_length": ([odd, te.compute((512,), lambda m: te.sum(odd[m, ko], axis=ko), name="s")], 0),
        # the reduced axis is not the innermost: ColumnReduction's
        "column_sum": ([col, te.compute((512,), lambda n: te.sum(col[kc, n].astype("float32"), axis=kc),
                                        name="s")], 0),
        # a max is not a sum
        "row_max": ([t, te.compute((512,), lambda m: te.max(t[m, k], axis=k), name="s")], 0),
    }


def _schedule(tensors):
    return schedule(tensors, RowReduction())


@pytest.mark.parametrize("name", list(_kernels()))
def test_takes_row_sums_and_declines_the_rest(name):
    tensors, lanes = _kernels()[name]
    out = _schedule(tensors)["main"]
    assert (bool(out.attrs) and "tirx.is_scheduled" in out.attrs) == bool(lanes)
    if lanes:
        script = out.script().replace("T.int64(", "(")
        assert f"T.vectorized({lanes})" in script
        assert 'thread="threadIdx.x"' in script and 'thread="blockIdx.x"' in script


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", ["mse", "scaled_rows"])
def test_row_sums_compile_with_nvcc(name):
    tensors, _ = _kernels()[name]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "float4" in src  # the accumulator (and float32 loads) as 16-byte vectors
    assert "__shfl_down_sync" in src  # the threads' sums added across the block
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mse", "scaled_rows"])
def test_row_sums_on_gpu_match_llvm(name):
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors, rtol=1e-5)
