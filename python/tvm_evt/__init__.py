"""tvm-evt: training compiler for PyTorch models on TVM Relax with CUTLASS EVT epilogue fusion.

    step = tvm_evt.compile_training(model, example_inputs, loss_fn=None, optimizer=None,
                                    target=None, precision="fp32")
    loss = step(*inputs)

Importing the package registers, the way TVM's BYOC backends do: the codegens ``relax.ext.evt``
(CUTLASS SM90 GEMM + EVT epilogue), ``relax.ext.evt_attention`` (flash attention) and
``relax.ext.evt_conv`` (implicit-GEMM convolution) for ``relax.transform.RunCodegen``; the ``evt``
patterns in ``tvm.relax.backend.pattern_registry`` (``partition_for_evt``); and the ``evt``
Relax pipeline for ``tvm.compile(..., relax_pipeline="evt")``.
"""

__version__ = "0.1.0"

from . import optim
from .codegen import patterns as _patterns
from .codegen import relax_ext as _relax_ext
from .codegen.patterns import partition_for_evt
from .errors import DataParallelMismatchError, InputMismatchError, MemoryBudgetError, UnsupportedOpError
from .frontend import from_torch
from .budget import aim_memory_budget, estimate_step_peak, max_batch, planned_step_peak
from .training import TrainingStep, build_training_module, compile_training, cpu_target, default_target

_relax_ext.register()
_patterns.register()

__all__ = [
    "partition_for_evt",
    "compile_training",
    "from_torch",
    "build_training_module",
    "default_target",
    "cpu_target",
    "TrainingStep",
    "UnsupportedOpError",
    "InputMismatchError",
    "DataParallelMismatchError",
    "MemoryBudgetError",
    "max_batch",
    "estimate_step_peak",
    "planned_step_peak",
    "aim_memory_budget",
    "optim",
]
