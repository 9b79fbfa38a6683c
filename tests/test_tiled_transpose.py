"""TiledTranspose: injective kernels with one transposed operand, through shared-memory tiles."""
import shutil

import pytest
import tvm
from tvm import te, tirx
from tvm.support import nvcc

from _te_kernels import CUDA, assert_matches_llvm_on_gpu, schedule

from tvm_evt.relax_passes.lower.tiled_transpose import TiledTranspose


def _kernels():
    """name -> (te tensors, expected (tj, tk) tile; None: declined)."""
    nchw = te.placeholder((2, 64, 14, 56), "float32", name="nchw")
    nhwc = te.placeholder((2, 14, 56, 64), "bfloat16", name="nhwc")
    nchw28 = te.placeholder((2, 64, 4, 28), "float32", name="nchw28")
    x = te.placeholder((96, 40), "float32", name="x")
    odd = te.placeholder((6, 35), "float32", name="odd")
    return {
        # ResNet's input: fp32 NCHW -> bf16 NHWC
        "cast_to_nhwc": ([nchw, te.compute((2, 14, 56, 64), lambda n, h, w, c: nchw[n, c, h, w].astype("bfloat16"),
                                           name="y")], (8, 64)),
        # ResNet's loss: an NHWC activation minus an NCHW target, the activation read in order
        "nhwc_minus_nchw": ([nhwc, nchw, te.compute(
            (2, 14, 56, 64), lambda n, h, w, c: nhwc[n, h, w, c].astype("float32") - nchw[n, c, h, w], name="y")],
            (8, 64)),
        # ResNet's 28-wide target rows: no tile divides 28, the whole row is one
        "rows_of_28": ([nchw28, te.compute((2, 4, 28, 64), lambda n, h, w, c: nchw28[n, c, h, w], name="y")], (28, 64)),
        "matrix": ([x, te.compute((40, 96), lambda i, j: x[j, i] * tirx.const(2.0, "float32"), name="y")], (8, 32)),
        # in order: nothing to tile
        "copy": ([x, te.compute((96, 40), lambda i, j: x[i, j], name="y")], None),
        # a diagonal is not a permutation of the iterators
        "diagonal": ([x, te.compute((40, 40), lambda i, j: x[i, i], name="y")], None),
        # no tile divides 35
        "odd": ([odd, te.compute((35, 6), lambda i, j: odd[j, i], name="y")], None),
    }


def _schedule(tensors):
    return schedule(tensors, TiledTranspose())


@pytest.mark.parametrize("name", list(_kernels()))
def test_tiles_transposed_reads_and_declines_the_rest(name):
    tensors, tile = _kernels()[name]
    out = _schedule(tensors)["main"]
    assert (bool(out.attrs) and "tirx.is_scheduled" in out.attrs) == (tile is not None)
    if tile:
        script = out.script()
        assert 'scope="shared"' in script
        tj, _ = tile
        assert f", {tj}, 1]]" in script  # the tile's rows padded to tj + 1 (buffer_dim_align)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", ["cast_to_nhwc", "nhwc_minus_nchw", "rows_of_28", "matrix"])
def test_tiled_kernels_compile_with_nvcc(name):
    tensors, (tj, _) = _kernels()[name]
    src = tvm.compile(_schedule(tensors), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "__shared__" in src and "__syncthreads" in src
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cast_to_nhwc", "nhwc_minus_nchw", "rows_of_28", "matrix"])
def test_tiled_kernels_on_gpu_match_the_cpu(name):
    tensors, _ = _kernels()[name]
    assert_matches_llvm_on_gpu(_schedule(tensors), tensors)
