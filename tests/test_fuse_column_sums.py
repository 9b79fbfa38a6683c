"""FuseColumnSums and column_sums: column (and total) sums of values recomputed from the same
tensors as one pass over them -- BERT-Large's loss and its last layer norm's dgamma and dbeta."""

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

from tvm_evt.relax_passes.lower import column_sums as cs
from tvm_evt.relax_passes.lower.fuse_column_sums import FuseColumnSums

CUDA = {"kind": "cuda", "arch": "sm_90a"}
R = relax.op
F32 = "float32"


def _sums_calls(mod, fn="main"):
    """(the spec of every column_sums call_tir of `fn`, the sum/mean calls left)."""
    calls, reductions = [], []
    for block in mod[fn].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op == tvm.ir.Op.get("relax.call_tir"):
                func = mod[v.args[0]]
                if func.attrs and cs.SUMS_ATTR in func.attrs:
                    calls.append(json.loads(str(func.attrs[cs.SUMS_ATTR])))
            elif isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in ("relax.sum", "relax.mean"):
                reductions.append([int(d) for d in v.args[0].ty.shape.values])
    return calls, reductions


def _loss_and_ln_grads(shape, total="mean", late_target=None):
    """main(x, mean, rstd, gamma, beta, t) as the CUDA route leaves BERT-Large's loss: the layer
    norm's output y recomputed from its bf16 input in three copies, the MSE loss of y against t
    (a `total` over every axis) and its gradient g = 2 (y - t) / N summed over the rows twice
    (dgamma = Σ g·xhat, dbeta = Σ g).  `late_target(bb, t)`: the gradient's t, bound after the loss."""
    bb = relax.BlockBuilder()
    row = list(shape[:-1]) + [1]
    x = relax.Var("x", relax.TensorType(shape, "bfloat16"))
    mean, rstd = (relax.Var(n, relax.TensorType(row, F32)) for n in ("mean", "rstd"))
    gamma, beta = (relax.Var(n, relax.TensorType([1] * (len(shape) - 1) + [shape[-1]], F32)) for n in ("gamma", "beta"))
    t_in = relax.Var("t", relax.TensorType(shape, F32))
    axes = list(range(len(shape) - 1))
    scale = relax.const(1.0 / np.prod(shape), F32)
    with bb.function("main", [x, mean, rstd, gamma, beta, t_in]):
        with bb.dataflow():
            t = t_in

            def xhat():
                return bb.emit(R.multiply(bb.emit(R.subtract(bb.emit(R.astype(x, F32)), mean)), rstd))

            def error(xh):
                return bb.emit(R.subtract(bb.emit(R.add(bb.emit(R.multiply(xh, gamma)), beta)), t))

            e = error(xhat())
            loss = bb.emit(getattr(R, total)(bb.emit(R.multiply(e, e))))
            if late_target:
                t = bb.emit(late_target(t_in))
            xh = xhat()
            g1 = bb.emit(R.multiply(scale, error(xh)))
            dgamma = bb.emit(R.sum(bb.emit(R.multiply(bb.emit(R.add(g1, g1)), xh)), axes))
            g2 = bb.emit(R.multiply(scale, error(xhat())))
            dbeta = bb.emit(R.sum(bb.emit(R.add(g2, g2)), axes))
            out = bb.emit_output(relax.Tuple([loss, dgamma, dbeta]))
        bb.emit_func_output(out)
    return bb.get()


def _args(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    row = list(shape[:-1]) + [1]
    vec = [1] * (len(shape) - 1) + [shape[-1]]
    x = (torch.randn(shape, generator=gen) * 2 + 1).bfloat16()
    mean, rstd = torch.randn(row, generator=gen), torch.rand(row, generator=gen) + 0.5
    gamma, beta, t = torch.randn(vec, generator=gen), torch.randn(vec, generator=gen), torch.randn(shape, generator=gen)
    return [x, mean, rstd, gamma, beta, t]


def _run_llvm(mod, args):
    ex = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.from_dlpack(a) for a in args])
    return [o.numpy() for o in out]


