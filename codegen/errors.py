"""The codegen's exceptions: ``Unsupported`` for partitions it leaves to TVM, ``CodegenError`` when a
BYOC entry (``relax.ext.evt*``) is handed a function it cannot build."""

import tvm_ffi


class Unsupported(Exception):
    """The partition cannot be offloaded; ``reason`` says why (shown to the user, never silent)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@tvm_ffi.register_error
class CodegenError(RuntimeError):
    """A ``relax.ext.evt*`` codegen failed on a function ``RunCodegen`` handed it: the message names
    the codegen, the partition and the reason.  Registered with the FFI, so it reaches the caller of
    ``RunCodegen`` as this class (TVM 0.27 has no ``tvm.error.TVMError``)."""
