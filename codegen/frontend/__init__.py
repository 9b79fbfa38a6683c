"""Frontend: Relax partition -> epilogue IR."""
from .relax_partition import (
    DROPOUT_EXTERN,
    GELU_BACKWARD_EXTERN,
    RELU_BACKWARD_EXTERN,
    SUPPORTED_EXTERNS,
    SUPPORTED_OPS,
    from_bindings,
    from_check_context,
    from_function,
)

__all__ = [
    "DROPOUT_EXTERN", "GELU_BACKWARD_EXTERN", "RELU_BACKWARD_EXTERN", "SUPPORTED_EXTERNS",
    "SUPPORTED_OPS", "from_bindings", "from_check_context", "from_function",
]