@pytest.mark.parametrize("total", ["mean", "sum"])
def test_loss_and_layer_norm_gradients_become_one_call(total):
    shape = (3, 40, 32)
    before = _loss_and_ln_grads(shape, total)
    after = FuseColumnSums()(before)
    calls, reductions = _sums_calls(after)
    assert len(calls) == 1 and reductions == [[shape[-1]]], (calls, reductions)  # the loss: a sum of the C sums
    spec = calls[0]
    assert len(spec["terms"]) == 3 and spec["outs"] == [[shape[-1]]] * 3
    # each tensor read once: x (bf16, not widened), mean, rstd, gamma, beta, t
    assert [dt for _, dt in spec["leaves"]] == ["bfloat16", F32, F32, F32, F32, F32]
    assert [cs.leaf_class(s, shape) for s, _ in spec["leaves"]] == ["full", "row", "row", "col", "col", "full"]
    big = [b for block in after["main"].body.blocks for b in block.bindings
           if isinstance(b.var.ty, relax.TensorType) and [int(d) for d in b.var.ty.shape.values] == list(shape)]
    assert big == [], [b.var for b in big]  # the recomputations only the sums read are gone
    args = _args(shape)
    got, want = _run_llvm(after, args), _run_llvm(before, args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    x, mean, rstd, gamma, beta, t = (a.double() for a in args)
    xhat = (x - mean) * rstd
    e = xhat * gamma + beta - t
    g = 2 * e / e.numel()
    ref = [(e * e).mean() if total == "mean" else (e * e).sum(), (g * xhat).sum((0, 1)), g.sum((0, 1))]
    for a, w in zip(got, ref):
        np.testing.assert_allclose(a, w.numpy(), rtol=1e-4, atol=1e-6)


def test_left_alone_when_alone_or_reading_what_nothing_stores():
    shape = (3, 40, 32)
    # a lone sum: the reduction schedules take it
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(R.sum(bb.emit(R.astype(x, F32)), [0, 1]))
        bb.emit_func_output(out)
    assert _sums_calls(FuseColumnSums()(bb.get())) == ([], [[*shape]])
    # the gradient's target a kernel's output bound after the loss: the loss's call would not find it
    # bound, so the loss stays a reduction and dgamma and dbeta pair
    late = _loss_and_ln_grads(shape, late_target=lambda t: relax.call_dps_packed("copy", t, t.ty))
    calls, reductions = _sums_calls(FuseColumnSums()(late))
    assert len(calls) == 1 and len(calls[0]["terms"]) == 2 and reductions == [list(shape)], (calls, reductions)
    # ... computed by an op no kernel takes in (not stored: one kernel would have it written for it alone)
    relu = _loss_and_ln_grads(shape, late_target=R.nn.relu)
    calls, reductions = _sums_calls(FuseColumnSums()(relu))
    assert calls == [] and len(reductions) == 3, (calls, reductions)


def test_sums_in_different_dataflow_blocks_stay_apart():
    """A call's outputs are dataflow vars of its block: sums of two blocks are not one group."""
    shape = (3, 40, 32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "bfloat16"))
    t = relax.Var("t", relax.TensorType(shape, F32))
    with bb.function("main", [x, t]):
        outs = []
        for _ in range(2):
            with bb.dataflow():
                e = bb.emit(R.subtract(bb.emit(R.astype(x, F32)), t))
                outs.append(bb.emit_output(R.sum(bb.emit(R.multiply(e, e)), [0, 1])))
            outs.append(bb.emit(R.add(outs[-1], outs[-1])))  # a binding outside: the blocks stay two
        bb.emit_func_output(relax.Tuple(outs))
    before = bb.get()
    assert len(before["main"].body.blocks) == 4
    assert _sums_calls(FuseColumnSums()(before)) == ([], [list(shape)] * 2)


