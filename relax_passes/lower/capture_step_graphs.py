"""CaptureStepGraphs: TVM's ``RewriteCUDAGraph`` for the functions replayed as CUDA graphs only.

``RewriteCUDAGraph`` rewrites every Relax function of a module, and merges the storages it lifts
out of each into one ``cuda_graph_alloc`` shared by all (``MergeAllocationPlans`` in TVM's
``src/relax/transform/rewrite_cuda_graph.cc``): the i-th largest storage of every function becomes
one allocation of the largest of them.  Whichever function runs first allocates them all.  A
training module holds ``train_step`` and ``main_adjoint`` (``TrainingStep.loss_and_grads``), the
same forward and backward without the update, and without the memory budget: on an H200,
BERT-Large's budgeted step (bf16, batch 204) ran out of 139 GB against a plan of 77.5 GB, with its
arena's 73.5 GB merged with ``main_adjoint``'s 700 storages.

This pass runs ``RewriteCUDAGraph`` on a module of the functions to capture (``functions``), the
Relax functions they call and everything else that is not a Relax function (kernels, externs),
then puts the other Relax functions back as they were: they run kernel by kernel, each storage
allocated by its own call.  Like TVM's pass, it does nothing unless the PassContext switches CUDA
graphs on (``CUDA_GRAPH_CONFIG``).
"""

from __future__ import annotations

import tvm
from tvm import relax

CUDA_GRAPH_CONFIG = "relax.backend.use_cuda_graph"  # TVM's switch for RewriteCUDAGraph
STEP = "train_step"  # the function the training runtime runs every step (AppendOptimizer's)


def captured(name: str, functions: tuple = (STEP,)) -> bool:
    """Will the function `name` run as CUDA graphs: the PassContext switches them on and it is one
    of `functions`.  Its static storages are then allocated once and kept."""
    return bool(tvm.transform.PassContext.current().config.get(CUDA_GRAPH_CONFIG, False)) and name in functions


def _called(mod: tvm.IRModule, roots: list, functions: set) -> set:
    """`roots` and the Relax `functions` of `mod` they call, transitively."""
    seen, todo = set(), list(roots)
    while todo:
        gv = todo.pop()
        if gv in seen:
            continue
        seen.add(gv)
        todo += [g for g in relax.analysis.all_global_vars(mod[gv]) if g in functions]
    return seen


@tvm.transform.module_pass(opt_level=0, name="CaptureStepGraphs")
class CaptureStepGraphs:
    """``RewriteCUDAGraph`` confined to `functions` (module docstring)."""

    def __init__(self, functions: tuple = (STEP,)):
        self.functions = tuple(functions)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        relax_functions = [gv for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        roots = [gv for gv in relax_functions if captured(gv.name_hint, self.functions)]
        if not roots:
            return mod
        reached = _called(mod, roots, set(relax_functions))
        left = {gv: mod[gv] for gv in relax_functions if gv not in reached}
        part = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in left}, attrs=mod.attrs)
        rewritten = relax.transform.RewriteCUDAGraph()(part)
        out = tvm.IRModule(dict(rewritten.functions_items()), attrs=rewritten.attrs)
        for gv, func in left.items():
            out[gv] = func
        return out
