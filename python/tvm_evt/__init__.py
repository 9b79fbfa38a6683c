"""tvm-evt: training compiler for PyTorch models on TVM Relax with CUTLASS EVT epilogue fusion.

    step = tvm_evt.compile_training(model, example_inputs, loss_fn=None, optimizer=None,
                                    target=None, precision="fp32")
    loss = step(*inputs)
"""

__version__ = "0.1.0"

from . import optim
from .errors import InputMismatchError, UnsupportedOpError
from .frontend import from_torch
from .training import TrainingStep, build_training_module, compile_training, cpu_target, default_target

__all__ = [
    "compile_training",
    "from_torch",
    "build_training_module",
    "default_target",
    "cpu_target",
    "TrainingStep",
    "UnsupportedOpError",
    "InputMismatchError",
    "optim",
]