def test_bert_layer_route_takes_the_loss_sums():
    """On the CUDA route (nvcc-free), with the rewrite on, a BERT layer's loss and its last layer
    norm's dgamma and dbeta are one column_sums call reading that layer norm's input and the target."""
    from tvm_evt import models, pipeline, tuning

    entry = models.ZOO["bert_layer"](batch=2, seq=16, hidden=64, heads=4)
    _, graph = tuning.training_graph(entry, "bf16")
    cuda = tvm.target.Target(CUDA)
    passes = tuning.without_builds(pipeline.phases(cuda))
    names = [p.info.name for p in passes]
    with cuda:
        base = tvm.transform.Sequential(passes[:names.index("FuseColumnSums") if "FuseColumnSums" in names
                                                else names.index("SplitReduction")])(graph.mod)
    after = FuseColumnSums()(base)
    # (the first layer norm's dgamma and dbeta, over its stored gradient, are FuseColumnMoments' pair)
    calls = [b.value for block in after["train_step"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir")
             and isinstance(b.value.args[0], tvm.ir.GlobalVar) and b.value.args[0].name_hint == "column_sums"]
    assert len(calls) == 1 and len(json.loads(str(after[calls[0].args[0]].attrs[cs.SUMS_ATTR]))["terms"]) == 3
    target = [p for p in after["train_step"].params if p.name == "args_1"][0]
    assert any(a.same_as(target) for a in calls[0].args[1].fields)


def test_spec_errors_name_the_reason():
    with pytest.raises(ValueError, match="not supported"):
        cs.sums_primfunc((4, 6), [((4, 6), F32)], [["in", 0]])  # 6 channels: not a multiple of the lanes
    with pytest.raises(ValueError, match="not supported"):
        cs.sums_primfunc((4, 8), [((2, 8), F32)], [["in", 0]])  # a leaf of no class
    with pytest.raises(ValueError, match="terms read leaves"):
        cs.sums_primfunc((4, 8), [((4, 8), F32)], [["in", 1]])
    with pytest.raises(ValueError, match="unknown term op"):
        cs.sums_primfunc((4, 8), [((4, 8), F32)], [["exp", ["in", 0]]])


# a spec of each leaf class: the BERT loss terms over a full bf16 x, per-row mean/rstd, per-channel
# gamma/beta, a full float32 t and a scalar
def _terms():
    xhat = ["multiply", ["subtract", ["astype", ["in", 0], F32], ["in", 1]], ["in", 2]]
    e = ["subtract", ["add", ["multiply", xhat, ["in", 3]], ["in", 4]], ["in", 5]]
    g = ["multiply", ["in", 6], e]
    return [["multiply", e, e], ["multiply", g, xhat], g, ["divide", ["in", 5], ["const", 4.0, F32]]]


def _leaves(shape):
    row, vec = list(shape[:-1]) + [1], [shape[-1]]
    return [(shape, "bfloat16"), (row, F32), (row, F32), (vec, F32), (vec, F32), (shape, F32), ([], F32)]


def _gpu_source(shape):
    func = cs.sums_gpu_primfunc(shape, _leaves(shape), _terms()).with_attr("global_symbol", "k")
    return tvm.compile(tvm.IRModule({"k": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()


def test_gpu_form_reads_each_full_leaf_once_a_row_as_vectors():
    src = _gpu_source([64, 16, 256])
    # one vector load of x (8-byte bf16x4) and of t (16-byte float4) a row, written as a load and a store
    assert src.count("*(nv_bfloat164*)(") == cs.UNROLL * 2
    assert src.count("*(float4*)(") >= cs.UNROLL * 2
    kernels = set(re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(', src))
    assert "__syncthreads()" in src and len(kernels) == 2, kernels  # the partials, then their sums


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_gpu_form_compiles_with_nvcc():
    src = _gpu_source([3, 37, 16])  # ragged: the row guards
    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 512, 1024), (3, 37, 16), (128, 197, 768)])
def test_gpu_form_matches_float64(shape):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    shape = list(shape)
    func = cs.sums_gpu_primfunc(shape, _leaves(shape), _terms()).with_attr("global_symbol", "k")
    lib = tvm.compile(tvm.IRModule({"k": func}), target=tvm.target.Target(CUDA))
    _, row_blocks, _ = cs.grid(shape)
    c = shape[-1]
    row, vec = shape[:-1] + [1], [c]
    ins = [(torch.randn(shape, device="cuda") * 2 + 1).bfloat16(), torch.randn(row, device="cuda"),
           torch.rand(row, device="cuda") + 0.5, torch.randn(vec, device="cuda"), torch.randn(vec, device="cuda"),
           torch.randn(shape, device="cuda"), torch.tensor(3e-3, device="cuda")]
    outs = [torch.full(cs.keep_shape(shape), float("nan"), device="cuda") for _ in range(4)]
    outs += [torch.full((row_blocks, c), float("nan"), device="cuda") for _ in range(4)]
    lib["k"](*[tvm.runtime.from_dlpack(t) for t in ins + outs])
    torch.cuda.synchronize()
    x, mean, rstd, gamma, beta, t, s = (a.double() for a in ins)
    xhat = (x - mean) * rstd
    e = xhat * gamma + beta - t
    g = s * e
    axes = tuple(range(len(shape) - 1))
    want = [(e * e).sum(axes), (g * xhat).sum(axes), g.sum(axes), (t / 4).sum(axes)]
    for got, w in zip(outs, want):
        torch.testing.assert_close(got.double().reshape(c), w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))
    for p, total in zip(outs[4:], outs[:4]):  # the partials add up to the sums
        torch.testing.assert_close(p.sum(0), total.reshape(c), rtol=1e-5, atol=1e-3)
