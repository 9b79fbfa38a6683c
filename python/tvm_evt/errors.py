"""Errors tvm_evt raises at compile and call time."""


class UnsupportedOpError(NotImplementedError):
    """An op tvm_evt cannot import or differentiate, with where it came from in the model."""

    def __init__(self, op: str, module_path: str, reason: str):
        self.op, self.module_path, self.reason = op, module_path, reason
        where = f"module '{module_path}'" if module_path else "the top-level module"
        super().__init__(f"{op} in {where}: {reason}")


class InputMismatchError(ValueError):
    """A training step was called with inputs that do not match what it was compiled for."""


class DataParallelMismatchError(InputMismatchError):
    """Data-parallel ranks compiled different steps (model, shapes, optimizer), or were given
    different state: raised on every rank at the first step, naming what differs where."""
