"""CaptureStepGraphs: TVM's RewriteCUDAGraph confined to train_step.

TVM's pass merges the storages it lifts out of every function into one ``cuda_graph_alloc``, so the
step allocated ``main_adjoint``'s storages too (BERT-Large's budgeted step ran out of an H200's
memory that way).  Checked: TVM's merge on a two-function module; ours captures the step as TVM
would alone and leaves the other function as it was; the CUDA route's step lifts exactly its own
planned storages."""
import re

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvm_evt import models
from tvm_evt.frontend import from_torch
from tvm_evt.memory import memory_report
from tvm_evt.pipeline import CUDA_GRAPH_CONFIG, graph_capture, pass_context, phases
from tvm_evt.relax_passes.lower.capture_step_graphs import CaptureStepGraphs
from tvm_evt.relax_passes.training.optimizers import AdamW
from tvm_evt.training import as_target, build_training_module, runtime_module
from tvm_evt.unbuilt import without_builds


@I.ir_module
class TwoFunctions:
    @T.prim_func(private=True)
    def double(x: T.Buffer((T.int64(1024),), "float32"), y: T.Buffer((T.int64(1024),), "float32")):
        for i in range(T.int64(1024)):
            y[i] = x[i] * T.float32(2)

    @R.function
    def train_step(x: R.Tensor((1024,), "float32")) -> R.Tensor((1024,), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = TwoFunctions
        s0 = R.memory.alloc_storage(R.shape([4096]), 0, "global", "float32")
        a = R.memory.alloc_tensor(s0, 0, R.shape([1024]), "float32")
        cls.double(x, a)
        s1 = R.memory.alloc_storage(R.shape([4096]), 0, "global", "float32")
        b = R.memory.alloc_tensor(s1, 0, R.shape([1024]), "float32")
        cls.double(a, b)
        out = R.builtin.alloc_tensor(R.shape([1024]), "float32", 0)
        cls.double(b, out)
        return out

    @R.function
    def main_adjoint(x: R.Tensor((1024,), "float32")) -> R.Tensor((1024,), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = TwoFunctions
        s0 = R.memory.alloc_storage(R.shape([4096]), 0, "global", "float32")
        a = R.memory.alloc_tensor(s0, 0, R.shape([1024]), "float32")
        cls.double(x, a)
        s1 = R.memory.alloc_storage(R.shape([4096]), 0, "global", "float32")
        b = R.memory.alloc_tensor(s1, 0, R.shape([1024]), "float32")
        cls.double(a, b)
        s2 = R.memory.alloc_storage(R.shape([4096]), 0, "global", "float32")
        c = R.memory.alloc_tensor(s2, 0, R.shape([1024]), "float32")
        cls.double(b, c)
        out = R.builtin.alloc_tensor(R.shape([1024]), "float32", 0)
        cls.double(c, out)
        return out


def _lifted(mod: tvm.IRModule) -> list:
    """The storages ``cuda_graph_alloc`` allocates (bytes each), [] where there is none."""
    gvs = [gv for gv in mod.get_global_vars() if gv.name_hint == "cuda_graph_alloc"]
    return [int(n) for n in re.findall(r"alloc_storage\(R\.shape\(\[(\d+)\]\)", mod[gvs[0]].script())] if gvs else []


def _captures(func: relax.Function) -> bool:
    return "vm.builtin.cuda_graph" in func.script()


def _copy(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)  # module passes may update their input


def test_tvm_merges_every_functions_storages_into_the_step():
    """Why the pass exists: TVM lifts main_adjoint's three storages into the one allocation that
    train_step, which plans two, makes when it runs."""
    with graph_capture():
        merged = relax.transform.RewriteCUDAGraph()(_copy(TwoFunctions))
    assert _lifted(merged) == [4096] * 3
    assert _captures(merged["train_step"]) and _captures(merged["main_adjoint"])


def test_only_the_step_is_captured_and_the_other_function_is_left_alone():
    with graph_capture():
        ours = CaptureStepGraphs()(_copy(TwoFunctions))
        alone = relax.transform.RewriteCUDAGraph()(
            tvm.IRModule({gv: f for gv, f in TwoFunctions.functions_items() if gv.name_hint != "main_adjoint"}))
    assert _lifted(ours) == [4096] * 2  # the step's own storages
    # the step and what TVM lifts out of it as TVM makes them alone, main_adjoint as it was
    expected = _copy(alone)
    expected[TwoFunctions.get_global_var("main_adjoint")] = TwoFunctions["main_adjoint"]
    tvm.ir.assert_structural_equal(ours, expected)
    assert not _captures(ours["main_adjoint"])


def test_nothing_changes_without_cuda_graphs():
    tvm.ir.assert_structural_equal(CaptureStepGraphs()(_copy(TwoFunctions)), TwoFunctions)


def test_the_cuda_route_step_lifts_its_own_plan():
    """A zoo BERT layer on the CUDA route's passes (no kernel built): the one allocation the
    captured step makes is its own planned storages, and main_adjoint runs kernel by kernel."""
    entry = models.ZOO["bert_layer"](batch=2, seq=64, hidden=128, heads=2)
    graph = build_training_module(from_torch(entry.training_module(), entry.example_inputs()), AdamW(lr=1e-3),
                                  "bf16", inplace=True)
    target = as_target({"kind": "cuda", "arch": "sm_90a"})
    passes = without_builds(phases(target))
    names = [p.info.name for p in passes]
    planned = {}

    @tvm.instrument.pass_instrument
    class Keep:
        def run_after_pass(self, mod, info):
            if info.name in ("StaticPlanBlockMemory", "PackMemoryArena"):
                planned["step"] = mod["train_step"]

    with target, pass_context(config={CUDA_GRAPH_CONFIG: True}, instruments=[Keep()]):
        mod = tvm.transform.Sequential(passes[: names.index("CaptureStepGraphs") + 1])(runtime_module(graph.mod, "train_step", "main_adjoint"))
    storage = memory_report(planned["step"], graph.layout, storages_kept=True)["planned_storage_bytes"]
    assert sum(_lifted(mod)) == storage > 0
    assert _captures(mod["train_step"]) and not _captures(mod["main_adjoint"])
