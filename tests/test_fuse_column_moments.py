"""FuseColumnMoments and column_moments: a batch norm's (or a layer norm's parameter gradients')
two column sums as one pass over their input."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.support import nvcc

from tvm_evt.relax_passes.lower import column_moments as cm
from tvm_evt.relax_passes.graph.fuse_column_moments import LAYER_NORM, FuseColumnMoments

CUDA = {"kind": "cuda", "arch": "sm_90a"}
R = relax.op


def _moments_calls(mod):
    """(PrimFunc name, its spec) of every column-moments call_tir of ``main``, and the sum/mean count."""
    calls, reductions = [], 0
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op == tvm.ir.Op.get("relax.call_tir"):
                func = mod[v.args[0]]
                if func.attrs and cm.MOMENTS_ATTR in func.attrs:
                    calls.append((v.args[0].name_hint, str(func.attrs[cm.MOMENTS_ATTR])))
            elif isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in ("relax.sum", "relax.mean"):
                reductions += 1
    return calls, reductions


def _batch_norm_sums(shape, axes, dtype="bfloat16", shared_dy=False):
    """main(x, dy, mean): the forward moments mean(v), mean(v*v) and the backward sums Σg, Σg·(v - mean)
    (v, g widened to float32; with `shared_dy`, a second backward pair over the same g)."""
    bb = relax.BlockBuilder()
    keep = [1 if i in axes else d for i, d in enumerate(shape)]
    x = relax.Var("x", relax.TensorType(shape, dtype))
    dy = relax.Var("dy", relax.TensorType(shape, dtype))
    mean = relax.Var("mean", relax.TensorType(keep, "float32"))
    with bb.function("main", [x, dy, mean]):
        with bb.dataflow():
            v = bb.emit(R.astype(x, "float32"))
            outs = [bb.emit(R.mean(v, axes, keepdims=True)), bb.emit(R.mean(bb.emit(R.multiply(v, v)), axes, keepdims=True))]
            g = bb.emit(R.astype(dy, "float32"))
            c = bb.emit(R.subtract(v, mean))
            for _ in range(2 if shared_dy else 1):
                outs.append(bb.emit(R.sum(bb.emit(R.astype(dy, "float32")), axes, keepdims=True)))
                outs.append(bb.emit(R.sum(bb.emit(R.multiply(g, c)), axes, keepdims=True)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _run_llvm(mod, args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(a) for a in args])]


def _args(shape, axes, dtype="bfloat16", seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = [1 if i in axes else d for i, d in enumerate(shape)]
    tdt = getattr(torch, dtype)
    x, dy = (torch.randn(shape, generator=g).to(tdt) + 0.5 for _ in range(2))
    mean = torch.randn(keep, generator=g)
    return [tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(dy), mean.numpy()], (x, dy, mean)


@pytest.mark.parametrize("shared_dy", [False, True])
def test_pairs_become_one_call_each_and_compute_the_same(shared_dy):
    shape, axes = (4, 6, 5, 16), [0, 1, 2]
    before = _batch_norm_sums(shape, axes, shared_dy=shared_dy)
    after = relax.transform.DeadCodeElimination()(FuseColumnMoments()(before))
    calls, reductions = _moments_calls(after)
    assert reductions == 0
    assert [name.startswith("column_moments_centered") for name, _ in calls] == [False] + [True] * (2 if shared_dy else 1)
    args, (x, dy, mean) = _args(shape, axes)
    got, want = _run_llvm(after, args), _run_llvm(before, args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # and against float64 torch
    x64, dy64, m64 = x.double(), dy.double(), mean.double()
    ref = [x64.mean(axes, keepdim=True), (x64 * x64).mean(axes, keepdim=True),
           dy64.sum(axes, keepdim=True), (dy64 * (x64 - m64)).sum(axes, keepdim=True)]
    for g, w in zip(got, ref):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)


def test_left_alone_when_the_channels_are_not_last():
    mod = _batch_norm_sums((4, 16, 5, 6), [0, 2, 3])  # NCHW: the reduced axes are not the leading ones
    calls, reductions = _moments_calls(FuseColumnMoments()(mod))
    assert calls == [] and reductions == 4


def test_left_alone_when_the_channels_are_not_a_multiple_of_the_lanes():
    calls, reductions = _moments_calls(FuseColumnMoments()(_batch_norm_sums((4, 6, 5, 18), [0, 1, 2])))
    assert calls == [] and reductions == 4


@pytest.mark.parametrize("shape", [(128, 28, 28, 512), (128, 56, 56, 128), (3, 37, 16), (1, 8)])
def test_grid_covers_the_rows(shape):
    col_blocks, row_blocks, rows = cm.grid(shape)
    m = int(np.prod(shape[:-1]))
    assert rows % (cm.TY * cm.UNROLL) == 0 and (row_blocks - 1) * rows < m <= row_blocks * rows
    assert col_blocks * cm.LANES * cm.TX >= shape[-1]
    if shape == (128, 28, 28, 512):  # ResNet-50 conv3_x: row blocks that tile the rows, no guards
        assert m == row_blocks * rows and col_blocks * row_blocks <= cm.TARGET_BLOCKS


def _gpu_source(shape, kind, out=None):
    func = cm.moments_gpu_primfunc(shape, ["bfloat16", "bfloat16"], kind, out).with_attr("global_symbol", "k")
    return tvm.compile(tvm.IRModule({"k": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()


@pytest.mark.parametrize("kind", cm.KINDS)
def test_gpu_form_reads_each_input_once_as_vectors(kind):
    src = _gpu_source((128, 28, 28, 512), kind)
    loads = src.count("*(nv_bfloat164*)(")  # one 8-byte vector load of each input a row
    assert loads == cm.UNROLL * (1 if kind == "moments" else 2) * 2  # ... written as a load and a store to registers
    kernels = set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', src))
    assert "__syncthreads()" in src and len(kernels) == 2, kernels  # the partials, then their sums


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_gpu_form_compiles_with_nvcc():
    src = _gpu_source((3, 37, 16), "centered")  # ragged: the row guards
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    src = _gpu_source((3, 37, 16), "normalized", [16])
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 14, 14, 512), (3, 37, 16), (8, 28, 28, 128)])
@pytest.mark.parametrize("kind", cm.KINDS)
def test_gpu_form_matches_float64(shape, kind):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    c = shape[-1]
    out = [c] if kind == "normalized" else cm.keep_shape(shape)  # a layer norm's dgamma is [C]
    func = cm.moments_gpu_primfunc(shape, ["bfloat16", "bfloat16"], kind, out).with_attr("global_symbol", "k")
    lib = tvm.compile(tvm.IRModule({"k": func}), target=tvm.target.Target(CUDA))
    _, row_blocks, _ = cm.grid(shape)
    a, b = (torch.randn(shape, device="cuda").bfloat16() + 0.5 for _ in range(2))
    mean = torch.randn(cm.row_shape(shape) if kind == "normalized" else cm.keep_shape(shape), device="cuda")
    rstd = torch.rand(cm.row_shape(shape), device="cuda") + 0.5
    outs = [torch.full(out, float("nan"), device="cuda") for _ in range(2)]
    outs += [torch.full((row_blocks, c), float("nan"), device="cuda") for _ in range(2)]
    ins = {"moments": [a], "centered": [a, b, mean], "normalized": [a, b, mean, rstd]}[kind]
    lib["k"](*[tvm.runtime.from_dlpack(t) for t in ins + outs])
    torch.cuda.synchronize()
    a64, b64 = a.double().reshape(-1, c), b.double().reshape(-1, c)
    second = {"moments": lambda: a64 * a64,
              "centered": lambda: a64 * (b64 - mean.double().reshape(c)),
              "normalized": lambda: a64 * ((b64 - mean.double().reshape(-1, 1)) * rstd.double().reshape(-1, 1))}[kind]
    want = [a64.sum(0), second().sum(0)]
    for got, w in zip(outs, want):
        torch.testing.assert_close(got.double().reshape(c), w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))
    for p, s in zip(outs[2:], outs[:2]):  # the partials add up to the sums
        torch.testing.assert_close(p.sum(0), s.reshape(c), rtol=1e-5, atol=1e-3)


def _layer_norm_param_grads(shape, g_dtype="float32", x_dtype="bfloat16", keepdims=False, rstd_shape=None,
                            dbeta_axes=None, g_of=None):
    """main(g, x, mean, rstd): a layer norm's dgamma = Σ g·((x - mean)·rstd) and dbeta = Σ g over the
    rows, as FuseLayerNorm leaves them (x widened from its bf16 form, mean and rstd per row).  The
    variants: rstd of `rstd_shape`, dbeta over `dbeta_axes`, the sums over ``g_of(g)``."""
    bb = relax.BlockBuilder()
    axes = list(range(len(shape) - 1))
    g = relax.Var("g", relax.TensorType(shape, g_dtype))
    x = relax.Var("x", relax.TensorType(shape, x_dtype))
    mean = relax.Var("mean", relax.TensorType(cm.row_shape(shape), "float32"))
    rstd = relax.Var("rstd", relax.TensorType(rstd_shape or cm.row_shape(shape), "float32"))
    with bb.function("main", [g, x, mean, rstd]):
        with bb.dataflow():
            dy = bb.emit(g_of(g)) if g_of else g
            xf = bb.emit(R.astype(x, "float32")) if x_dtype != "float32" else x
            xhat = bb.emit(R.multiply(bb.emit(R.subtract(xf, mean)), rstd))
            dgamma = bb.emit(R.sum(bb.emit(R.multiply(dy, xhat)), axes, keepdims=keepdims))
            dbeta = bb.emit(R.sum(dy, dbeta_axes or axes, keepdims=keepdims))
            out = bb.emit_output(relax.Tuple([dgamma, dbeta]))
        bb.emit_func_output(out)
    return bb.get()


def _ln_args(shape, g_dtype, x_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen).to(getattr(torch, g_dtype))
    x = (torch.randn(shape, generator=gen) * 2 + 1).to(getattr(torch, x_dtype))
    mean = torch.randn(cm.row_shape(shape), generator=gen)
    rstd = torch.rand(cm.row_shape(shape), generator=gen) + 0.5
    return [g, x, mean, rstd]


@pytest.mark.parametrize("g_dtype,x_dtype,keepdims", [("float32", "bfloat16", False), ("float32", "float32", False),
                                                     ("float32", "bfloat16", True)])
def test_layer_norm_parameter_gradients_become_one_call(g_dtype, x_dtype, keepdims):
    shape = (3, 40, 32)
    before = _layer_norm_param_grads(shape, g_dtype, x_dtype, keepdims)
    assert _moments_calls(FuseColumnMoments()(before))[0] == []  # the default pairs are the batch norm's
    after = FuseColumnMoments(LAYER_NORM, stored=True)(before)
    calls, reductions = _moments_calls(after)
    assert reductions == 0 and [name for name, _ in calls] == ["column_moments_normalized"]
    spec = json.loads(calls[0][1])
    assert spec["kind"] == "normalized" and spec["dtypes"] == [g_dtype, x_dtype]  # x read in bf16, not widened
    assert spec["out"] == (cm.keep_shape(shape) if keepdims else [shape[-1]])
    ops = {b.value.op.name for block in after["main"].body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}
    assert ops == {"relax.call_tir"}, ops  # the products only the sums read are gone
    args = _ln_args(shape, g_dtype, x_dtype)
    tvm_args = [tvm.runtime.from_dlpack(t) for t in args]
    got, want = _run_llvm(after, tvm_args), _run_llvm(before, tvm_args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    g64, x64, m64, r64 = (t.double() for t in args)
    axes = list(range(len(shape) - 1))
    ref = [(g64 * ((x64 - m64) * r64)).sum(axes, keepdim=keepdims), g64.sum(axes, keepdim=keepdims)]
    for a, w in zip(got, ref):
        np.testing.assert_allclose(a, w.numpy(), rtol=1e-4, atol=1e-4)


def test_layer_norm_pair_left_alone_when_the_statistics_are_per_channel_or_the_sums_differ():
    shape = (3, 40, 32)
    # rstd per channel ([1, 1, C]), not per row: no kernel form reads it that way
    per_channel = _layer_norm_param_grads(shape, rstd_shape=cm.keep_shape(shape))
    # the two sums over different rows (dgamma over all, dbeta over the last axis only)
    other_rows = _layer_norm_param_grads(shape, dbeta_axes=[1])
    for mod in (per_channel, other_rows):
        assert _moments_calls(FuseColumnMoments(LAYER_NORM)(mod)) == ([], 2)


def test_stored_pairs_only_read_what_a_kernel_writes_anyway():
    """With stored=True a pair whose g is an elementwise value (BERT-Large's loss gradient, which
    each sum recomputes) is left alone: one kernel reading it would have it written for it alone."""
    mod = _layer_norm_param_grads((3, 40, 32), g_of=lambda g: R.add(g, g))
    assert _moments_calls(FuseColumnMoments(LAYER_NORM, stored=True)(mod)) == ([], 2)
    assert len(_moments_calls(FuseColumnMoments(LAYER_NORM)(mod))[0]) == 1
    # a reshape of a stored tensor is stored (GPT-2's first layer norm reads a view of a kernel's output)
    view = _layer_norm_param_grads((3, 40, 32), g_of=lambda g: R.reshape(g, (3, 40, 32)))
    assert len(_moments_calls(FuseColumnMoments(LAYER_NORM, stored=True)(view))[0]) == 1
    with pytest.raises(ValueError, match="unknown pair"):
        FuseColumnMoments(("layer norm",))(mod)


@pytest.mark.parametrize("kernel_reads_x", [True, False])
def test_stored_counts_what_a_kernel_of_its_own_reads(kernel_reads_x):
    """x computed by an elementwise op (ViT-B/16's bf16 input, cast from float32) is in memory
    when a kernel of its own (a call_tir / call_dps_packed) also reads it: then the pair reads it."""
    shape = (3, 40, 32)
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType(shape, "float32"))
    x32 = relax.Var("x32", relax.TensorType(shape, "float32"))
    mean = relax.Var("mean", relax.TensorType(cm.row_shape(shape), "float32"))
    rstd = relax.Var("rstd", relax.TensorType(cm.row_shape(shape), "float32"))
    with bb.function("main", [g, x32, mean, rstd]):
        with bb.dataflow():
            x = bb.emit(R.astype(x32, "bfloat16"))
            outs = [bb.emit(relax.call_dps_packed("layer_norm_kernel", x, x.ty))] if kernel_reads_x else []
            xhat = bb.emit(R.multiply(bb.emit(R.subtract(bb.emit(R.astype(x, "float32")), mean)), rstd))
            outs.append(bb.emit(R.sum(bb.emit(R.multiply(g, xhat)), [0, 1])))
            outs.append(bb.emit(R.sum(g, [0, 1])))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    calls, reductions = _moments_calls(FuseColumnMoments(LAYER_NORM, stored=True)(bb.get()))
    assert (len(calls), reductions) == ((1, 0) if kernel_reads_x else (0, 2))
