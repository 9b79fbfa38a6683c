"""CUDA-graph steps (on by default on CUDA, but for fp16), what can be checked without a GPU:
an in-place step leaves TVM's RewriteCUDAGraph every kernel but those that read the step's inputs
or make its loss; a functional one keeps its optimizer update and state outside the graphs."""
import copy
import re

import pytest
import tvm

from tvm_evt import models, optim
from tvm_evt.frontend import from_torch
from tvm_evt.pipeline import CUDA_GRAPH_CONFIG, graph_capture, tvm_default_cuda_pipeline
from tvm_evt.training import build_training_module, runtime_module


def _kernels(name: str, inplace: bool):
    """(kernels inside the train step's captured graphs, kernels it launches itself)."""
    entry = models.ZOO[name]()
    imported = from_torch(copy.deepcopy(entry.model), entry.example_inputs(), entry.loss_fn)
    graph = build_training_module(imported, optim.AdamW(lr=1e-3), "bf16", inplace=inplace)
    with graph_capture(), tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm"):
        lowered = tvm_default_cuda_pipeline()(runtime_module(graph.mod))
    kernels = [gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    captured = [f.script() for gv, f in lowered.functions_items() if gv.name_hint.startswith("train_step_cuda_graph")]
    step = lowered["train_step"].script()
    calls = lambda k, text: re.search(rf"\b{k}\(", text) is not None
    return ({k for k in kernels if any(calls(k, c) for c in captured)}, {k for k in kernels if calls(k, step)})


@pytest.mark.parametrize("name", ["resnet_basic", "mlp"])
def test_an_inplace_step_is_captured_but_for_its_inputs_and_loss(name):
    inside, outside = _kernels(name, inplace=True)
    assert {"optimizer_update", "write_back"} <= inside
    # left outside: the kernels that read the inputs (non-static: they change every step) and the loss
    assert 0 < len(outside) <= 4 and len(inside) >= 4 * len(outside), (inside, outside)
    functional_inside, functional_outside = _kernels(name, inplace=False)
    # functional: the update writes results the step returns (fresh memory), so it stays outside
    assert "optimizer_update" in functional_outside and len(functional_outside) > len(outside)


def test_graph_capture_keeps_the_callers_pass_context():
    with tvm.transform.PassContext(opt_level=3, config={"relax.backend.use_cuda_graph": False}):
        with graph_capture():
            ctx = tvm.transform.PassContext.current()
            assert ctx.opt_level == 3 and bool(ctx.config[CUDA_GRAPH_CONFIG])


def test_a_cuda_graph_step_refuses_fp16():
    import tvm_evt

    entry = models.ZOO["mlp"]()
    with pytest.raises(ValueError, match="fp16"):
        tvm_evt.compile_training(entry.model, entry.example_inputs(), loss_fn=entry.loss_fn,
                                 target={"kind": "cuda", "arch": "sm_90a"}, precision="fp16", cuda_graph=True)


CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


@pytest.mark.parametrize("target,precision,asked,disable,want", [
    (CUDA, "bf16", None, "", True),  # the default on CUDA
    (CUDA, "fp32", None, "", True),
    (CUDA, "fp16", None, "", False),  # fp16's loss scaler keeps the old parameters: not in place
    (CUDA, "bf16", None, "cuda_graph", False),
    (CUDA, "bf16", False, "", False),
    (CUDA, "fp16", True, "", True),  # asked for: build_training_module refuses it (above)
    (tvm.target.Target("llvm"), "bf16", None, "", False),
    (tvm.target.Target("llvm"), "bf16", True, "", False),
])
def test_which_steps_are_captured(monkeypatch, target, precision, asked, disable, want):
    from tvm_evt.pipeline import DISABLE_ENV
    from tvm_evt.training import captures_graphs

    monkeypatch.setenv(DISABLE_ENV, disable)
    assert captures_graphs(target, precision, asked) is want
