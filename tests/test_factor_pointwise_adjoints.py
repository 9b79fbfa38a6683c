"""FactorPointwiseAdjoints: a backward linear in dy through a pointwise chain becomes dy * J, J made
of forward values only — structure, what the forward keeps, and the numbers against torch."""
import math

import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_evt
from tvm_evt import pipeline
from tvm_evt.relax_passes._rewrite import flat_bindings, op_name, static_shape
from tvm_evt.relax_passes.graph.factor_pointwise_adjoints import FactorPointwiseAdjoints, factor_roots
from tvm_evt.relax_passes.partition.rematerialize import loss_var

GRAD_TOL = 1e-4  # of the largest gradient's norm


@I.ir_module
class Before:
    @R.function
    def main_adjoint(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            h = R.matmul(x, w)
            t = R.tanh(h)
            y = R.multiply(h, t)
            loss = R.sum(y)
            dy = R.broadcast_to(R.const(1.0, "float32"), R.shape([4, 8]))
            dh1 = R.multiply(dy, t)
            dt = R.multiply(dy, h)
            tt = R.multiply(t, t)
            one_minus = R.subtract(R.const(1.0, "float32"), tt)
            dh2 = R.multiply(dt, one_minus)
            dh = R.add(dh1, dh2)
            xt = R.permute_dims(x)
            dw = R.matmul(xt, dh)
            R.output(loss, dw)
        return ((loss,), (dw,))


@I.ir_module
class Expected:
    @R.function
    def main_adjoint(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            h = R.matmul(x, w)
            t = R.tanh(h)
            # J = t + h * (1 - t * t), in the forward once t exists (dh1 = 1 * t and dt = 1 * h are t
            # and h themselves)
            tt = R.multiply(t, t)
            one_minus = R.subtract(R.const(1.0, "float32"), tt)
            dh2 = R.multiply(h, one_minus)
            j = R.add(t, dh2)
            y = R.multiply(h, t)
            loss = R.sum(y)
            dy = R.broadcast_to(R.const(1.0, "float32"), R.shape([4, 8]))
            dh = R.multiply(dy, j)
            xt = R.permute_dims(x)
            dw = R.matmul(xt, dh)
            R.output(loss, dw)
        return ((loss,), (dw,))


def test_a_linear_backward_becomes_dy_times_a_forward_factor():
    after = FactorPointwiseAdjoints()(Before)
    tvm.ir.assert_structural_equal(after["main_adjoint"], Expected["main_adjoint"])


def _region(body) -> tvm.IRModule:
    """Before with the backward from dy to dh replaced by `body(dy, h, t, mask, keep)`."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    with bb.function("main_adjoint", [x, w]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w))
            t = bb.emit(relax.op.tanh(h))
            mask = bb.emit(relax.op.greater(h, relax.const(0.0, "float32")))
            keep = bb.emit(relax.op.less(t, relax.const(0.5, "float32")))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(h, t)))
            dy = bb.emit(relax.op.broadcast_to(relax.const(1.0, "float32"), relax.ShapeExpr([4, 8])))
            dh = bb.emit(body(dy, h, t, mask, keep))
            dw = bb.emit_output(relax.op.matmul(relax.op.permute_dims(x), dh))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dw])]))
    return bb.get()


@pytest.mark.parametrize("body,factored", [
    (lambda dy, h, t, m, k: relax.op.multiply(relax.op.multiply(dy, h), t), True),
    (lambda dy, h, t, m, k: relax.op.where(m, relax.op.multiply(dy, h), relax.op.multiply(dy, t)), True),
    (lambda dy, h, t, m, k: relax.op.divide(relax.op.negative(relax.op.multiply(dy, h)), t), True),
    (lambda dy, h, t, m, k: relax.op.multiply(relax.op.multiply(dy, dy), relax.op.multiply(h, t)), False),
    (lambda dy, h, t, m, k: relax.op.multiply(relax.op.exp(dy), relax.op.multiply(h, t)), False),
    (lambda dy, h, t, m, k: relax.op.add(relax.op.multiply(dy, h), t), False),  # affine, not linear
    (lambda dy, h, t, m, k: relax.op.divide(h, relax.op.multiply(dy, t)), False),
    (lambda dy, h, t, m, k: relax.op.multiply(dy, h), False),  # one forward tensor: nothing to gain
    # two boolean masks (a ReLU's, a dropout's) are fewer bytes than a float32 J
    (lambda dy, h, t, m, k: relax.op.where(m, relax.op.where(k, dy, relax.const(0.0, "float32")),
                                           relax.const(0.0, "float32")), False),
], ids=["product", "where", "negated-quotient", "dy-squared", "exp-dy", "affine", "dy-divisor", "one-read", "masks"])
def test_only_linear_regions_reading_two_forward_tensors_are_factored(body, factored):
    func = _region(body)["main_adjoint"]
    assert bool(factor_roots(func).roots) == factored


class _TanhGeluMlp(torch.nn.Module):
    """transformers' GPT-2 MLP (NewGELUActivation written out as ops) and a Llama SiLU gate."""

    def __init__(self, d: int = 16, f: int = 32):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
        self.gate, self.up, self.down = (torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False),
                                         torch.nn.Linear(f, d, bias=False))

    def forward(self, x):
        h = self.fc(x)
        g = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        x = x + self.proj(g)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def _saved_producers(func: relax.Function, size: int) -> list:
    """The ops making the forward values of `size` elements read after the loss."""
    bindings, _ = flat_bindings(func)
    index = {b.var: i for i, b in enumerate(bindings)}
    boundary = index[loss_var(func, bindings)]
    forward = {b.var: b.value for b in bindings[: boundary + 1]}
    read = {v for b in bindings[boundary + 1:] for v in relax.analysis.free_vars(b.value) if v in forward}
    return sorted(op_name(forward[v]) or "" for v in read
                  if static_shape(v) and math.prod(static_shape(v)) == size)


def test_the_forward_keeps_one_factor_per_short_chain_and_gradients_match_torch(monkeypatch):
    torch.manual_seed(0)
    module = _TanhGeluMlp()
    x, target = torch.randn(4, 16), torch.randn(4, 16)
    # the GELU kept as the ops it is written with (RecognizeActivations would make it one op): a
    # pointwise chain longer than MAX_OPS
    monkeypatch.setenv(pipeline.DISABLE_ENV, "activations")
    graph = tvm_evt.build_training_module(tvm_evt.from_torch(module, (x, target), F.mse_loss), None, "fp32")

    def saved(on: bool) -> list:
        monkeypatch.setenv(pipeline.DISABLE_ENV, "activations" if on else "factor_adjoints,activations")
        mod = tvm.transform.Sequential(pipeline.pre_partition_passes())(graph.mod)
        return _saved_producers(mod["main_adjoint"], 4 * 32)

    before, after = saved(False), saved(True)
    # the SiLU gate's backward (7 ops) reads J alone: no sigmoid(g) or 1 - sigmoid(g) kept; the
    # tanh GELU's (15 ops, over MAX_OPS) is left alone: its tanh is still kept
    assert before.count("relax.sigmoid") == 1 and "relax.sigmoid" not in after, (before, after)
    assert len(after) == len(before) - 2, (before, after)
    assert "relax.tanh" in before and "relax.tanh" in after

    monkeypatch.setenv(pipeline.DISABLE_ENV, "")
    step = tvm_evt.compile_training(module, (x, target), loss_fn=F.mse_loss, target="llvm")
    loss, grads = step.loss_and_grads(x, target)
    module.zero_grad()
    ref = F.mse_loss(module(x), target)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
    params = dict(module.named_parameters())
    largest = max(p.grad.norm() for p in params.values())
    for name, p in params.items():
        err = float((grads[name] - p.grad).norm() / largest)
        assert err <= GRAD_TOL, f"{name}: {err:.2e}"


def test_a_long_pointwise_backward_chain_is_walked_without_recursion():
    """An unrolled recurrence (an LSTM over 256 steps) chains thousands of pointwise backward ops:
    the region's walk passed Python's recursion limit.  Past ``MAX_OPS`` the region is left as it is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main_adjoint", [x]):
        with bb.dataflow():
            t = bb.emit(relax.op.tanh(x))
            loss = bb.emit(relax.op.sum(t))
            g = bb.emit(relax.op.broadcast_to(relax.const(1.0, "float32"), relax.ShapeExpr([4, 8])))
            for _ in range(5000):
                g = bb.emit(relax.op.multiply(g, t))
            out = bb.emit_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([g])]))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(FactorPointwiseAdjoints()(mod), mod)
