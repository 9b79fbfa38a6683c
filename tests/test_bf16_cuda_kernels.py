"""Elementwise functions in a bf16 step whose kernels TVM's CUDA route cannot build in bf16 (its
legalisation refuses ``isnan`` of bf16, its codegen has no bf16 ``atan2``, ``asin`` ...,
``hnearbyint`` is no CUDA function, its truncated remainder takes no bf16 vectors):
``AutoMixedPrecision`` computes them in float32, so the step's TVM kernels, as the CUDA route
schedules them, compile with nvcc.  Without a GPU: the kernels are built for sm_90a on the CPU."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvm

from _te_kernels import assert_nvcc_builds, cuda_route_source
from tvm_evt.training import build_training_module, from_torch

FUNCTIONS = {
    "atan2": lambda x: torch.atan2(x, x.abs() + 1),
    "inverse_trigonometric": lambda x: torch.asin(0.5 * torch.tanh(x)) + torch.acos(0.5 * torch.tanh(x)),
    "hyperbolic": lambda x: torch.sinh(0.1 * x) + torch.cosh(0.1 * x) + torch.asinh(x)
    + torch.atanh(0.5 * torch.tanh(x)) + torch.acosh(x.abs() + 1.5),
    "xlogy": lambda x: torch.xlogy(x, x.abs() + 1),  # isnan of its second operand
    "fmod": lambda x: torch.fmod(x, 0.7),
    "round": lambda x: x + (torch.round(2 * x) / 2 - x).detach(),
}


class _Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _float32_ops(mod: tvm.IRModule) -> set:
    """The elementwise ops of the training graph that compute on float32 inputs."""
    found = set()

    def visit(e) -> None:
        if isinstance(e, tvm.relax.Call) and isinstance(e.op, tvm.ir.Op) and e.args and all(
                isinstance(a.ty, tvm.relax.TensorType) and str(a.ty.dtype) == "float32" for a in e.args
                if isinstance(a.ty, tvm.relax.TensorType)):
            found.add(e.op.name)

    for _, func in mod.functions_items():
        if isinstance(func, tvm.relax.Function):
            tvm.relax.analysis.post_order_visit(func.body, visit)
    return found


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_bf16_step_with_the_function_builds_for_cuda(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Apply(FUNCTIONS[name]), nn.Linear(16, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    graph = build_training_module(from_torch(model, (x, y), F.cross_entropy), None, "bf16")
    assert_nvcc_builds(cuda_route_source(graph.mod))


def test_mixed_precision_computes_them_in_float32():
    from tvm_evt.relax_passes.training.auto_mixed_precision import FP32

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Apply(lambda x: torch.atan2(x, x.abs() + 1) + torch.fmod(x, 0.7)),
                          nn.Linear(16, 10))
    graph = build_training_module(from_torch(model, (torch.randn(8, 16), torch.randint(0, 10, (8,))),
                                             F.cross_entropy), None, "bf16")
    assert {"relax.atan2", "relax.mod"} <= FP32
    assert {"relax.atan2", "relax.mod"} <= _float32_ops(graph.mod)
