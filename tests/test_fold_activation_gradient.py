"""FoldActivationGradient: GELU's derivative, as the training graph's gradient rules spell it,
becomes one GELU_GRAD / GELU_TANH_GRAD node of the epilogue; the folded partition computes what
TVM's own lowering of the same Relax function computes, and the emitted kernel shares gelu's
erf / tanh term between the two nodes."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.codegen import emit, from_function, lower, reference
from tvm_evt.codegen.ir import Compute, OpKind, ScalarBroadcast, canonicalize
from tvm_evt.codegen.passes import FoldActivationGradient, PIPELINE
from tvm_evt.relax_passes.training import gradient_rules

M, N, K = 32, 48, 16
ACTIVATIONS = {  # relax op, its gradient rule, the folded node
    "gelu": (relax.op.nn.gelu, gradient_rules.gelu_grad, OpKind.GELU_GRAD),
    "gelu_tanh": (relax.op.nn.gelu_tanh, gradient_rules.gelu_tanh_grad, OpKind.GELU_TANH_GRAD),
}


def forward_saving_derivative(act: str, dtype: str) -> relax.Function:
    """matmul + bias, then the activation and its derivative (the gradient rule's expression with
    an incoming gradient of one): what the partitioner puts in an MLP's forward GEMM."""
    op, rule, _ = ACTIVATIONS[act]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((M, K), dtype))
    w = relax.Var("w", relax.TensorType((K, N), dtype))
    b = relax.Var("b", relax.TensorType((N,), dtype))
    with bb.function("f", [x, w, b]):
        with bb.dataflow():
            z = bb.emit(relax.op.add(relax.op.matmul(x, w), b))
            call = op(z)
            y = bb.emit(call)
            (grad,) = rule(y, call, relax.const(1.0, dtype), None)
            d = bb.emit(grad)
            out = bb.emit_output(relax.Tuple([y, d]))
        bb.emit_func_output(out)
    return bb.get()["f"]


def _computes(partition) -> list[OpKind]:
    return [n.op for n in partition.epilogue.nodes if isinstance(n, Compute)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_gradient_rule_folds_to_one_node(act, dtype):
    lowered = lower(from_function(forward_saving_derivative(act, dtype)))
    ops = _computes(lowered)
    assert ops.count(ACTIVATIONS[act][2]) == 1, lowered.epilogue
    assert not {OpKind.ERF, OpKind.TANH, OpKind.EXP} & set(ops), lowered.epilogue
    # what is left: the bias add, the activation, the derivative, the incoming gradient's x 1
    assert len(ops) <= 5, lowered.epilogue


def test_unmatched_constant_is_left_alone():
    """A derivative-like expression with another constant (here 1/2 -> 1/3) is not GELU's."""
    func = forward_saving_derivative("gelu", "float32")
    parsed = from_function(func)
    nodes = list(parsed.epilogue.nodes)
    halves = [i for i, n in enumerate(nodes) if isinstance(n, ScalarBroadcast) and n.value == 0.5]
    assert halves
    nodes[halves[0]] = replace(nodes[halves[0]], value=1.0 / 3.0)
    changed = replace(parsed, epilogue=canonicalize(nodes))
    lowered = lower(changed)
    assert OpKind.GELU_GRAD not in _computes(lowered)
    assert OpKind.ERF in _computes(lowered)


def _without_fold(partition):
    for pass_cls in PIPELINE:
        if pass_cls is not FoldActivationGradient:
            partition = pass_cls()(partition)
    return partition


def _inputs(dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=s) for s in ((M, K), (K, N), (N,))]
    return [reference.round_to(a, dtype).astype(np.float32) for a in arrays]


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_folded_partition_matches_tvm(act):
    """float32: the interpreter on the folded partition against TVM's LegalizeOps + llvm."""
    func = forward_saving_derivative(act, "float32")
    arrays = _inputs("float32")
    mod = relax.transform.LegalizeOps()(tvm.IRModule({"f": func}))
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), tvm.cpu())
    expected = [r.numpy() for r in vm["f"](*[tvm.runtime.tensor(a) for a in arrays])]
    got = reference.evaluate(lower(from_function(func)), arrays)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_folded_bf16_derivative_is_rounded_once(act):
    """bf16: the folded derivative is the exact one rounded once (one ulp), closer to it than the
    spelled-out expression, whose dozen intermediates are each rounded to bf16."""
    parsed = from_function(forward_saving_derivative(act, "bfloat16"))
    arrays = _inputs("bfloat16")
    z = reference.round_to(reference.round_to(arrays[0].astype(np.float64) @ arrays[1], "bfloat16") + arrays[2],
                           "bfloat16")
    exact = reference.UNARY[ACTIVATIONS[act][2]](z)
    folded = reference.evaluate(lower(parsed), arrays)[1].astype(np.float64)
    unfolded = reference.evaluate(_without_fold(parsed), arrays)[1].astype(np.float64)
    np.testing.assert_allclose(folded, exact, rtol=2.0**-8, atol=1e-6)
    assert np.abs(folded - exact).max() < np.abs(unfolded - exact).max()


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_emitted_kernel_shares_the_activation_term(act):
    source = emit(lower(from_function(forward_saving_derivative(act, "bfloat16"))))
    grad = {"gelu": "GeluGrad", "gelu_tanh": "GeluTanhGrad"}[act]
    fwd = {"gelu": "Gelu", "gelu_tanh": "GeluTanh"}[act]
    assert f"Sm90Compute<tvm_evt::{grad}," in source and f"Sm90Compute<tvm_evt::{fwd}," in source
    shared = {"gelu": "0.5f * gelu_cdf_term(x)", "gelu_tanh": "0.5f * (1.0f + gelu_tanh_term(x))"}[act]
    assert f"TVM_EVT_UNARY({grad}, {shared}" in source
