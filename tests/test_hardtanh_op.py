"""tvm_evt.hardtanh (relax_passes/ops/hardtanh_op.py): ReLU6 and hardtanh import as the op, whose
gradient reads the output; torch.clamp stays a clip; values and gradients equal torch's, ties at
the bounds included (hardtanh passes no gradient there, clamp does)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from torch import nn

import tvm_evt
from tvm_evt.relax_passes.ops import hardtanh_op


class _Both(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        return F.relu6(h) + F.hardtanh(h, -0.5, 0.5) + torch.clamp(h, 0.0, 6.0)


def _ops(mod):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_hardtanh_imports_as_the_op_and_clamp_as_clip():
    x = torch.randn(4, 6)
    imported = tvm_evt.from_torch(_Both(), (x, torch.randn(4, 6)), F.mse_loss)
    ops = _ops(imported.mod)
    assert ops.count(hardtanh_op.OP) == 2 and ops.count("relax.clip") == 1, ops


def test_gradient_reads_the_output():
    x = relax.Var("x", relax.TensorType([4, 6], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(hardtanh_op.hardtanh(x, 0.0, 6.0))
            loss = bb.emit_output(relax.op.sum(y))
        bb.emit_func_output(loss)
    adjoint = relax.transform.Gradient("main")(bb.get())["main_adjoint"]
    compared = []
    relax.analysis.post_order_visit(adjoint.body, lambda e: compared.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) and e.op.name in ("relax.greater", "relax.less")
                                    else None)
    # the adjoint recomputes nothing: its comparisons read the forward's y (not x, not a copy)
    assert compared and all(c.args[0].name == y.name for c in compared), [c.args[0].name for c in compared]


def test_values_and_gradients_match_torch_at_the_bounds():
    """Inputs hit -0.5, 0, 0.5 and 6 exactly: torch's hardtanh_backward passes nothing there,
    clamp_backward passes everything in [min, max]."""
    torch.manual_seed(0)
    model = _Both()
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(6))
        model.lin.bias.zero_()
    x = torch.tensor([[-0.5, 0.0, 0.5, 6.0, 3.0, -2.0]] * 3 + [[0.25, 7.0, -0.5, 0.5, 6.0, 0.0]])
    target = torch.randn(4, 6)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    step = tvm_evt.compile_training(model, (x, target), loss_fn=F.mse_loss, target="llvm")
    loss, grads = step.loss_and_grads(x, target)
    model.load_state_dict(reference)
    ref = F.mse_loss(model(x), target)
    ref.backward()
    assert abs(float(loss) - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), (name, grads[name], p.grad)
