"""FuseBatchNorm and the tvm_evt.batch_norm op: the match, its decomposition and its gradient."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvm_evt.relax_passes.ops import batch_norm_op
from tvm_evt.relax_passes.graph.decompose_batch_norm import DecomposeBatchNorm
from tvm_evt.relax_passes.training.fuse_batch_norm import FuseBatchNorm, find_batch_norms

BN = tvm.ir.Op.get(batch_norm_op.OP)
SHAPE, AXES, STAT = (4, 3, 3, 8), [0, 1, 2], (1, 1, 1, 8)  # NHWC, channels last


def _vars(dtype):
    return (relax.Var("x", relax.TensorType(SHAPE, dtype)), relax.Var("g", relax.TensorType(STAT, "float32")),
            relax.Var("b", relax.TensorType(STAT, "float32")))


def _imported(dtype="bfloat16", early_read=False, xhat_read=False):
    """A training batch norm as torch.export and AutoMixedPrecision write it, with the running
    mean's update read after the result (or, `early_read`, before it)."""
    bb = relax.BlockBuilder()
    x, g, b = _vars(dtype)
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            emit = bb.emit
            x32 = emit(relax.op.astype(x, "float32")) if dtype != "float32" else x
            mean = emit(relax.op.mean(x32, AXES, keepdims=True))
            var = emit(relax.op.variance(x32, AXES, keepdims=True))
            running = emit(relax.op.multiply(mean, relax.const(0.1, "float32"))) if early_read else None
            std = emit(relax.op.sqrt(emit(relax.op.add(var, relax.const(1e-5, "float32")))))
            xhat = emit(relax.op.divide(emit(relax.op.subtract(x32, mean)), std))
            z = emit(relax.op.add(emit(relax.op.multiply(xhat, g)), b))
            out = emit(relax.op.astype(z, dtype)) if dtype != "float32" else z
            if running is None:
                running = emit(relax.op.multiply(mean, relax.const(0.1, "float32")))
            extra = [emit(relax.op.multiply(xhat, xhat))] if xhat_read else []
            gv = bb.emit_output(relax.Tuple([out, running, var, *extra]))
        bb.emit_func_output(gv)
    return bb.get()


def _expected(dtype="bfloat16"):
    bb = relax.BlockBuilder()
    x, g, b = _vars(dtype)
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            bn = bb.emit(batch_norm_op.batch_norm(x, g, b, 1e-5, AXES, dtype))
            out, mean, var = (bb.emit(relax.TupleGetItem(bn, i)) for i in range(3))
            running = bb.emit(relax.op.multiply(mean, relax.const(0.1, "float32")))
            gv = bb.emit_output(relax.Tuple([out, running, var]))
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_norm_becomes_one_call_reading_the_narrow_input(dtype):
    tvm.ir.assert_structural_equal(FuseBatchNorm()(_imported(dtype)), _expected(dtype))


def test_statistics_read_before_the_result_are_outputs_of_the_call_placed_early():
    """torch.export updates the running statistics before the affine; the call goes before the
    first binding after its operands, so those readers take its outputs."""
    after = FuseBatchNorm()(_imported(early_read=True))
    calls = [b.value for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls if isinstance(c.op, tvm.ir.Op)] == [batch_norm_op.OP, "relax.multiply"]


def test_left_alone_when_the_normalized_value_is_read_elsewhere():
    before = _imported(xhat_read=True)
    assert not find_batch_norms(before["main"])
    tvm.ir.assert_structural_equal(FuseBatchNorm()(before), before)


def test_malformed_call_is_reported_with_the_op_name():
    x, g, _ = _vars("float32")
    with pytest.raises(Exception, match="tvm_evt.batch_norm: gamma must be float32"):
        relax.BlockBuilder().normalize(batch_norm_op.batch_norm(x, x, g, 1e-5, AXES, "float32"))


@pytest.mark.parametrize("axes, shape", [([0, 1, 2], (6, 5, 5, 16)), ([0, 2, 3], (6, 16, 5, 5))])
@pytest.mark.parametrize("stats_in_loss", [False, True])
def test_gradient_matches_torch(axes, shape, stats_in_loss):
    """loss = Σ y·w (+ Σ mean·u + Σ var·v: the gradient through the statistics too), float32,
    against torch autograd in float64; NHWC and NCHW reduced axes."""
    stat = tuple(1 if a in axes else s for a, s in enumerate(shape))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    g, b, u, v = (relax.Var(n, relax.TensorType(stat, "float32")) for n in "gbuv")
    w = relax.Var("w", relax.TensorType(shape, "float32"))
    with bb.function("main", [x, g, b, w, u, v]):
        with bb.dataflow():
            bn = bb.emit(batch_norm_op.batch_norm(x, g, b, 1e-5, axes, "float32"))
            y, mean, var = (bb.emit(relax.TupleGetItem(bn, i)) for i in range(3))
            loss = bb.emit(relax.op.sum(relax.op.multiply(y, w)))
            if stats_in_loss:
                loss = bb.emit(relax.op.add(loss, relax.op.sum(relax.op.multiply(mean, u))))
                loss = bb.emit(relax.op.add(loss, relax.op.sum(relax.op.multiply(var, v))))
            gv = bb.emit_output(loss)
        bb.emit_func_output(gv)
    mod = relax.transform.Gradient("main", require_grads=[x, g, b])(bb.get())
    rng = np.random.default_rng()
    args = [rng.standard_normal(shape) * 2 + 0.5, rng.standard_normal(stat), rng.standard_normal(stat),
            rng.standard_normal(shape), rng.standard_normal(stat), rng.standard_normal(stat)]
    args = [a.astype("float32") for a in args]
    lowered = relax.transform.LegalizeOps()(DecomposeBatchNorm()(mod))
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    loss, grads = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])

    tx, tg, tb, tw, tu, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=i < 3) for i, a in enumerate(args))
    tmean = tx.mean(dim=axes, keepdim=True)
    tvar = tx.var(dim=axes, unbiased=False, keepdim=True)
    ty = (tx - tmean) / torch.sqrt(tvar + 1e-5) * tg + tb
    tloss = (ty * tw).sum() + ((tmean * tu).sum() + (tvar * tv).sum() if stats_in_loss else 0)
    tloss.backward()
    np.testing.assert_allclose(loss.numpy(), tloss.item(), rtol=1e-4, atol=1e-3)
    for got, want in zip(grads, (tx.grad, tg.grad, tb.grad)):
        want = want.numpy()
        assert np.linalg.norm(got.numpy() - want) <= 1e-4 * np.linalg.norm(want)
