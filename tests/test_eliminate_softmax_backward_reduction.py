import copy

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt import models
from tvm_evt.frontend import from_torch
from tvm_evt.pipeline import pre_partition_passes
from tvm_evt.relax_passes.graph.eliminate_softmax_backward_reduction import EliminateSoftmaxBackwardReduction
from tvm_evt.training import build_training_module

F32 = "float32"


def _attention(scale_fwd=1.25, scale_bwd=1.25, second_mask=False, softmax_axis=-1):
    """Attention forward (softmax, dropout, P·V) and the softmax backward as Gradient writes it."""

    @I.ir_module
    class Module:
        @R.function
        def main(s: R.Tensor((2, 4, 16), F32), v: R.Tensor((2, 16, 8), F32), g: R.Tensor((2, 4, 8), F32),
                 keep: R.Tensor((2, 4, 16), "bool"), keep2: R.Tensor((2, 4, 16), "bool")):
            with R.dataflow():
                p = R.nn.softmax(s, axis=softmax_axis)
                pm = R.where(keep, p, R.const(0.0, F32))
                pd = R.multiply(pm, R.const(scale_fwd, F32))
                o = R.matmul(pd, v)
                vt = R.permute_dims(v, axes=[0, 2, 1])
                dpd = R.matmul(g, vt)
                dpm = R.multiply(dpd, R.const(scale_bwd, F32))
                dp = R.where(keep2 if second_mask else keep, dpm, R.const(0.0, F32))
                t = R.multiply(dp, p)
                r = R.sum(t, axis=[-1], keepdims=True)
                u = R.subtract(dp, r)
                ds = R.multiply(u, p)
                R.output(o, ds)
            return (o, ds)

    return Module


def test_rowsum_over_scores_becomes_rowsum_over_head_dim():
    @I.ir_module
    class Expected:
        @R.function
        def main(s: R.Tensor((2, 4, 16), F32), v: R.Tensor((2, 16, 8), F32), g: R.Tensor((2, 4, 8), F32),
                 keep: R.Tensor((2, 4, 16), "bool"), keep2: R.Tensor((2, 4, 16), "bool")):
            with R.dataflow():
                p = R.nn.softmax(s, axis=-1)
                pm = R.where(keep, p, R.const(0.0, F32))
                pd = R.multiply(pm, R.const(1.25, F32))
                o = R.matmul(pd, v)
                vt = R.permute_dims(v, axes=[0, 2, 1])
                dpd = R.matmul(g, vt)
                dpm = R.multiply(dpd, R.const(1.25, F32))
                dp = R.where(keep, dpm, R.const(0.0, F32))
                t = R.multiply(dp, p)
                go = R.multiply(g, o)
                r = R.sum(go, axis=[-1], keepdims=True)
                u = R.subtract(dp, r)
                ds = R.multiply(u, p)
                R.output(o, ds)
            return (o, ds)

    after = EliminateSoftmaxBackwardReduction()(_attention())
    tvm.ir.assert_structural_equal(after, Expected)


@pytest.mark.parametrize("variant", [dict(scale_bwd=1.5), dict(second_mask=True), dict(softmax_axis=1)])
def test_chains_that_do_not_cancel_are_left_alone(variant):
    before = _attention(**variant)
    tvm.ir.assert_structural_equal(EliminateSoftmaxBackwardReduction()(before), before)


def _run(mod, args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [x.numpy() for x in vm["main"](*[tvm.runtime.tensor(a) for a in args])]


def test_numerics_agree_on_random_inputs():
    rng = np.random.default_rng()
    args = [rng.standard_normal((2, 4, 16)).astype(F32) * 3, rng.standard_normal((2, 16, 8)).astype(F32),
            rng.standard_normal((2, 4, 8)).astype(F32), rng.random((2, 4, 16)) > 0.2,
            rng.random((2, 4, 16)) > 0.2]
    before = _attention()
    want = _run(before, args)
    got = _run(EliminateSoftmaxBackwardReduction()(before), args)
    for w, x in zip(want, got):
        np.testing.assert_allclose(x, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["bert_layer", "gpt2_block", "vit"])
def test_zoo_attention_backward_has_no_rowsum_over_probabilities(name):
    """In the bf16 training graph of each attention model, no sum reads ``P ∘ dP`` any more."""
    entry = models.ZOO[name]()
    imported = from_torch(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn)
    mod = build_training_module(imported, None, "bf16").mod
    bindings = lambda m: {b.var: b.value for block in m["train_step"].body.blocks for b in block.bindings}

    def rowsums_over_probabilities(m):
        bound = bindings(m)
        op = lambda e, name: isinstance(e, relax.Call) and e.op == tvm.ir.Op.get(name)
        return [r for r, v in bound.items() if op(v, "relax.sum") and op(bound.get(v.args[0]), "relax.multiply")
                and any(op(bound.get(a), "relax.nn.softmax") for a in bound[v.args[0]].args)]

    passes = list(pre_partition_passes()[0].passes)
    at = [p.info.name for p in passes].index("EliminateSoftmaxBackwardReduction")
    before = tvm.transform.Sequential(passes[:at])(mod)
    assert len(rowsums_over_probabilities(before)) == 1  # one attention layer
    assert rowsums_over_probabilities(passes[at](before)) == []
