"""RecognizeActivations (relax_passes/training/recognize_activations.py): activations written out
as elementwise ops become their Relax op, whatever the spelling; other functions stay as written."""
import copy

import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_evt
from tvm_evt import models
from tvm_evt.relax_passes.training.recognize_activations import RecognizeActivations

from _torch_ref import assert_step_matches_torch

LLVM = tvm.target.Target({"kind": "llvm"})


def test_tanh_gelu_as_gpt2_writes_it_becomes_gelu_tanh():
    """transformers' NewGELUActivation, as imported: eight ops -> one gelu_tanh."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 16), "float32")):
            with R.dataflow():
                a = R.multiply(x, R.const(0.5, "float32"))
                b = R.power(x, R.const(3.0, "float32"))
                c = R.multiply(b, R.const(0.044714998453855515, "float32"))
                d = R.add(x, c)
                e = R.multiply(d, R.const(0.79788458347320557, "float32"))
                t = R.tanh(e)
                f = R.add(t, R.const(1.0, "float32"))
                y = R.multiply(a, f)
                s = R.sum(y)
                R.output(s)
            return s

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 16), "float32")):
            with R.dataflow():
                y = R.nn.gelu_tanh(x)
                s = R.sum(y)
                R.output(s)
            return s

    tvm.ir.assert_structural_equal(RecognizeActivations()(Before), Expected)


def test_an_intermediate_read_elsewhere_is_kept():
    """The tanh is also a block output: it stays computed, the GELU still becomes the op."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8,), "float32")):
            with R.dataflow():
                c = R.multiply(R.multiply(R.multiply(x, x), x), R.const(0.044715, "float32"))
                t = R.tanh(R.multiply(R.add(c, x), R.const(0.7978845608, "float32")))
                y = R.multiply(R.multiply(x, R.const(0.5, "float32")), R.add(R.const(1.0, "float32"), t))
                R.output(y, t)
            return (y, t)

    main = RecognizeActivations()(Before)["main"]
    ops = _ops(main)
    assert ops.count("relax.nn.gelu_tanh") == 1 and ops.count("relax.tanh") == 1


def test_a_different_function_stays_as_written():
    """A tanh expression off by one constant (0.0447 for 0.044715), a sigmoid GELU
    (QuickGELU: x * sigmoid(1.702 x), no op of its own here) and a tanh of two tensors are not a
    GELU."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((8,), "float32"), z: R.Tensor((8,), "float32")):
            with R.dataflow():
                c = R.multiply(R.multiply(R.multiply(x, x), x), R.const(0.0447, "float32"))
                t = R.tanh(R.multiply(R.add(c, x), R.const(0.7978845608, "float32")))
                y = R.multiply(R.multiply(x, R.const(0.5, "float32")), R.add(R.const(1.0, "float32"), t))
                q = R.multiply(x, R.sigmoid(R.multiply(x, R.const(1.702, "float32"))))
                u = R.multiply(R.multiply(z, R.const(0.5, "float32")), R.add(R.const(1.0, "float32"), t))
                R.output(y, q, u)
            return (y, q, u)

    tvm.ir.assert_structural_equal(RecognizeActivations()(Before), Before)


ACTIVATIONS = [  # transformers' activation name -> the op its written-out form becomes
    ("gelu_new", "relax.nn.gelu_tanh"),  # NewGELUActivation: 0.5x(1 + tanh(c(x + a x^3)))
    ("gelu_fast", "relax.nn.gelu_tanh"),  # FastGELUActivation: 0.5x(1 + tanh(x c (1 + a x x)))
    ("gelu_python", "relax.nn.gelu"),  # GELUActivation(use_gelu_python=True): x 0.5 (1 + erf(x / sqrt 2))
]


@pytest.mark.parametrize("name,op", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
def test_transformers_activations_become_the_op_and_train_like_torch(name, op):
    """The activation modules of transformers, imported: each becomes the one op, and a
    two-layer MLP with it trains like torch fp32 (loss and every gradient)."""
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), ACT2FN[name], torch.nn.Linear(32, 4))
    inputs = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    entry = models.ZooEntry(model, lambda: inputs, torch.nn.functional.cross_entropy, name, num_targets=1)
    imported = tvm_evt.from_torch(copy.deepcopy(model), inputs, entry.loss_fn)
    ops = _ops(RecognizeActivations()(imported.mod)["main"])
    assert ops.count(op) == 1 and "relax.tanh" not in ops and "relax.erf" not in ops
    step = tvm_evt.compile_training(copy.deepcopy(model), inputs, loss_fn=entry.loss_fn, target=LLVM)
    assert op in _ops(step.graph.mod["train_step"])
    assert_step_matches_torch(step, entry, inputs)


def _ops(func) -> list[str]:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found
