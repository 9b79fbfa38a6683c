"""GPU tier: a bf16 step under a memory budget (Rematerialize) on CUDA keeps less and computes the
same numbers as the step that keeps everything (skipped without CUDA)."""
import numpy as np
import pytest
import torch

from tvm_evt import compile_training, models
from tvm_evt.relax_passes.training.optimizers import AdamW

pytestmark = pytest.mark.gpu
UNLIMITED = 10**15


def _compile(entry, budget, cuda_graph):
    return compile_training(entry.training_module(), entry.example_inputs(), optimizer=AdamW(lr=1e-3), target="cuda",
                            precision="bf16", memory_budget=budget, cuda_graph=cuda_graph)


# as CUDA graphs (the default), the step allocates its storages once; TVM's RewriteCUDAGraph alone
# allocated main_adjoint's with them (CaptureStepGraphs), which only the device's peak shows
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["launched", "cuda_graph"])
def test_budget_step_keeps_less_on_the_device_and_matches(cuda_graph):
    torch.manual_seed(0)
    entry = models.ZOO["mlp"](batch=8192, in_features=256, hidden=512, out_features=64, layers=4, dropout=0.1)
    inputs = [t.cuda() for t in entry.example_inputs()]
    kept = _compile(entry, UNLIMITED, cuda_graph)
    kept_report = kept.memory_report(*inputs)  # runs one step: the measured peak
    budget = int(0.75 * kept_report["rematerialized"]["estimated_peak_before"])
    step = _compile(entry, budget, cuda_graph)
    report = step.memory_report(*inputs)
    decided = report["rematerialized"]
    assert decided["recomputed"] and decided["estimated_peak"] <= budget
    assert report["categories"]["saved_activations"] < kept_report["categories"]["saved_activations"]
    assert report["measured_peak_bytes"] < kept_report["measured_peak_bytes"], (
        report["measured_peak_bytes"], kept_report["measured_peak_bytes"])
    assert report["measured_peak_bytes"] <= budget, (report["measured_peak_bytes"], budget)  # on the device too
    for _ in range(3):  # both ran one step in memory_report; the recomputed values are the same kernels' output
        np.testing.assert_array_equal(float(kept(*inputs)), float(step(*inputs)))
    a, b = kept.parameters(), step.parameters()
    for name in a:
        np.testing.assert_array_equal(a[name].float().cpu().numpy(), b[name].float().cpu().numpy(), err_msg=name)
