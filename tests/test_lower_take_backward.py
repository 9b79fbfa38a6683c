"""LowerTakeBackward: the embedding gradient as a zero fill + atomic scatter-add on CUDA."""
import re

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.op.grad import take_backward

from tvm_evt.relax_passes.lower.lower_take_backward import LowerTakeBackward

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def embedding_grad(rows=100, dim=32, n=64, dtype="bfloat16", axis=0, outer=()):
    bb = relax.BlockBuilder()
    gshape = (*outer, n, dim) if axis == len(outer) else (n, dim)
    xshape = (*outer, rows, dim) if axis == len(outer) else (rows, dim)
    g = relax.Var("g", relax.TensorType(gshape, dtype))
    x = relax.Var("x", relax.TensorType(xshape, dtype))
    i = relax.Var("i", relax.TensorType((n,), "int64"))
    with bb.function("main", [g, x, i]):
        with bb.dataflow():
            out = bb.emit_output(take_backward(g, x, i, axis))
        bb.emit_func_output(out)
    return bb.get()


def test_rewrites_into_one_scheduled_scatter_add_and_a_cast():
    mod = LowerTakeBackward()(embedding_grad())
    text = mod.script()
    assert "take_backward" not in text
    assert "T.cuda.atomic_add" in text and "tirx.is_scheduled" in text
    assert 'R.astype(' in text and 'dtype="bfloat16"' in text  # float32 accumulation, then x's dtype
    (gv,) = [gv for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert gv.name_hint == "scatter_add_100x32_axis0_n64_bfloat16_int64"


def test_float32_table_needs_no_cast_and_equal_shapes_share_a_kernel():
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType((8, 4), "float32"))
    x = relax.Var("x", relax.TensorType((10, 4), "float32"))
    i = relax.Var("i", relax.TensorType((8,), "int32"))
    with bb.function("main", [g, x, i]):
        with bb.dataflow():
            a = bb.emit(take_backward(g, x, i, 0))
            b = bb.emit(take_backward(relax.op.negative(g), x, i, 0))
            out = bb.emit_output(relax.op.add(a, b))
        bb.emit_func_output(out)
    mod = LowerTakeBackward()(bb.get())
    assert "astype" not in mod["main"].script()
    assert sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items()) == 1
    # the kernel writes the table's shape: no reshape (a copy, for a gradient that is a block output)
    text = mod["main"].script()
    assert text.count('out_ty=R.Tensor((10, 4), dtype="float32")') == 2
    assert text.count("R.reshape(") == 2  # each gradient flattened to [1, 8, 4] on the way in, none after


def test_builds_for_cuda_with_atomics():
    mod = LowerTakeBackward()(embedding_grad(outer=(3,), axis=1))
    prim = tvm.IRModule({gv: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)})
    source = tvm.tirx.build(prim, target=CUDA).imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert len(kernels) == 2  # zero fill, then the scatter
    assert "atomicAdd" in source


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,axis,outer", [("float32", 0, ()), ("bfloat16", 0, ()), ("float16", 1, (3,))])
def test_matches_numpy_on_gpu(dtype, axis, outer):
    rows, dim, n = 50, 24, 300  # many repeated indices: atomics collide
    mod = embedding_grad(rows, dim, n, dtype, axis, outer)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(((*outer, n, dim) if outer else (n, dim))).astype("float32")
    idx = rng.integers(0, rows, n).astype("int64")
    x = np.zeros(((*outer, rows, dim) if outer else (rows, dim)), "float32")
    want = np.zeros_like(x)
    np.add.at(want, (slice(None), idx) if outer else idx, g.astype(dtype).astype("float32"))
    ex = tvm.compile(LowerTakeBackward()(mod), target=CUDA)
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(a.astype(dtype), dev) for a in (g, x)] + [tvm.runtime.tensor(idx, dev)]
    got = relax.VirtualMachine(ex, dev)["main"](*args).numpy().astype("float32")
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)
