"""Errors tvm_evt raises at compile and call time."""

import re

import tvm_ffi


class UnsupportedOpError(NotImplementedError):
    """An op tvm_evt cannot import or differentiate, with where it came from in the model."""

    def __init__(self, op: str, module_path: str, reason: str):
        self.op, self.module_path, self.reason = op, module_path, reason
        where = f"module '{module_path}'" if module_path else "the top-level module"
        super().__init__(f"{op} in {where}: {reason}")


def module_path(node, strip_prefix: str = "") -> str:
    """The dotted path of the module an exported graph's fx `node` came from ('' at the top)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L['self']", "")
    if strip_prefix and path.startswith(strip_prefix):
        path = path[len(strip_prefix) :]
    return path


class InputMismatchError(ValueError):
    """A training step was called with inputs that do not match what it was compiled for."""


class DataParallelMismatchError(InputMismatchError):
    """Data-parallel ranks compiled different steps (model, shapes, optimizer), or were given
    different state: raised on every rank at the first step, naming what differs where."""



@tvm_ffi.register_error
class MemoryBudgetError(ValueError):
    """``compile_training(..., memory_budget=B)``: no rematerialisation plan the search found brings
    the step's estimated peak under B.  ``budget`` and ``smallest`` (the smallest budget the search
    met, stepping down from the step's own peak; a budget between the two may still be met by a plan
    it did not find) are bytes.  Registered with the FFI, so raised inside the build it reaches the
    caller as this class (rebuilt from its message)."""

    def __init__(self, message: str):
        super().__init__(message)
        found = re.search(r"memory_budget=(\d+) .* the smallest budget the search met is (\d+)", message, re.S)
        self.budget, self.smallest = (int(found[1]), int(found[2])) if found else (None, None)

    @classmethod
    def of(cls, budget: int, smallest: int) -> "MemoryBudgetError":
        return cls(f"memory_budget={budget} bytes ({budget / 2**20:.1f} MiB) cannot be met: no rematerialisation plan "
                   f"found (the integer program in its time limit, else the greedy plan, each validated on the "
                   f"estimate) brings the step's estimated peak under it; the smallest budget the search met is "
                   f"{smallest} ({smallest / 2**20:.1f} MiB)")
